"""`bench pipeline`'s colocated baselines: target forward then drafter step in series on every rank.

(d) runs one child process per rank, data-parallel over all of them; (d') one child alone on
rank 0. A child joins a fresh process group of its own on the job's TCPStore: the job's default
groups are role-local (DeepSpeed sees only drafters there), and a fresh process keeps
DeepSpeed's global state its own. Run as `python -m dflash_ds.bench.colocated` by
`run_colocated`, with its rank and phase in the environment.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

from dflash_ds.bench.stages import capture, make_engine, put, timed, train_step

STORE_PORT_OFFSET = 1  # topology's shared TCPStore
COLOCATED_PORT_OFFSET = 5  # MASTER_PORT seen by the colocated children (a rendezvous port of their own)


def run_colocated(ctx, env, cfg, args, phase: str, world: int) -> None:
    """(d) or (d'): one child process per rank below `world`; they meet on the shared store in a fresh group."""
    from dataclasses import asdict

    child_env = dict(os.environ, RANK=str(ctx.global_rank), WORLD_SIZE=str(world),
                     LOCAL_RANK=str(env.local_rank), LOCAL_SIZE=str(env.local_world_size or ctx.layout.world_size),
                     MASTER_ADDR=env.master_addr, MASTER_PORT=str(env.master_port + COLOCATED_PORT_OFFSET),
                     DFLASH_BENCH_STORE=f"{env.master_addr}:{env.master_port + STORE_PORT_OFFSET}",
                     DFLASH_BENCH_CONFIG=json.dumps(asdict(cfg)),
                     DFLASH_BENCH_PHASE=json.dumps({"name": phase, "steps": args.steps, "warmup": args.warmup_steps,
                                                    "drafters": ctx.layout.num_drafters,
                                                    "timeout_s": args.timeout_s}))
    child_env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    proc = subprocess.run([sys.executable, "-m", "dflash_ds.bench.colocated"], env=child_env, stdout=sys.stderr,
                          timeout=args.timeout_s * 2)
    if proc.returncode != 0:
        from dflash_ds.errors import DFlashError

        raise DFlashError(f"colocated baseline ({phase}) failed on rank {ctx.global_rank} (exit {proc.returncode})")


def colocated_child() -> int:
    """Body of one colocated worker: target forward then drafter step, DP over every rank."""
    import datetime

    import torch
    import torch.distributed as dist

    from dflash_ds.config import load_config
    from dflash_ds.data.batching import Cursor
    from dflash_ds.models.target import load_target
    from dflash_ds.runtime.plan import load_batch, open_data, resolve_arch, torch_dtype

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    phase = json.loads(os.environ["DFLASH_BENCH_PHASE"])
    cfg = load_config(None, json.loads(os.environ["DFLASH_BENCH_CONFIG"]))
    addr, port = os.environ["DFLASH_BENCH_STORE"].rsplit(":", 1)
    timeout = datetime.timedelta(seconds=phase["timeout_s"])
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    store = dist.TCPStore(addr, int(port), is_master=False, timeout=timeout)
    from dflash_ds.distributed.topology import role_backend

    dist.init_process_group(role_backend(cuda), store=dist.PrefixStore(f"bench/pipeline/colocated/{phase['name']}",
                                                                              store),
                            rank=rank, world_size=world, timeout=timeout)
    arch, dtype = resolve_arch(cfg), torch_dtype(cfg, cuda)
    target = load_target(cfg.target, dtype=dtype, device=device)
    engine = make_engine(cfg, dtype)
    data = open_data(cfg, world, arch.vocab_size)
    # The same global batch stream as the pipeline's first steps x drafters batches, `world` per step.
    n_steps = -(-phase["steps"] * phase["drafters"] // world)
    warmup = -(-phase["warmup"] * phase["drafters"] // world)
    mine = [(k, specs[rank]) for k, (_, specs) in zip(range(n_steps), data.steps(Cursor(0, 0)))]
    loaded = [(k, spec, load_batch(data.dataset, spec)) for k, spec in mine]  # loading is not timed, as in (a)

    def forward_then_step(k: int, batch: dict) -> None:
        """What a colocated worker does per batch."""
        train_step(engine, cfg, capture(target, batch, arch, device, cfg.loss.kl_weight > 0), k * world + rank, k, dtype)

    work = [(k, spec.real_tokens, functools.partial(forward_then_step, k, batch)) for k, spec, batch in loaded]
    put(store, f"bench/pipeline/{phase['name']}/{rank}", timed(work, warmup, device))
    dist.barrier()
    dist.destroy_process_group()
    return 0



if __name__ == "__main__":  # a child started by run_colocated
    raise SystemExit(colocated_child())
