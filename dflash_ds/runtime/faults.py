"""Fault injection for the reliability tests, driven by environment variables (off by default).

DFLASH_FAULT_RANK     global rank the faults apply to (default: none)
DFLASH_FAULT_KILL_AT  SIGKILL that rank when it starts this step (first attempt only: a
                      torchrun restart does not repeat it)
DFLASH_FAULT_TERM_AT  send SIGTERM to that rank when it starts this step
DFLASH_FAULT_HOLD_UNTIL_STOP_AT  every drafter rank (whatever DFLASH_FAULT_RANK) waits as it starts this step
                      until a stop request is visible to it (at most 120 s): a stop lands at a known step, so a
                      test can assert the step the run stops at (this one: it is finished and checkpointed)
DFLASH_FAULT_TARGET_HOLD_UNTIL_STOP_STEP_AT  every target rank waits as it starts this step until the drafters'
                      stop step is published (at most 120 s): it meets the stop step as a target slower than its
                      drafters does, computing its next batch, not blocked sending one (a test of what it does then)
DFLASH_FAULT_HANG_AT  that rank's main thread stops for good when it starts this step (a stuck rank:
                      its watchdog still beats, so no peer calls it lost)
DFLASH_FAULT_KILL_IN_SAVE  SIGKILL that rank in the middle of the checkpoint of this step
DFLASH_FAULT_SLOW_SAVE_AT  every drafter rank (whatever DFLASH_FAULT_RANK) sleeps DFLASH_FAULT_SLOW_SAVE_S seconds in
                      the checkpoint of these steps (comma-separated), between its shards and the completion: a save
                      slower than the 30 s a launcher waits between its SIGTERM and its SIGKILL
DFLASH_FAULT_BUILD_DELAY_S  that (drafter) rank sleeps this long before building its engine (a slow resume)
DFLASH_INJECT_NAN_STEPS    comma-separated steps at which the leading drafter's loss (its first
                           micro-batch's) becomes NaN
DFLASH_EXIT_STATUS_DIR     every rank writes rank{R}.json there, {"rank", "status", "time", "threads"}, just
                           before it exits (time.time()); a rank SIGKILLed by the faults above writes status -9
                           and the time of the kill, a hanging rank writes rank{R}.hang as it starts to hang.
                           "threads": the Python threads other than the caller still running when the rank
                           leaves through the interpreter's teardown (none are expected: see record_exit);
                           (launch/train_slurm.sbatch sets it too: it requeues a job whose ranks all wrote 75).
                           The record holds nothing derived from a credential, unless:
DFLASH_TEST_EXIT_SALT      (tests only) "credentials": HMAC-SHA256 under this salt of each credential as the
                           libraries read them here (huggingface_hub.get_token(), W&B's WANDB_API_KEY; null where
                           none): a test with a fresh random salt can check a rank got the right value, while no
                           plain sha256 of a token (an offline guess check against `sha256sum`) is ever written
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # the watchdog imports this module: keep it free of torch
    import torch


def _mine() -> bool:
    return os.environ.get("DFLASH_FAULT_RANK") == os.environ.get("DFLASH_GLOBAL_RANK") is not None


def _rank() -> str | None:
    return os.environ.get("DFLASH_GLOBAL_RANK", os.environ.get("RANK"))


def record_exit(status: int, teardown: bool = True) -> None:
    """Tests: this rank's exit status and the time, as it exits (nothing unless DFLASH_EXIT_STATUS_DIR is set).

    `teardown`: the rank leaves through the interpreter's teardown (not `os._exit`). Then the Python threads still
    running are listed: a thread inside a store call as the interpreter finalizes is ended by a forced unwind
    through C++ frames, which aborts the process (seen: ranks that exited 1 reported SIGABRT by torchrun, their
    watchdogs in `TCPStore::check`). The reliability tests assert the list is empty."""
    folder, rank = os.environ.get("DFLASH_EXIT_STATUS_DIR"), _rank()
    if not folder or rank is None:
        return
    import threading

    me = threading.current_thread()
    threads = sorted(t.name for t in threading.enumerate() if t is not me and t.is_alive()) if teardown else []
    path = os.path.join(folder, f"rank{rank}.json")
    record = {"rank": int(rank), "status": status, "time": time.time(), "threads": threads}
    salt = os.environ.get("DFLASH_TEST_EXIT_SALT")
    if salt:
        record["credentials"] = _credential_macs(salt)
    # 0640 whatever the umask (a rank that failed on its config has not set train.umask yet): no world read.
    with os.fdopen(os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640), "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)  # a reader never sees half a file


def _credential_macs(salt: str) -> dict[str, str | None]:
    """Tests: what a test may know of this rank's credentials, keyed by its own salt, as each library reads them."""
    import hashlib
    import hmac

    def mac(value: str | None) -> str | None:
        return hmac.new(salt.encode(), value.encode(), hashlib.sha256).hexdigest() if value else None

    try:
        from huggingface_hub import get_token

        hf = get_token()
    except Exception:  # noqa: BLE001 - no huggingface_hub, or an unreadable token file: none
        hf = None
    return {"hf_token": mac(hf), "wandb_api_key": mac(os.environ.get("WANDB_API_KEY"))}


