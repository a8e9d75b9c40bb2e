"""A torchrun agent that outlives its ranks after a stop signal is ended.

Under SLURM a stop (scancel, a time limit's `--signal=TERM@N`, a preemption) signals every process of the job
step: each node's torchrun agent and its ranks. The ranks checkpoint and leave; the agents should follow. An agent
whose main thread is inside a call to the rendezvous store when the node hosting that store has already gone
handles the signal only when the call gives up, and meanwhile retries ("failed to send a keep-alive heartbeat"):
measured once in three scancels under SLURM's default KillWait, 29.8 s (until SLURM's SIGKILL) where its ranks
were gone within a heartbeat. After a time-limit signal no KillWait comes at all until the limit itself.

`launch/train_multinode.sh` starts this beside the agent (`python -m dflash_ds.distributed.agent_watch PID &`,
then `exec torchrun`), so it is signalled with the step. It does nothing until it gets SIGTERM or SIGINT; from
then on, once the agent has had no rank (no child process but this watcher) for `--grace` seconds, it SIGKILLs
the agent and says so. An agent that ends by itself ends the watcher. Without a signal it never acts: an agent
whose ranks are done waits at torchrun's exit barrier for the other nodes, as it should. A signal sent to the
agent alone (`kill PID` by hand) does not reach the watcher, and torchrun handles it as it always has.

A cut link strands the agent the same way with no signal at all: its ranks, cut off from global rank 0's host
(the job's store, and the rendezvous the agent then blocks on), end within 2 heartbeats, and the agent stayed
(seen still there 40 s after a cut, when the test ended it by removing the host). So a rank whose store guard
gives up (runtime/watchdog.py) tells the watcher first, by SIGUSR1 (`tell_cut_off`; the script exports the
watcher's pid as DFLASH_AGENT_WATCH_PID), and the watcher acts on it as on a stop signal.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

POLL_S = 0.25
WATCHER_ENV = "DFLASH_AGENT_WATCH_PID"
# Why the watcher acts, by the signal that armed it (SIGUSR1: a rank's `tell_cut_off`)
_REASONS = {signal.SIGTERM: "on SIGTERM", signal.SIGINT: "on SIGINT",
            signal.SIGUSR1: "cut off from the job store's host, which holds the rendezvous too"}


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), None once it is gone: a pid reused is not it."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]


def children(pid: int, exclude: int) -> list[int]:
    """Live child processes of `pid`, less `exclude` (this watcher) and zombies."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == exclude:
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


def _die_with_parent() -> None:
    """SIGKILL this watcher the moment its parent (the agent, which exec'd in the launch script's process) ends, so
    that nothing of the job outlives the agent even for a poll's interval (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def watch(agent: int, grace_s: float) -> int:
    """Until the agent ends: after a stop signal, SIGKILL it once it has been without ranks for `grace_s`."""
    if os.getppid() == agent:
        _die_with_parent()
    born = _start_time(agent)
    signalled: list[int] = []
    for sig in _REASONS:
        signal.signal(sig, lambda signum, _frame: signalled.append(signum))
    alone_since = None
    while born is not None and _start_time(agent) == born:
        if signalled:
            if children(agent, os.getpid()):
                alone_since = None
            elif alone_since is None:
                alone_since = time.monotonic()
            elif time.monotonic() - alone_since >= grace_s:
                print(f"[dflash-ds] torchrun agent {agent} still running {grace_s:g} s after its ranks ended "
                      f"{_REASONS[signalled[0]]} (its rendezvous store is likely gone with another node): killed",
                      file=sys.stderr, flush=True)
                os.kill(agent, signal.SIGKILL)
                return 0
        time.sleep(POLL_S)
    return 0


def tell_cut_off() -> None:
    """From a rank about to end cut off from the job store's host: arm its agent's watcher (SIGUSR1), if it has one.

    Only a sibling (a child of this rank's parent, the agent) is signalled: the variable may be stale or inherited
    by a process that another launcher started."""
    try:
        pid = int(os.environ.get(WATCHER_ENV, ""))
        with open(f"/proc/{pid}/stat") as f:
            if int(f.read().rsplit(")", 1)[1].split()[1]) != os.getppid():
                return
        os.kill(pid, signal.SIGUSR1)
    except (ValueError, OSError, IndexError):
        pass  # no watcher (another launcher), or it is gone with its agent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_ds.distributed.agent_watch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("agent", type=int, help="the torchrun agent's pid (the launch script's, before its exec)")
    parser.add_argument("--grace", type=float, default=float(os.environ.get("AGENT_GRACE_S", 5.0)),
                        help="seconds an agent may stay without ranks after a stop signal (default 5, or "
                             "$AGENT_GRACE_S)")
    args = parser.parse_args(argv)
    return watch(args.agent, args.grace)


if __name__ == "__main__":
    raise SystemExit(main())
