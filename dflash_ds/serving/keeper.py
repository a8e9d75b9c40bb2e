"""Run a server only as long as the process that started it: `python keeper.py PARENT_PID GRACE_S -- CMD...`.

A `vllm serve` started in a session of its own (so that its engine's workers can be ended as one group)
outlives its starter when that is SIGKILLed (a test run killed at its time limit, a job killed by a
scheduler): nothing tells it. The keeper leads the group: it starts CMD in it, looks every POLL_S whether its
parent is still PARENT_PID (a dead parent's children are re-parented) and, once it is not, ends the whole
group: SIGTERM, then SIGKILL after GRACE_S. It also ends what is left of the group when CMD exits, and
exits with CMD's status (by the same signal if CMD died of one), so its starter sees CMD's.

Run by path with the starter's Python (`-I -S`: the standard library only), not as `-m dflash_ds...`: it
must start in milliseconds and import nothing of the package.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.2


def group_members(pgid: int) -> list[int]:
    """The live pids of process group `pgid`, this process excluded."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
                out.append(int(entry))
    return out


def end_group(grace_s: float) -> None:
    """SIGTERM every other member of this process's group, SIGKILL those left after `grace_s`."""
    pgid = os.getpgrp()
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        members = group_members(pgid)
        for pid in members:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while members and time.monotonic() < deadline:
            time.sleep(0.05)
            members = group_members(pgid)
        if not members:
            return


def main(argv: list[str]) -> int:
    """Start CMD, end the group when the parent goes or CMD exits; CMD's status."""
    parent, grace_s, sep, cmd = int(argv[0]), float(argv[1]), argv[2], argv[3:]
    assert sep == "--" and cmd, "usage: keeper.py PARENT_PID GRACE_S -- CMD..."
    stopping = []
    # A SIGTERM to the group (the starter's stop()) reaches CMD too: the keeper waits for it, then cleans up.
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getppid() != parent:
        return 1  # the starter died before the keeper ran: start nothing
    child = subprocess.Popen(cmd)
    while child.poll() is None:
        if os.getppid() != parent and not stopping:
            print(f"keeper: the process that started this server (pid {parent}) is gone: ending the server",
                  file=sys.stderr, flush=True)
            end_group(grace_s)
            break
        time.sleep(POLL_S)
    status = child.wait()
    end_group(grace_s)  # the engine's workers, whatever CMD left
    if status < 0:  # die of CMD's signal, so that the starter sees the same status
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
