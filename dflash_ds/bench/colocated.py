"""`bench pipeline`'s colocated phases: the colocated trainer itself (`--colocate`) on the bench's ranks.

(d) runs the trainer colocated on every rank of the job, (d') on rank 0 alone (the others idle).
Each runs in a child process per rank that joins a fresh job of its own (MASTER_PORT moved up
by a phase's offset, so its store and groups are its own): the bench's default groups are
role-local, and a fresh process keeps DeepSpeed's global state to itself. The child is
`run_job` with topology.colocate, writing metrics.jsonl to `<scratch>/colocated_<phase>`; its
tokens/s is read from those records as (c)'s are. Started as `python -m dflash_ds.bench.colocated`
by `run_colocated`, its rank and phase in the environment.

Batches: the colocated job's global batch is its rank count W (one batch per rank and step), so
it runs ceil(steps x D / W) steps, logging every ceil(warmup x D / W): the same stream of batches
as the pipeline's steps x D, cut into steps of W (with W = 1, (d'), exactly the pipeline's batches).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# MASTER_PORT of each phase's child job, above the bench's own (its store is at +1, role groups +2/+3);
# the child's store and groups sit at +1..+3 above that.
PHASE_PORT_OFFSET = {"d": 5, "s": 9}


def phase_steps(steps: int, warmup: int, drafters: int, world: int) -> tuple[int, int]:
    """(steps, log interval = warm-up steps) of a colocated job on `world` ranks covering steps x drafters batches."""
    return -(-steps * drafters // world), -(-warmup * drafters // world)


def run_colocated(ctx, env, cfg, args, phase: str, world: int, out: Path) -> Path:
    """(d) or (d'): the colocated trainer on the ranks below `world`; returns its run folder."""
    from dataclasses import asdict

    steps, warmup = phase_steps(args.steps, args.warmup_steps, ctx.layout.num_drafters, world)
    run_dir = out / f"colocated_{phase}"
    child = asdict(cfg)
    child["topology"].update({"colocate": True, "colocate_overlap": bool(args.colocate_overlap)})
    child["train"].update({"output_dir": str(run_dir), "max_steps": steps, "log_interval": warmup,
                           "global_batch": world})
    child_env = dict(os.environ, RANK=str(ctx.global_rank), WORLD_SIZE=str(world),
                     LOCAL_RANK=str(env.local_rank), LOCAL_WORLD_SIZE=str(min(world, env.local_world_size or world)),
                     MASTER_ADDR=env.master_addr, MASTER_PORT=str(env.master_port + PHASE_PORT_OFFSET[phase]),
                     DFLASH_BENCH_CONFIG=json.dumps(child))
    for key in ("TORCHELASTIC_USE_AGENT_STORE", "LOCAL_SIZE"):
        child_env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "dflash_ds.bench.colocated"], env=child_env, stdout=sys.stderr,
                          timeout=args.timeout_s * 2)
    if proc.returncode != 0:
        from dflash_ds.errors import DFlashError

        raise DFlashError(f"colocated phase ({phase}) failed on rank {ctx.global_rank} (exit {proc.returncode})")
    return run_dir


def colocated_child() -> int:
    """One rank of the colocated trainer, one thread per rank on CPU as in the bench's other phases."""
    import torch

    from dflash_ds.config import load_config
    from dflash_ds.runtime.launch import run_job

    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    return run_job(load_config(None, json.loads(os.environ["DFLASH_BENCH_CONFIG"])))


if __name__ == "__main__":  # a child started by run_colocated
    raise SystemExit(colocated_child())
