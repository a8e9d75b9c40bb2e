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


def spare_threads() -> int:
    """Threads a test that trains may use: 2 when it has the machine's 2 cores, 1 under `make test`'s two workers
    (each has one core: more threads than cores make torch's threads spin against the other worker's)."""
    return 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


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


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid`."""
    out: list[int] = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(entry))
    return out


def _peak_rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return 0
    return max(int(fields.get(k, "0 kB").split()[0]) for k in ("VmHWM", "VmRSS"))


def run_bounded_peak_rss(cmd: list[str], timeout: float, poll_s: float = 0.3,
                         **kwargs) -> tuple[subprocess.CompletedProcess, dict[int, int]]:
    """`run_bounded`, also sampling the peak resident set (VmHWM) of every descendant: pid -> bytes."""
    import tempfile
    import time

    peaks: dict[int, int] = {}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        with process_group(cmd, stdout=out, stderr=err, text=True, **kwargs) as proc:
            deadline = time.monotonic() + timeout
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    out.seek(0), err.seek(0)
                    raise AssertionError(f"{' '.join(cmd[:6])} ... timed out after {timeout}s\n"
                                         f"stdout:\n{out.read()[-4000:]}\nstderr:\n{err.read()[-6000:]}")
                todo = [proc.pid]
                while todo:
                    pid = todo.pop()
                    peaks[pid] = max(peaks.get(pid, 0), _peak_rss_kib(pid) * 1024)
                    todo.extend(children(pid))
                time.sleep(poll_s)
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read()), peaks
