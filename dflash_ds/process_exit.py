"""How a dflash-ds process ends once its work is done: quickly, with nothing lost.

The interpreter's own teardown of a process that imported torch, transformers and DeepSpeed clears
thousands of modules and their objects: 0.6 s after `import torch`, 1.2 s with transformers' Qwen3
and DeepSpeed (measured on 2 CPU cores), in every rank of every job, after its last line. It is also
where distributed jobs hang when a backend's destructors wait on peers that are gone. So a command
that has returned runs what the interpreter would have run for it (the exit handlers: the rank's audit
report, logging's flush, a vLLM server's stop, multiprocessing's joins), flushes its streams, and ends
with `os._exit`. Every file the program writes is closed by then (the trainer closes its metrics, records
and W&B run before it returns; checkpoints are written synchronously). A training rank ends so only when
the job finished (status 0); train.py says why a stopped or failed rank keeps the interpreter's exit.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def exit_now(status: int | None) -> NoReturn:
    """End the process with `status` (None: 0) after the exit handlers and a flush, skipping the teardown."""
    code = 0 if status is None else int(status)
    try:
        atexit._run_exitfuncs()  # noqa: SLF001 - what the interpreter runs at exit, in the same order
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing left to say there
                pass
        os._exit(code)


def say(message: str, stream=None, timeout_s: float = 2.0) -> None:
    """Print one line, waiting at most `timeout_s` for it: for a thread that decides how its rank ends.

    A rank's stdout and stderr are pipes to its launcher (torchrun, slurmstepd), and a pipe whose reader stalls
    blocks the writer once its 64 KiB are full. A watchdog thread blocked there stops beating, and global rank 0
    calls the rank lost and leaves with the store; so the line is written from a thread of its own, and a line
    that cannot be written in time is dropped (the state it reports is published before it is said). stdout is
    flushed after it, the same way: what the rank printed before reaches its log before an `os._exit`."""
    import threading

    def write() -> None:
        try:
            print(message, file=stream if stream is not None else sys.stdout, flush=True)
            sys.stdout.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to say there
            pass

    writer = threading.Thread(target=write, name="dflash-say", daemon=True)
    writer.start()
    writer.join(timeout_s)
