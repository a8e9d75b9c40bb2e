"""Fault injection for the reliability tests, driven by environment variables (off by default).

DFLASH_FAULT_RANK     global rank the faults apply to (default: none)
DFLASH_FAULT_KILL_AT  SIGKILL that rank when it starts this step (first attempt only: a
                      torchrun restart does not repeat it)
DFLASH_FAULT_TERM_AT  send SIGTERM to that rank when it starts this step
DFLASH_FAULT_KILL_IN_SAVE  SIGKILL that rank in the middle of the checkpoint of this step
DFLASH_FAULT_BUILD_DELAY_S  that (drafter) rank sleeps this long before building its engine (a slow resume)
DFLASH_INJECT_NAN_STEPS    comma-separated steps at which the leading drafter's loss (its first
                           micro-batch's) becomes NaN
"""

from __future__ import annotations

import functools
import math
import os
import signal

import torch


def _mine() -> bool:
    return os.environ.get("DFLASH_FAULT_RANK") == os.environ.get("DFLASH_GLOBAL_RANK") is not None


def _first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def at_step(step: int) -> None:
    """Called by every rank as it starts a step."""
    if not _mine():
        return
    if os.environ.get("DFLASH_FAULT_KILL_AT") == str(step) and _first_attempt():
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("DFLASH_FAULT_TERM_AT") == str(step) and _first_attempt():
        os.kill(os.getpid(), signal.SIGTERM)


def in_save(step: int) -> None:
    """Called by every drafter rank between writing its shards and the checkpoint's completion."""
    if _mine() and os.environ.get("DFLASH_FAULT_KILL_IN_SAVE") == str(step) and _first_attempt():
        os.kill(os.getpid(), signal.SIGKILL)


@functools.cache
def _nan_steps(spec: str) -> frozenset[int]:
    return frozenset(int(x) for x in spec.split(",") if x.strip())


def poison_loss(step: int, micro: int, leader: bool, loss: torch.Tensor) -> torch.Tensor:
    """Called by every drafter on each micro-batch's loss before it is read: NaN where injected."""
    if leader and micro == 0 and step in _nan_steps(os.environ.get("DFLASH_INJECT_NAN_STEPS", "")):
        return loss * math.nan
    return loss


def before_build() -> None:
    """Called by every drafter rank just before it builds its DeepSpeed engine."""
    delay = os.environ.get("DFLASH_FAULT_BUILD_DELAY_S")
    if _mine() and delay:
        import time

        time.sleep(float(delay))
