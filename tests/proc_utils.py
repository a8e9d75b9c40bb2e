"""Bounded child processes for tests: a hang fails the test, and no process outlives it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator


TREE_MARK = "DFLASH_TEST_TREE"  # an environment variable every descendant inherits (the tree's mark)


@contextlib.contextmanager
def process_group(cmd: list[str], **kwargs) -> Iterator[subprocess.Popen]:
    """Popen in a new session, and SIGKILL its whole process tree on the way out (`kill_tree`).

    A launcher's ranks are its descendants but not in its process group: torchrun (torch >= 2.13) starts each
    rank in a session of its own, so a group kill of the launcher misses them and a hung job's ranks would keep
    the cores busy for the rest of the suite. The tree is marked through the environment, so a rank whose
    launcher already died (re-parented to init, off the /proc tree) is found too. A guard process does the
    same if this process dies first, even by SIGKILL (a CI time limit): nothing outlives the test run.
    """
    mark = uuid.uuid4().hex
    env = {**(kwargs.pop("env", None) or os.environ), TREE_MARK: mark}
    guard = subprocess.Popen([sys.executable, "-I", "-S", __file__, str(os.getpid()), mark], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc = subprocess.Popen(cmd, start_new_session=True, env=env, **kwargs)
    except BaseException:
        guard.kill(), guard.wait()
        raise
    proc.tree_mark = mark  # type: ignore[attr-defined]
    try:
        yield proc
    finally:
        kill_tree(proc)
        proc.wait()
        guard.kill()
        guard.wait()


def _guard(parent: int, mark: str) -> None:
    """`python proc_utils.py PARENT MARK`: once PARENT is gone, SIGKILL every process marked MARK."""
    while os.getppid() == parent:
        time.sleep(0.2)
    for _ in range(50):
        pids = marked(mark)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def descendants(pid: int) -> list[int]:
    """Every pid below `pid` in the /proc parent tree (children, their children, ...)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ppid = _ppid(int(entry))
            if ppid is not None:
                parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def marked(mark: str) -> list[int]:
    """The live pids whose environment carries TREE_MARK=mark (a zombie's environment reads empty)."""
    needle = f"{TREE_MARK}={mark}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        out.append(int(entry))
            except OSError:
                continue
    return out


def kill_tree(proc: subprocess.Popen) -> list[int]:
    """SIGKILL `proc` and every descendant, however it was started (new sessions included); returns the pids killed.

    The tree is collected before anything is killed (a killed parent's children move to init and drop off the
    walk), then rescanned, by the walk and by the environment mark, until a scan finds nothing new alive: a
    process forked between the scan and the kill is caught by the next scan.
    """
    mark = getattr(proc, "tree_mark", None)
    killed: set[int] = set()
    for _ in range(50):
        found = set(descendants(proc.pid)) | (set(marked(mark)) if mark else set())
        if proc.returncode is None:
            found.add(proc.pid)
        fresh = {pid for pid in found - killed if alive(pid)}
        if not fresh:
            break
        for pid in fresh:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed |= fresh
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever else joined the launcher's group
    return sorted(killed)


def alive(pid: int) -> bool:
    """A process that still runs (a zombie waiting for its reaper has finished)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def spare_threads() -> int:
    """Threads a test that trains may use: 2 when it has the machine's 2 cores, 1 under `make test`'s two workers
    (each has one core: more threads than cores make torch's threads spin against the other worker's)."""
    return 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


_FORKED_WORK = None  # the function forked_map's children run (inherited through fork, not pickled)


def _forked_call(part):
    return _FORKED_WORK(part)


def forked_map(work, parts: list, timeout: float = 600) -> list:
    """[work(part) for part in parts], each part in a process forked from this one (so `work` may close over
    loaded models), as many at once as the test has cores (spare_threads): a single-threaded loop of tiny
    forwards runs on both cores. In this process when it has one core. Results must pickle."""
    global _FORKED_WORK
    import multiprocessing

    if spare_threads() == 1 or len(parts) == 1:
        return [work(part) for part in parts]
    _FORKED_WORK = work
    try:
        with multiprocessing.get_context("fork").Pool(min(spare_threads(), len(parts))) as pool:
            return pool.map_async(_forked_call, parts).get(timeout)
    finally:
        _FORKED_WORK = None


def run_bounded(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Like subprocess.run(capture_output=True, text=True), but a hang fails the test and leaves no process."""
    with process_group(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            out, err = proc.communicate()
            raise AssertionError(f"{' '.join(cmd[:6])} ... timed out after {timeout}s\nstdout:\n{out[-4000:]}\n"
                                 f"stderr:\n{err[-6000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid`."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and _ppid(int(e)) == pid]


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

    peaks: dict[int, int] = {}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        with process_group(cmd, stdout=out, stderr=err, text=True, **kwargs) as proc:
            deadline = time.monotonic() + timeout
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    kill_tree(proc)
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


@contextlib.contextmanager
def subreaper() -> Iterator[None]:
    """Inside, this process adopts the orphans of what it started (PR_SET_CHILD_SUBREAPER): the ranks of a launcher
    killed here become its children, and `reap` reads their exit statuses as their parent sees them."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    assert prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    try:
        yield
    finally:
        prctl(36, 0, 0, 0, 0)


def reap(pid: int, timeout: float) -> int | None:
    """The exit status of `pid` as its parent (this process, once it adopted it) sees it (-N: killed by signal N),
    or None if it was not reaped here within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not (yet) this process's child: its parent's death takes a moment
            done = 0
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


if __name__ == "__main__":
    _guard(int(sys.argv[1]), sys.argv[2])


def dump_rank_stacks(wait_s: float = 1.0, pids: list[int] | None = None) -> list[int]:
    """Each training rank in `pids` (`wait_s` after each), or every one of this machine (`python -m dflash_ds.train`, any host namespace),
    prints its threads' stacks to its own stderr and goes on (SIGUSR2: dflash_ds/train.py); the pids signalled.
    For a test about to fail on a stuck job: the stacks land in the job's log, which the test then prints."""
    if pids is None:
        pids = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            launcher = any(b"torchrun" in a or b"distributed.run" in a or b"launcher" in a for a in argv)
            if b"dflash_ds.train" in argv and b"-m" in argv and not launcher:
                pids.append(int(entry))
    signalled = []
    for pid in pids:  # one at a time: ranks sharing a log would interleave their stacks line by line
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGUSR2)
            signalled.append(pid)
            time.sleep(wait_s)
    return signalled
