"""launch/train_multinode.sh's agent watcher (dflash_ds/distributed/agent_watch.py), run through the real script
with a stand-in `torchrun` first on PATH: a process that starts one rank and then behaves as the case needs. The
whole tree is signalled, as SLURM signals every process of a job step.

- an agent stuck after its rank left on SIGTERM (it ignores the signal, as one blocked on a gone rendezvous store
  handles it only when the store call gives up) is SIGKILLed AGENT_GRACE_S after its rank ended;
- an agent whose ranks are done but that waits without a signal (torchrun's exit barrier) is left alone;
- an agent that ends on the signal by itself keeps its own status, and the watcher is gone with it;
- with no signal, an agent whose rank ended cut off from the job store's host (it told the watcher: SIGUSR1 from
  `tell_cut_off`, as the rank's store guard calls it) is SIGKILLed AGENT_GRACE_S after its rank ended; a process
  that is not the caller's sibling is never signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proc_utils import process_group

REPO = Path(__file__).resolve().parents[2]

# The stand-in agent: its rank sleeps until signalled (SIGTERM's default action), then `mode` decides. Under "cut"
# the rank waits for the test's go file (the watcher is ready), tells the watcher as a cut-off rank does and exits 3.
CUT_RANK = ("import os, sys, time\nwhile not os.path.exists(os.environ['GO_FILE']): time.sleep(0.05)\n"
            "from dflash_ds.distributed.agent_watch import tell_cut_off\ntell_cut_off()\nsys.exit(3)")
AGENT = """import os, signal, subprocess, sys, time
mode = sys.argv[sys.argv.index("--mode") + 1]
rank = subprocess.Popen([sys.executable, "-c", CUT_RANK if mode == "cut" else
                         "import time; time.sleep(float(%r))" % ("1" if mode == "barrier" else "60")])
if mode == "stuck":  # after the rank starts: an ignored signal would be ignored by the rank too
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
elif mode == "ends":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
print("agent", os.getpid(), "rank", rank.pid, flush=True)
rank.wait()
time.sleep(4 if mode == "barrier" else 60)
"""


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A folder holding the stand-in `torchrun` and the `python` beside it that the script uses (which runs the
    stand-in for `python -m dflash_ds.distributed.torchrun`, the script's torchrun)."""
    d = tmp_path / "bin"
    d.mkdir()
    (d / "python").write_text(f"#!/bin/sh\nif [ \"$1 $2\" = \"-m dflash_ds.distributed.torchrun\" ]; then shift 2; "
                              f"exec {d / 'torchrun'} \"$@\"; fi\nexec {sys.executable} \"$@\"\n")
    (d / "torchrun").write_text(f"#!{sys.executable}\nCUT_RANK = {CUT_RANK!r}\n{AGENT}")
    for f in d.iterdir():
        f.chmod(0o755)
    return d


def _launch(bin_dir: Path, mode: str):
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO), "NNODES": "1",
           "RDZV_HOST": "127.0.0.1", "NPROC": "1", "AGENT_GRACE_S": "1", "GO_FILE": str(bin_dir / "go")}
    return process_group(["bash", str(REPO / "launch/train_multinode.sh"), "--mode", mode], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _watcher_started(agent: int) -> None:
    """Until the watcher (the agent's child running agent_watch) is there, so that a signal reaches it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and b"agent_watch" in Path(f"/proc/{entry}/cmdline").read_bytes() \
                        and f" {agent} " in Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1]:
                    time.sleep(0.5)  # its handlers are set once its imports are done
                    return
            except OSError:
                continue
        time.sleep(0.05)
    raise AssertionError("the watcher did not start")


def test_an_agent_left_without_ranks_after_a_stop_signal_is_killed(bin_dir):
    with _launch(bin_dir, "stuck") as proc:
        agent, rank = (int(w) for w in proc.stdout.readline().split()[1::2])
        assert agent == proc.pid  # the script exec'd the agent: the scheduler's task is the agent
        _watcher_started(agent)
        os.killpg(proc.pid, signal.SIGTERM)  # every process of the step: the agent, its rank, the watcher
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    assert proc.returncode == -signal.SIGKILL, err
    assert f"torchrun agent {agent} still running 1 s after its ranks ended on SIGTERM" in err, err
    assert 1 <= took < 5, took


def test_without_a_signal_an_agent_waiting_after_its_ranks_is_left_alone(bin_dir):
    with _launch(bin_dir, "barrier") as proc:
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "killed" not in err, err


def test_an_agent_that_ends_on_the_signal_keeps_its_status_and_the_watcher_goes_with_it(bin_dir):
    with _launch(bin_dir, "ends") as proc:
        agent, rank = (int(w) for w in proc.stdout.readline().split()[1::2])
        _watcher_started(agent)
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        watchers = [e for e in os.listdir("/proc") if e.isdigit() and _cmdline(e).find(b"agent_watch") >= 0
                    and str(agent).encode() in _cmdline(e)]
    assert proc.returncode == 3 and "killed" not in err, err
    assert watchers == []


def test_an_agent_whose_rank_ended_cut_off_is_killed_without_a_signal(bin_dir):
    with _launch(bin_dir, "cut") as proc:
        agent, rank = (int(w) for w in proc.stdout.readline().split()[1::2])
        _watcher_started(agent)
        (bin_dir / "go").touch()
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    assert proc.returncode == -signal.SIGKILL, err
    assert f"torchrun agent {agent} still running 1 s after its ranks ended cut off from the job store's host" in err
    assert 1 <= took < 5, took


def test_only_a_sibling_is_told(monkeypatch):
    """tell_cut_off signals the pid DFLASH_AGENT_WATCH_PID names only when it shares the caller's parent: here it
    is the test's own child, so it lives on (SIGUSR1's default action would end it)."""
    from dflash_ds.distributed.agent_watch import tell_cut_off

    child = subprocess.Popen(["sleep", "30"])
    try:
        for value in (str(child.pid), "", "not-a-pid", "999999999"):
            monkeypatch.setenv("DFLASH_AGENT_WATCH_PID", value)
            tell_cut_off()
        time.sleep(0.2)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
