"""`dflash-ds bench zero`: what each ZeRO stage costs a drafter rank, to choose one.

Launched with torchrun on the drafter ranks (`torchrun --nproc_per_node 2 -m dflash_ds bench
zero`; started without a launcher it re-launches itself that way). No target rank is involved:
the drafter engine sees only drafter ranks in training too, so each stage builds it over a plain
world-wide default group of these ranks.

Every stage runs in a fresh child process per rank: a second `deepspeed.initialize` in one
process inherits DeepSpeed's global state, and the peak resident memory of a process never goes
down, so one process per stage is what makes "peak memory" mean that stage's peak. The children
of a stage meet through a TCPStore that global rank 0 hosts (MASTER_PORT + 1), under a prefix of
their own; rank 0 of the launcher collects their results from it and prints.

How the bytes are counted (per rank, unique storages, so views into one flat buffer count once):

- parameters: each module parameter's storage, or under ZeRO-3 its local partition `p.ds_tensor`;
  the trainable drafter and the frozen target embedding / LM head are counted apart;
- gradients: right after `engine.backward`, the storages of every `p.grad` plus the partitioned
  buffers ZeRO keeps (`averaged_gradients`, `grads_in_partition`, `grad_partitions_flat_buffer`);
- optimizer state: after the first step, the tensors in the wrapped torch optimizer's `state`
  (AdamW exp_avg / exp_avg_sq / step), i.e. `engine.optimizer.optimizer.state` under ZeRO;
- master weights: the tensors that optimizer steps on when they are not the module's own
  parameters (ZeRO's fp32 flat partitions, kept even when training in fp32);
- peak memory: CPU, the process's peak RSS (`ru_maxrss`) and its growth since before the model
  was built; GPU, `torch.cuda.max_memory_allocated`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

from dflash_ds.bench.comm import quiet_stdout, store_barrier
from dflash_ds.bench.table import print_table

STAGE_PORT_BASE = 10  # MASTER_PORT + 10 + k for the children of stage k (a rendezvous port of their own)
GRAD_ATTRS = ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer")
# fp32 partitions ZeRO-1/2, ZeRO-3 and the bf16 optimizer step on (ZeRO-3 detaches them from param_groups between steps).
MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")
TINY = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
            vocab_size=8192, num_target_layers=12)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-ds bench zero`."""
    parser.add_argument("--target", default="", help="target folder whose drafter to size (default: a tiny built-in drafter)")
    parser.add_argument("--drafter-layers", type=int, default=2, help="drafter decoder layers")
    parser.add_argument("--stages", default="0,1,2,3", help="comma-separated ZeRO stages to measure")
    parser.add_argument("--offload", action="store_true", help="also measure ZeRO-3 with CPU offload (ds_configs/zero3_offload.json)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per stage (the first is not timed)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence of the synthetic batch")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per synthetic batch")
    parser.add_argument("--num-anchors", type=int, default=32,
                        help="anchor blocks per sequence (few: activations would hide the states being compared)")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="ranks to launch when started without torchrun")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="timeout of one stage (seconds)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (last stdout line) instead of a table")


def _runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    from dflash_ds.errors import DFlashError

    try:
        stages = [int(s) for s in args.stages.split(",") if s.strip()]
    except ValueError:
        raise DFlashError(f"--stages {args.stages!r}: give stage numbers like 0,1,2,3") from None
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise DFlashError(f"--stages {args.stages!r}: stages are 0, 1, 2 or 3")
    if args.steps < 2:
        raise DFlashError("--steps must be >= 2 (the first step is not timed)")
    return [{"stage": s, "offload": False} for s in stages] + ([{"stage": 3, "offload": True}] if args.offload else [])


