"""Bounded child processes for tests: a hang fails the test, and no process outlives it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator


@contextlib.contextmanager
def process_group(cmd: list[str], **kwargs) -> Iterator[subprocess.Popen]:
    """Popen in a new session, and SIGKILL its whole process group on the way out.

    A launcher's ranks are its children: killing only the launcher (subprocess.run on a timeout,
    or pytest-timeout interrupting the test) would leave them running after the test.
    """
    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_bounded(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Like subprocess.run(capture_output=True, text=True), but a hang fails the test and leaves no process."""
    with process_group(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"{' '.join(cmd[:6])} ... timed out after {timeout}s\nstdout:\n{out[-4000:]}\n"
                                 f"stderr:\n{err[-6000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
