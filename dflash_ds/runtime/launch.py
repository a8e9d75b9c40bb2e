"""One training job on one rank: validate, join the role groups, run the role, shut down."""

from __future__ import annotations

import os
import sys

from dflash_ds.config import Config
from dflash_ds.distributed.credentials import load_secrets_file
from dflash_ds.distributed.launch_env import read_launch_env
from dflash_ds.distributed.layout import Layout, make_layout
from dflash_ds.distributed.topology import init_role_groups, shutdown, warm_up_bridge
from dflash_ds.errors import DFlashError
from dflash_ds.runtime import faults
from dflash_ds.runtime.startup import StartupBound
from dflash_ds.runtime.watchdog import ExitOnSignal, Watchdog


def job_layout(cfg: Config, world_size: int, local_world_size: int | None) -> Layout:
    """Drafters take the first ranks (global rank 0 leads: monitoring, W&B, checkpoints), targets the last.

    With topology.targets_per_node = k, the last k local ranks of every node are targets. Colocated
    (topology.colocate): every rank is a drafter that runs the target itself, one rank is enough.
    """
    if cfg.topology.colocate:
        return Layout(world_size, [], list(range(world_size)), colocated=True,
                      sequence_parallel=cfg.topology.sequence_parallel)
    per_node = cfg.topology.targets_per_node or None
    return make_layout(world_size, None if per_node else cfg.topology.num_target_ranks,
                       nproc_per_node=local_world_size, targets_per_node=per_node,
                       target_parallel=cfg.topology.target_parallel,
                       sequence_parallel=cfg.topology.sequence_parallel)


def validate_job(cfg: Config, world_size: int, local_world_size: int | None) -> Layout:
    """Every cheap check, before any process group or model: layout, target, data, DeepSpeed JSON."""
    from dflash_ds.models.target import read_target_config
    import torch

    from dflash_ds.runtime.engine import load_ds_config, resolve_ds_config
    from dflash_ds.runtime.job import torch_dtype

    layout = job_layout(cfg, world_size, local_world_size)
    if not cfg.target:
        raise DFlashError("no target: pass --target DIR (a local HF model folder)")
    read_target_config(cfg.target)
    if not cfg.data.path:
        raise DFlashError("no data: pass --data DIR (a dataset written by `dflash-ds prepare`)")
    if not os.path.isdir(cfg.data.path):
        raise DFlashError(f"data folder {cfg.data.path} does not exist (run `dflash-ds prepare` first)")
    if cfg.model.attention_backend == "flex" and not torch.cuda.is_available():
        raise DFlashError("model.attention_backend flex needs a CUDA GPU (flex_attention's backward does not run on "
                          "the CPU); use auto or dense")
    # Read and completed as the engine will be (a bad JSON, or bf16 with ZeRO-0, fails on every rank now).
    load_ds_config(resolve_ds_config(cfg), cfg, bf16=torch_dtype(cfg, torch.cuda.is_available()) == torch.bfloat16)
    return layout


def _check_sequence_parallel(arch, layout: Layout, env) -> None:
    """Before any group forms: the drafter supports the SP size (else an error on every rank); rank 0 warns of a
    group whose ranks span nodes."""
    from dflash_ds.distributed.sequence_parallel import check_supported

    check_supported(arch, layout.sequence_parallel)
    across = layout.groups_across_nodes(env.local_world_size)
    if across and env.rank == 0:
        print(f"[dflash-ds] warning: sequence-parallel group(s) {across} span nodes of {env.local_world_size} "
              "ranks: every draft layer's all-to-all crosses the network; place each group on one node (the "
              "drafter ranks of a node a multiple of topology.sequence_parallel)", flush=True)


