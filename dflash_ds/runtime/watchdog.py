"""Heartbeats, lost-rank detection and coordinated stop (preemption), over the shared TCPStore.

Every rank runs one daemon thread that, once a second:
- bumps its own heartbeat counter and publishes its current step;
- turns a local SIGTERM/SIGINT into the job-wide stop request `dflash/stop`, and so does (on global rank 0)
  the appearance of the file `DFLASH_STOP_FILE` names: a launcher whose own signal handling would kill the
  ranks (the deepspeed runner over pdsh: SIGINT to pdsh, `pkill -f` on every host, exit 1, no checkpoint)
  asks for the stop through the shared filesystem instead (launch/train_deepspeed.sh);
- sees a stop request from any other rank and sets this rank's stop event;
- notices a peer whose counter has not moved for `heartbeat_timeout_s` and ends this
  rank (non-zero) after printing which ranks were lost (every peer silent by then: a lost
  host's ranks together) and at which step;
- notices that its launcher is gone (a torchrun agent or deepspeed launcher killed with
  SIGKILL cannot stop its ranks) and turns that into a job-wide stop like a SIGTERM: the
  drafters checkpoint at an agreed step if they still can, and after `launcher_grace_s` the
  rank exits regardless, so no rank outlives its launcher.

A second thread, the store guard, ends the rank when the heartbeat thread has not finished a round
with the store for `heartbeat_timeout_s`: across a cut link a store call does not fail, it blocks
(TCPStore's timeout does not bound `check`; measured: a client of a stopped server waited 60+ s with
a 3 s timeout), so the ranks cut off from global rank 0 would otherwise wait out gloo's timeouts.

Counters, not wall-clock times, so clocks of different nodes never need to agree.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from dflash_ds.distributed.agent_watch import tell_cut_off
from dflash_ds.process_exit import say
from dflash_ds.runtime import faults

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request with a checkpoint; `--resume auto` continues
EXIT_LOST_RANK = 3
EXIT_LOST_LAUNCHER = 4
# Rank 0, its work done, does not wait at shutdown for a peer this long without a beat (or
# heartbeat_timeout_s if shorter): a live peer beats every second from a thread of its own, and torchrun,
# which starts tearing the job down when the first rank exits, SIGKILLs what still runs 30 s later.
CHECKOUT_STALL_S = 10.0
STOP_KEY = "dflash/stop"
STOP_STEP_KEY = "dflash/stop_step"
# The leader's word that the stop checkpoint is committed: every drafter's shards written, `latest` names it.
STOP_SAVED_KEY = "dflash/stop_saved"


def _parent_of(pid: int) -> int | None:
    """The parent pid of a live process (None once it is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces and parentheses
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[1])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


_decided: list[int] = []  # the exit status this process decided first (decide_exit)


def decide_exit(status: int) -> int:
    """Make `status` this process's exit status and record it, unless one was decided already; the one decided.

    A thread that decided 75 (its drafters have checkpointed) and is then held on its way out (a blocked write)
    is not turned into a 3 by the store guard: the status in the exit record (SLURM's requeue reads it) and the
    one the process ends with are the first decided."""
    if not _decided:
        _decided.append(status)
        faults.record_exit(status, teardown=False)  # every rank's status and exit time (tests, train_slurm.sbatch)
    return _decided[0]


def hard_exit(status: int) -> None:
    """End this process now with `status` (or the one decided before), from any thread (the main one may be
    blocked in a collective)."""
    os._exit(decide_exit(status))