def _relaunch(args: argparse.Namespace) -> int:
    """Started without a launcher: run the same command under torchrun on --nproc-per-node ranks."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["--stages", args.stages, "--drafter-layers", str(args.drafter_layers), "--steps", str(args.steps),
            "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--num-anchors", str(args.num_anchors),
            "--timeout-s", str(args.timeout_s)]
    argv += (["--target", args.target] if args.target else []) + (["--offload"] if args.offload else [])
    argv += ["--json"] if args.json else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc_per_node),
           "--master_port", str(port), "-m", "dflash_ds", "bench", "zero", *argv]
    import torch

    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    return subprocess.call(cmd, env=env)


def run(args: argparse.Namespace) -> int:
    """Entry point of `dflash-ds bench zero`."""
    import torch.distributed as dist

    from dflash_ds.distributed.launch_env import read_launch_env

    runs = _runs(args)
    if "RANK" not in os.environ:
        return _relaunch(args)
    env = read_launch_env()
    store = dist.TCPStore(env.master_addr, env.master_port + 1, env.world_size, is_master=env.rank == 0,
                          timeout=datetime.timedelta(seconds=args.timeout_s), wait_for_workers=True)
    spec = {"target": args.target, "drafter_layers": args.drafter_layers, "steps": args.steps,
            "seq_len": args.seq_len, "batch_size": args.batch_size, "num_anchors": args.num_anchors,
            "timeout_s": args.timeout_s}
    rows = []
    with quiet_stdout(enabled=args.json):
        for k, r in enumerate(runs):
            child = dict(os.environ, LOCAL_SIZE=str(env.local_world_size or env.world_size),
                         MASTER_PORT=str(env.master_port + STAGE_PORT_BASE + k),
                         DFLASH_BENCH_STORE=f"{env.master_addr}:{env.master_port + 1}",
                         DFLASH_BENCH_ZERO=json.dumps({**spec, **r, "key": f"bench/zero/{k}"}))
            child.pop("TORCHELASTIC_USE_AGENT_STORE", None)
            proc = subprocess.run([sys.executable, "-m", "dflash_ds.bench.zero"], env=child, stdout=sys.stderr,
                                  timeout=args.timeout_s)
            if proc.returncode != 0:
                from dflash_ds.errors import DFlashError

                raise DFlashError(f"ZeRO-{r['stage']}{' offload' if r['offload'] else ''} failed on rank "
                                  f"{env.rank} (exit {proc.returncode})")
            if env.rank == 0:
                parts = [json.loads(store.get(f"bench/zero/{k}/{i}")) for i in range(env.world_size)]
                rows.append({**parts[0], "step_time_s": max(p["step_time_s"] for p in parts),
                             "peak_bytes": max(p["peak_bytes"] for p in parts)})
        # Rank 0 hosts the store: it leaves only once every rank has checked out.
        if env.rank == 0:
            store_barrier(store, "bench/zero/done", env.world_size, args.timeout_s)
        else:
            store.add("bench/zero/done", 1)
    if env.rank == 0:
        result = {"world_size": env.world_size, "runs": rows}
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            _print(result)
    return 0


# ---------------------------------------------------------------- one stage, in its own process


def _drafter_module(spec: dict[str, Any]):
    """The DrafterTrainModule to size: from --target, or the tiny built-in shape with random embed/head."""
    import torch
    from torch import nn

    from dflash_ds.models.drafter import DFlashDrafter, DrafterArch, default_target_layer_ids
    from dflash_ds.runtime.engine import DrafterTrainModule

    if spec["target"]:
        from dflash_ds.models.from_target import drafter_arch_from_target
        from dflash_ds.models.target import load_target_head

        arch = drafter_arch_from_target(spec["target"], num_layers=spec["drafter_layers"], block_size=8)
        embed, head = load_target_head(spec["target"])
    else:
        n = spec["drafter_layers"]
        arch = DrafterArch(**TINY, num_hidden_layers=n, rms_norm_eps=1e-6, max_position_embeddings=4096,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, block_size=8,
                           mask_token_id=TINY["vocab_size"] - 1,
                           target_layer_ids=default_target_layer_ids(TINY["num_target_layers"], n))
        gen = torch.Generator().manual_seed(0)
        embed = nn.Embedding(arch.vocab_size, arch.hidden_size, _weight=torch.randn(arch.vocab_size, arch.hidden_size, generator=gen) * 0.02)
        head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
    drafter = DFlashDrafter.seeded(arch, 0)
    return DrafterTrainModule(drafter, embed, head), arch


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a flat buffer and its views count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _tensors_in(obj, depth: int = 0):
    """Every tensor inside nested dicts / lists / tuples."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth + 1)
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v, depth + 1)


def _param_bytes(params) -> int:
    return _storage_bytes(getattr(p, "ds_tensor", p) for p in params)


def _grad_bytes(engine) -> int:
    grads = [p.grad for p in engine.module.parameters()]
    for name in GRAD_ATTRS:
        grads += list(_tensors_in(getattr(engine.optimizer, name, None)))
    return _storage_bytes(grads)


def _optimizer_bytes(engine) -> tuple[int, int]:
    """(optimizer state bytes, master weight bytes) of the torch optimizer DeepSpeed steps."""
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    state = _storage_bytes(t for st in base.state.values() for t in _tensors_in(st))
    own = {getattr(p, "ds_tensor", p).untyped_storage().data_ptr() for p in engine.module.parameters()}
    found = [p for g in base.param_groups for p in g["params"]]
    for name in MASTER_ATTRS:
        found += list(_tensors_in(getattr(engine.optimizer, name, None)))
    return state, _storage_bytes(t for t in found if t.untyped_storage().data_ptr() not in own)


