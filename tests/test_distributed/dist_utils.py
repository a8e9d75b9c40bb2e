"""Helpers for multi-process tests: free ports, and spawned gloo ranks that fail instead of hanging."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[2]

# Children share 2 cores: one thread each keeps them from starving one another,
# and DeepSpeed must not probe for a GPU.
CHILD_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def free_port_block(n: int = 4) -> int:
    """A base port P with P..P+n-1 all free (init_role_groups uses P+1..P+3)."""
    # Below Linux's ephemeral range (32768+), so client sockets cannot take them.
    for _ in range(200):
        base = random.randint(20000, 32000 - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free block of ports found")


def child_env() -> dict[str, str]:
    """Environment for subprocesses (torchrun, deepspeed): the repo importable, CPU DeepSpeed."""
    env = dict(os.environ, **CHILD_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _child(fn: Callable[..., None], rank: int, args: tuple[Any, ...], out_dir: str) -> None:
    os.environ.update(CHILD_ENV)
    try:
        fn(rank, *args)
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_ranks(fn: Callable[..., None], world_size: int, args: tuple[Any, ...], out_dir: Path,
              timeout_s: float) -> None:
    """Run fn(rank, *args) in `world_size` spawned processes; fail on any error or after timeout_s."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_child, args=(fn, r, args, str(out_dir)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    problem = None
    while any(p.is_alive() for p in procs):
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed:
            problem = f"ranks {failed} failed"
            break
        if time.monotonic() > deadline:
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            problem = f"ranks {alive} still running after {timeout_s:g}s (hang)"
            break
        time.sleep(0.1)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    codes = [p.exitcode for p in procs]
    if problem is None and any(c != 0 for c in codes):
        problem = f"exit codes {codes}"
    if problem:
        errors = "\n".join(f.read_text() for f in sorted(Path(out_dir).glob("rank*.err")))
        raise AssertionError(f"{problem}; exit codes {codes}\n{errors}")