class ExitOnSignal:
    """After the role has ended with `status`: SIGTERM/SIGINT end this rank at once with that status.

    torchrun SIGTERMs every rank still running once one exits non-zero (75 included). Ignoring the signal kept
    a rank blocked in its teardown (a group's shutdown, rank 0's wait for check-outs) until torchrun's SIGKILL
    30 s later: status -9, not 75. A Python handler cannot run while the main thread is blocked in C, so the
    C-level handler's wakeup byte (signal.set_wakeup_fd) is read by a thread of its own, which exits.
    `close()` before the interpreter's teardown (which resets Python handlers to the default: -15) ignores the
    signals at the C level and ends the thread.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, status: int, rank: int) -> None:
        self.status, self.rank = status, rank
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._old_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        for sig in self.SIGNALS:
            signal.signal(sig, lambda *_: None)  # a Python handler, so that the C handler writes the wakeup byte
        self._thread = threading.Thread(target=self._run, daemon=True, name="exit-on-signal")
        self._thread.start()

    def _run(self) -> None:
        got = os.read(self._r, 1)
        if got and got[0] in [int(s) for s in self.SIGNALS]:
            say(f"[dflash-ds] rank {self.rank}: {signal.Signals(got[0]).name} after its role ended: exiting with "
                f"status {self.status}", sys.stderr)
            hard_exit(self.status)

    def close(self) -> None:
        """Ignore the signals from here on (the rank is leaving with its status) and end the thread."""
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        signal.set_wakeup_fd(self._old_fd)
        os.write(self._w, b"\0")  # not a signal number: the thread returns
        self._thread.join()
        os.close(self._r), os.close(self._w)


class LauncherWatch:
    """Whether this rank's launcher still runs: (process, its expected parent) links that must hold.

    Under torchrun the rank's parent is the agent. Under the deepspeed launcher the parent is the
    per-node `deepspeed.launcher.launch`, which outlives its own parent (the `deepspeed` runner,
    or the remote shell pdsh started) when that is killed, so its parent is watched too. A link
    breaks when the process is gone or was re-parented (its parent died).
    """

    def __init__(self, pid: int | None = None) -> None:
        me = os.getpid() if pid is None else pid
        self.links: list[tuple[int, int]] = []
        parent = _parent_of(me)
        if parent is None or parent <= 1:
            return  # started by init (a container entry point): there is no launcher to lose
        self.links.append((me, parent))
        if "deepspeed.launcher.launch" in _cmdline(parent) or "deepspeed/launcher/launch.py" in _cmdline(parent):
            grand = _parent_of(parent)
            if grand is not None and grand > 1:
                self.links.append((parent, grand))

    def gone(self) -> str | None:
        """A description of the broken link, or None while the launcher runs."""
        for pid, parent in self.links:
            now = _parent_of(pid)
            if now != parent:
                who = "this rank's launcher" if pid == self.links[0][0] else "the deepspeed launcher's parent"
                return f"{who} (pid {parent}) is gone"
        return None


def own_client(store):
    """A connection of its own to the job's TCPStore (other stores are returned as they are).

    A store client serialises its calls: a `set` from this thread waited 4.5-5.5 s behind another
    thread's 5-6 s `wait` on the same client (measured). The main thread blocks on the shared
    client for minutes at a time (non-leader drafters wait there through the leader's resharding;
    on GPU every lazily created NCCL communicator fetches its id through it), so heartbeats on that
    client would stall and the peers would call this rank lost.
    """
    import torch.distributed as dist

    if isinstance(store, dist.TCPStore):
        return dist.TCPStore(store.host, store.port, is_master=False, timeout=store.timeout,
                             wait_for_workers=False)
    return store


class Watchdog:
    """The per-rank heartbeat/stop thread (see module docstring), on a store client of its own."""

    def __init__(self, store, rank: int, world: int, describe_rank, heartbeat_timeout_s: float,
                 interval_s: float = 1.0, launcher_grace_s: float = 60.0) -> None:
        self.store, self.rank, self.world = own_client(store), rank, world
        self.describe_rank = describe_rank
        self.timeout_s, self.interval_s = heartbeat_timeout_s, interval_s
        self.stop_event = threading.Event()  # a job-wide stop was requested (any rank)
        self.local_signal: str | None = None  # the signal this rank received, if any
        self.step = 0
        self._beats = 0
        self._seen: dict[int, tuple[int, float]] = {}
        self.tick_hooks: list = []  # called from the thread every interval (role-specific checks)
        self._closed = threading.Event()
        self._wake = threading.Event()  # a signal came: publish it now, not at the next beat
        self._thread = threading.Thread(target=self._run, name="dflash-watchdog", daemon=True)
        self._round_done = time.monotonic()  # when the thread last finished a round with the store
        self._guard = threading.Thread(target=self._guard_store, name="dflash-store-guard", daemon=True)
        self.launcher = LauncherWatch()
        self.launcher_grace_s = launcher_grace_s
        self._orphan_deadline: float | None = None
        self._done = False  # this rank finished its work: a lost peer is named, no longer fatal
        self.lost: set[int] = set()  # peers found lost after this rank finished (they never check out)
        self.stop_file = os.environ.get("DFLASH_STOP_FILE", "") if rank == 0 else ""

    def start(self) -> "Watchdog":
        """Install the signal handlers (main thread) and start the thread."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
        self._beat()
        self._round_done = time.monotonic()
        self._thread.start()
        self._guard.start()
        return self

    def _on_signal(self, signum, _frame) -> None:
        # Only set flags (and wake the thread) here: the thread talks to the store, the training loop decides when.
        self.local_signal = signal.Signals(signum).name
        self.stop_event.set()
        self._wake.set()

    def stop_requested(self) -> bool:
        """Whether a job-wide stop was requested: this rank's event, or the key another rank published since the
        thread's last beat (one store check, a loopback round trip: the drafters ask once a micro-batch, so a
        target's SIGTERM reaches their agreement within a micro-batch, not a beat interval later; seen on a slow
        machine: a short run's drafters finished every step inside the second the key waited for a beat)."""
        if not self.stop_event.is_set() and self._safe_check(STOP_KEY):
            self.stop_event.set()
        return self.stop_event.is_set()

    def stop_reason(self) -> str:
        """Why the run stops, without blocking: the job-wide reason once published, else this rank's signal.

        Never `store.get` a key that may not exist yet: a blocked get holds the store client that
        this thread needs to publish the key (seen: a SIGTERM'd leader hung until torchrun killed it).
        """
        if self.store.check([STOP_KEY]):
            return self.store.get(STOP_KEY).decode()
        return f"{self.local_signal} on rank {self.rank}" if self.local_signal else "stop requested"

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"dflash/hb/{self.rank}", f"{self._beats}:{self.step}")

    def _run(self) -> None:
        try:
            while True:
                self._wake.wait(self.interval_s)
                self._wake.clear()
                if self._closed.is_set():
                    return
                self._check_launcher()
                self._check_stop_file()
                self._beat()
                self._publish_stop()
                if not self.stop_event.is_set() and self.store.check([STOP_KEY]):
                    self.stop_event.set()
                self._check_peers()
                for hook in self.tick_hooks:
                    hook()
                self._round_done = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - the store is gone: its host (global rank 0) died
            if self._closed.is_set():
                return
            if self._orphan_deadline is not None:  # rank 0 left at its own grace deadline: this rank's is as near
                say(f"[dflash-ds] rank {self.rank} at step {self.step}: the job store is gone after the launcher; "
                    f"exiting", sys.stderr)
                hard_exit(EXIT_LOST_LAUNCHER)
            self._die(0, f"lost contact with the job store on {self.describe_rank(0)} ({type(exc).__name__}); "
                         f"rank 0 is probably lost")

    def _guard_store(self) -> None:
        """End this rank when a round with the store has not finished for heartbeat_timeout_s (see module doc)."""
        while not self._closed.wait(self.interval_s):
            silent = time.monotonic() - self._round_done
            if silent > self.timeout_s and not self._closed.is_set():
                tell_cut_off()  # under train_multinode.sh: its agent, blocked on that host too, is ended after us
                self._die(0, f"lost contact with the job store on {self.describe_rank(0)}: no answer for "
                             f"{silent:.0f}s; rank 0 is probably lost")

    def _check_stop_file(self) -> None:
        """Rank 0: DFLASH_STOP_FILE exists -> a stop like a SIGTERM (one stat a second, on one rank only)."""
        path = self.stop_file
        if path and self.local_signal is None and os.path.exists(path):
            self.local_signal = f"stop file {path}"
            self.stop_event.set()

    def _publish_stop(self) -> None:
        """This rank's signal becomes the job-wide stop (the targets stop only on it; drafters may agree sooner)."""
        if self.local_signal and not self.store.check([STOP_KEY]):
            self.store.set(STOP_KEY, f"{self.local_signal} on rank {self.rank}")

    def _check_launcher(self) -> None:
        """Stop like on SIGTERM once the launcher is gone; exit at the grace deadline whatever happens."""
        if self._orphan_deadline is None:
            reason = self.launcher.gone()
            if reason is None:
                return
            say(f"[dflash-ds] rank {self.rank} at step {self.step}: {reason}: stopping (checkpoint if the "
                f"drafters can agree), exiting within {self.launcher_grace_s:.0f}s", sys.stderr)
            self._orphan_deadline = time.monotonic() + self.launcher_grace_s
            self.local_signal = "launcher gone"
            self.stop_event.set()
        elif time.monotonic() > self._orphan_deadline:
            say(f"[dflash-ds] rank {self.rank} at step {self.step}: launcher gone {self.launcher_grace_s:.0f}s "
                f"ago; exiting", sys.stderr)
            hard_exit(EXIT_LOST_LAUNCHER)

    def _check_peers(self) -> None:
        now = time.monotonic()
        limit = min(self.timeout_s, CHECKOUT_STALL_S) if self._done else self.timeout_s
        silent: dict[int, tuple[float, str]] = {}  # peer -> (seconds without a beat, its last step)
        for peer in range(self.world):
            if peer == self.rank:
                continue
            key = f"dflash/hb/{peer}"
            if not self.store.check([key]):
                continue
            beats, step = self.store.get(key).decode().split(":")
            last = self._seen.get(peer)
            if last is None or last[0] != int(beats):
                self._seen[peer] = (int(beats), now)
            elif not self.store.check([f"dflash/done/{peer}"]):  # a peer that finished normally is not lost
                silent[peer] = (now - last[1], step)
        lost = [p for p, (age, _) in silent.items() if age > limit]
        if not lost:
            return
        if not self._done:
            # A lost host's ranks went silent together, their last beats up to an interval apart: name every
            # peer silent for a few beats, not only the first past the limit.
            named = sorted(p for p, (age, _) in silent.items() if age > limit or age > 2.5 * self.interval_s)
            for peer in named:
                age, step = silent[peer]
                say(f"[dflash-ds] rank {self.rank} at step {self.step}: lost {self.describe_rank(peer)}: "
                    f"no heartbeat for {age:.0f}s (its last step was {step})", sys.stderr)
            self._die(lost[0], f"{len(named)} rank(s) lost")
        for peer in lost:
            if peer not in self.lost:  # rank 0, past its work, waiting for the others to check out
                age, step = silent[peer]
                say(f"[dflash-ds] rank {self.rank} at step {self.step}: lost {self.describe_rank(peer)}: no "
                    f"heartbeat for {age:.0f}s (its last step was {step}); not waiting for it",
                    sys.stderr)
                self.lost.add(peer)

    def stalled_peers(self, min_age_s: float = 3.0) -> list[int]:
        """Peers whose heartbeat has not moved for `min_age_s` (for naming the culprit after a failure)."""
        now = time.monotonic()
        return [p for p, (_, t) in self._seen.items() if now - t > min_age_s
                and not self._safe_check(f"dflash/done/{p}")]

    def peer_step(self, peer: int) -> str:
        """The last step a peer published ('?' if unknown)."""
        try:
            return self.store.get(f"dflash/hb/{peer}").decode().split(":")[1]
        except Exception:  # noqa: BLE001
            return "?"

    def _safe_check(self, key: str) -> bool:
        try:
            return self.store.check([key])
        except Exception:  # noqa: BLE001
            return False

    def _die(self, peer: int, message: str) -> None:
        say(f"[dflash-ds] rank {self.rank} at step {self.step}: {message}; exiting", sys.stderr)
        hard_exit(EXIT_LOST_RANK)

    def mark_done(self) -> None:
        """This rank finished its work normally: peers must not call it lost, and a lost peer no longer ends it."""
        self._done = True
        try:
            self.store.set(f"dflash/done/{self.rank}", "1")
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        """Stop the thread (before the store goes away); publish this rank's signal if the thread has not.

        A drafter signalled as a step starts stops with its peers through that step's all-reduce and can finish
        before the thread publishes; the targets, in no all-reduce, stop only on the key (seen, when the thread
        published once a second: a target blocked sending past the stop step until torchrun killed it)."""
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=5)
        if self._guard.is_alive():
            self._guard.join(timeout=5)
        try:
            self._publish_stop()
        except Exception:  # noqa: BLE001 - the store is gone: its host has left, there is nobody to tell
            pass