def run_job(cfg: Config) -> int:
    """This rank's whole life in the job."""
    # Secrets reach a rank on another host by path, never by value (distributed/credentials.py): W&B and the
    # rest read them from the environment, as on the launching host.
    load_secrets_file()
    env = read_launch_env()
    layout = validate_job(cfg, env.world_size, env.local_world_size)
    from dflash_ds.data.stream import open_data
    from dflash_ds.runtime.job import dtype_warning, resolve_arch, torch_dtype

    arch = resolve_arch(cfg)  # before any group: a bad drafter/target pair fails fast on every rank
    if layout.sequence_parallel > 1:
        _check_sequence_parallel(arch, layout, env)
    if env.rank == 0:  # which defaults of the kind this run trains on (config_recipe.py)
        from dflash_ds.config_recipe import recipe_report

        print(f"[dflash-ds] {recipe_report(cfg, arch.kind, arch)}", flush=True)
    # Memory-mapped and cheap: an empty dataset or out-of-vocabulary ids fail here on every rank,
    # before a rank waits in a rendezvous for peers that have already exited.
    from dflash_ds.runtime.resume import choose_resume

    # The checkpoint, its global batch and whether it must be resharded: a drafter count that cannot
    # split the global batch fails here on every rank, before any model loads.
    resume = choose_resume(cfg, layout.num_drafters, log=(lambda s: print(s, flush=True)) if env.rank == 0 else None,
                           data_parallel=layout.data_parallel)
    data = open_data(cfg, layout.data_parallel, arch.vocab_size, resume.global_batch)
    if env.rank == 0:  # rank 0 writes metrics and checkpoints: an unwritable run folder fails now
        from dflash_ds.runtime.checkpoint import check_writable

        check_writable(cfg.train.output_dir)
    bound = StartupBound(env.rank, cfg.train.startup_timeout_s)  # a host that failed to start ends this rank too
    ctx = _join_groups(cfg, layout, env, bound)
    describe = _describer(layout)
    watchdog = Watchdog(ctx.store, env.rank, layout.world_size, describe, cfg.train.heartbeat_timeout_s,
                        launcher_grace_s=cfg.train.launcher_grace_s).start()
    dtype = torch_dtype(cfg, ctx.device.type == "cuda")  # like the drafter shape: derived once, handed to the role
    if env.rank == 0 and (warning := dtype_warning(cfg, ctx.device.type == "cuda")):
        print(f"[dflash-ds] warning: {warning}", file=sys.stderr, flush=True)
    try:
        if ctx.bridge is not None:  # every target-drafter pair connected now, under the start-up timeout
            bound.phase = "connecting the bridge"
            took = warm_up_bridge(ctx, cfg.train.startup_timeout_s)
            if env.rank == 0:
                print(f"[dflash-ds] bridge: {len(layout.target_ranks) * layout.num_drafters} target-drafter pair(s) "
                      f"connected in {took:.1f}s", flush=True)
        bound.done()
        if ctx.is_target:
            from dflash_ds.runtime.target_worker import run_target

            status = run_target(ctx, cfg, data, watchdog, arch, dtype)
        else:
            from dflash_ds.runtime.drafter_worker import run_drafter

            status = run_drafter(ctx, cfg, data, watchdog, resume, arch, dtype)
    except BaseException as exc:
        bound.fail(exc)  # during the bridge warm-up: the others hear of it through the store (else a no-op)
        _name_lost_peers(watchdog, describe)
        # The thread must not be inside a store call when the interpreter finalizes: it would be ended by a
        # forced unwind through C++ frames, and the process aborts (SIGABRT instead of this status; seen on CI).
        watchdog.close()
        faults.record_exit(exc.exit_code if isinstance(exc, DFlashError) else 1)  # as train.main maps it
        raise
    finally:
        sys.stdout.flush()
    # This rank has its exit status now. torchrun sends SIGTERM to every rank still running as soon as one
    # exits non-zero (75 included): a stop they already made is all such a signal could ask for, so it ends
    # the rank with its status at once (ignored, a rank blocked in teardown was SIGKILLed 30 s later: -9).
    on_signal = ExitOnSignal(status, env.rank)
    watchdog.mark_done()
    if env.rank != 0:
        watchdog.close()  # before rank 0, the store's host, may leave
    # Rank 0 waits there for every rank to check out; its watchdog, still running, names a rank that died
    # (torchrun stops the others at once: the drafters checkpoint, a dead target never checks out).
    shutdown(ctx, lost=lambda: len(watchdog.lost))
    watchdog.close()
    on_signal.close()  # the interpreter's teardown would make a SIGTERM -15: ignored from here on
    faults.record_exit(status)
    return status


def _join_groups(cfg: Config, layout: Layout, env, bound: StartupBound):
    """This rank's role groups and bridge (gloo on CPU, NCCL on CUDA), audited where a test asks."""
    import torch

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        ctx = init_role_groups(layout, env.rank, env.master_addr, env.master_port, backend=backend,
                               timeout_s=cfg.train.timeout_s, local_rank=env.local_rank,
                               bridge_timeout_s=cfg.train.bridge_timeout_s,
                               on_store=lambda store: bound.watch_store(store, layout.world_size))
    except BaseException as exc:
        # The error says why here; the ranks on other hosts hear of it through the store when there is one.
        # No thread may outlive the rank's exit (faults.record_exit).
        bound.fail(exc)
        faults.record_exit(exc.exit_code if isinstance(exc, DFlashError) else 1)  # as train.main maps it
        raise
    from dflash_ds.distributed import audit

    if audit.enabled():  # tests: check every tensor handed to torch.distributed (distributed/audit.py)
        ctx.bridge = audit.install(ctx.bridge, ctx.device)
    return ctx


def _describer(layout: Layout):
    """rank -> how the logs name it: its role and index, or its target replica and place in it."""
    def describe(rank: int) -> str:
        if layout.target_parallel > 1 and rank in layout.target_ranks:
            replica, pos = layout.replica_of(rank)
            return f"rank {rank} (target replica {replica}, its rank {pos} of {layout.target_parallel})"
        return f"rank {rank} ({layout.role_name(rank)} {layout.local_rank_in_role(rank)})"
    return describe


def _name_lost_peers(watchdog: Watchdog, describe) -> None:
    """After a failure, say which peers stopped beating (the likely cause), waiting a few beats to see."""
    import time

    deadline = time.monotonic() + 4 * watchdog.interval_s
    lost: list[int] = []
    settle = None
    while time.monotonic() < deadline and (settle is None or time.monotonic() < settle):
        time.sleep(watchdog.interval_s / 2)
        lost = watchdog.stalled_peers(min_age_s=2.5 * watchdog.interval_s)
        if lost and settle is None:
            # a lost host's ranks beat last up to an interval apart: wait for the later ones to count as stalled
            # too, so that every rank of it is named (seen: the target named, its host's drafter not yet)
            settle = time.monotonic() + 1.5 * watchdog.interval_s
    for peer in lost:
        print(f"[dflash-ds] rank {watchdog.rank} at step {watchdog.step}: lost {describe(peer)} "
              f"(no heartbeat since about step {watchdog.peer_step(peer)})", file=sys.stderr, flush=True)