def _peak(device) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _stage_child() -> int:
    """One rank of one stage: build the engine, take the steps, publish the sizes."""
    import torch
    import torch.distributed as dist

    from dflash_ds.components.objective import TargetStates
    from dflash_ds.config import Config
    from dflash_ds.runtime.engine import build_engine, load_ds_config, resolve_ds_config

    spec = json.loads(os.environ["DFLASH_BENCH_ZERO"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # ranks share the cores
    addr, port = os.environ["DFLASH_BENCH_STORE"].rsplit(":", 1)
    timeout = datetime.timedelta(seconds=spec["timeout_s"])
    store = dist.TCPStore(addr, int(port), is_master=False, timeout=timeout)
    from dflash_ds.distributed.backends import role_backend

    dist.init_process_group(role_backend(cuda), store=dist.PrefixStore(spec["key"], store), rank=rank,
                            world_size=world, timeout=timeout)
    base_peak = _peak(device)
    cfg = Config()
    cfg.train.zero_stage = spec["stage"]
    cfg.train.max_steps = spec["steps"]
    cfg.loss.num_anchors = spec["num_anchors"]
    if spec["offload"]:
        cfg.train.ds_config = str(resolve_ds_config(cfg).parent / "zero3_offload.json")
    # The trainer refuses bf16 with ZeRO-0 (bf16 weights and gradient accumulation, runtime/engine.py); the
    # table's baseline row measures it as DeepSpeed runs it.
    ds = load_ds_config(resolve_ds_config(cfg), cfg, bf16=cuda and spec["stage"] > 0)
    if cuda and spec["stage"] == 0:
        ds["bf16"] = {"enabled": True}
    ds["zero_force_ds_cpu_optimizer"] = False  # keep the trainer's torch AdamW under offload too
    module, arch = _drafter_module(spec)
    engine = build_engine(module, cfg, ds)
    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    # The target's embedding and LM head: buffers of the module (never ZeRO-partitioned), once if tied.
    frozen = [engine.module.embed_weight] + ([] if engine.module.tied_head else [engine.module.head_weight])
    gen = torch.Generator().manual_seed(rank)
    b, s = spec["batch_size"], spec["seq_len"]
    dtype = torch.bfloat16 if cuda else torch.float32
    states = TargetStates(torch.randint(0, arch.vocab_size - 1, (b, s), generator=gen).to(device),
                          torch.ones(b, s, dtype=torch.long, device=device), torch.full((b,), s, device=device),
                          torch.randn(b, s, len(arch.target_layer_ids) * arch.hidden_size, generator=gen)
                          .to(device, dtype), None)
    grads, times = 0, []
    for step in range(spec["steps"]):
        t0 = time.perf_counter()
        terms, _ = engine(states, cfg.loss, step, 0.0, 0)
        engine.backward(terms.loss)
        if step == 0:
            grads = _grad_bytes(engine)  # before step(): ZeRO frees or reuses the buffers afterwards
        engine.step()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    opt_state, master = _optimizer_bytes(engine)
    peak = _peak(device)
    result = {"stage": spec["stage"], "offload": spec["offload"], "zero_stage_engine": engine.zero_optimization_stage(),
              "trainable_params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in trainable),
              "param_bytes": _param_bytes(trainable), "frozen_param_bytes": _param_bytes(frozen),
              "grad_bytes": grads, "optimizer_state_bytes": opt_state, "master_weight_bytes": master,
              "peak_bytes": peak, "peak_growth_bytes": peak - base_peak,
              "peak_kind": "cuda max_memory_allocated" if cuda else "ru_maxrss",
              "step_time_s": sum(times[1:]) / len(times[1:]), "loss": terms.loss.item()}
    store.set(f"{spec['key']}/{rank}", json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def _print(result: dict[str, Any]) -> None:
    runs = result["runs"]
    rows = [[f"ZeRO-{r['stage']}{' +offload' if r['offload'] else ''}", _mib(r["param_bytes"]), _mib(r["frozen_param_bytes"]),
             _mib(r["grad_bytes"]), _mib(r["optimizer_state_bytes"]), _mib(r["master_weight_bytes"]),
             _mib(r["peak_bytes"]), _mib(r["peak_growth_bytes"]), f"{r['step_time_s'] * 1e3:,.0f}"] for r in runs]
    n = runs[0]["trainable_params"] if runs else 0
    print_table(f"bench zero: {n / 1e6:.1f}M trainable drafter parameters, per rank of {result['world_size']} "
                f"drafter ranks (MiB; peak = {runs[0]['peak_kind'] if runs else ''})",
                ["stage", "params", "frozen", "grads", "optim state", "master", "peak", "peak growth", "step ms"], rows,
                "params = trainable drafter; frozen = target embedding + LM head; master = fp32 copies the optimizer "
                "steps (ZeRO partitions); peak growth = peak minus the peak before the model was built")


if __name__ == "__main__":  # one stage's worker, started by run()
    raise SystemExit(_stage_child())