def _kill_self() -> None:
    record_exit(-int(signal.SIGKILL), teardown=False)
    os.kill(os.getpid(), signal.SIGKILL)


def _first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def at_step(step: int, stop_requested: Callable[[], bool] | None = None,
            stop_step_agreed: Callable[[], bool] | None = None) -> None:
    """Called by every rank as it starts a step; `stop_requested`: a drafter's view of the job-wide stop;
    `stop_step_agreed`: a target's view of the drafters' stop step."""
    for held, variable in ((stop_requested, "DFLASH_FAULT_HOLD_UNTIL_STOP_AT"),
                           (stop_step_agreed, "DFLASH_FAULT_TARGET_HOLD_UNTIL_STOP_STEP_AT")):
        if held is not None and os.environ.get(variable) == str(step):
            deadline = time.monotonic() + 120
            while not held() and time.monotonic() < deadline:
                time.sleep(0.05)
    if not _mine():
        return
    if os.environ.get("DFLASH_FAULT_KILL_AT") == str(step) and _first_attempt():
        _kill_self()
    if os.environ.get("DFLASH_FAULT_TERM_AT") == str(step) and _first_attempt():
        os.kill(os.getpid(), signal.SIGTERM)
    if os.environ.get("DFLASH_FAULT_HANG_AT") == str(step) and _first_attempt():
        folder = os.environ.get("DFLASH_EXIT_STATUS_DIR")
        if folder:
            with open(os.path.join(folder, f"rank{_rank()}.hang"), "w") as f:
                f.write(str(time.time()))
        while True:  # only the watchdog thread's exits end this rank now
            time.sleep(1)


def in_save(step: int) -> None:
    """Called by every drafter rank between writing its shards and the checkpoint's completion."""
    if _mine() and os.environ.get("DFLASH_FAULT_KILL_IN_SAVE") == str(step) and _first_attempt():
        _kill_self()
    if step in _steps(os.environ.get("DFLASH_FAULT_SLOW_SAVE_AT", "")):
        time.sleep(float(os.environ.get("DFLASH_FAULT_SLOW_SAVE_S", "0")))


@functools.cache
def _steps(spec: str) -> frozenset[int]:
    return frozenset(int(x) for x in spec.split(",") if x.strip())


def poison_loss(step: int, micro: int, leader: bool, loss: torch.Tensor) -> torch.Tensor:
    """Called by every drafter on each micro-batch's loss before it is read: NaN where injected."""
    if leader and micro == 0 and step in _steps(os.environ.get("DFLASH_INJECT_NAN_STEPS", "")):
        return loss * math.nan
    return loss


def before_build() -> None:
    """Called by every drafter rank just before it builds its DeepSpeed engine."""
    delay = os.environ.get("DFLASH_FAULT_BUILD_DELAY_S")
    if _mine() and delay:
        time.sleep(float(delay))
