"""A chaos soak on the two test hosts (tests/hosts.py): a seeded sequence of faults over the three launchers, each
followed by `--resume auto`, and at the end the drafter of an uninterrupted run (issue #58 item 7).

Ranks as in test_multihost_train.py: h0 runs rank 0 (drafter 0), h1 ranks 1 (drafter 1) and 2 (the target). A
launch is `launch/train_deepspeed.sh` on h0 over pdsh, `launch/train_multinode.sh` on both hosts (torchrun, c10d
rendezvous on h0), or `sbatch --nodes 2 --no-requeue launch/train_slurm.sbatch` on a SLURM cluster of the two hosts
(tests/slurm_cluster.py, started at the first SLURM launch; --no-requeue: the soak resumes a job itself, as after
every other fault). The faults, drawn by `random.Random(SEED)` (every kind once before any twice):

- rank_kill: SIGKILL to one rank (any of the three) once a step past the resumed checkpoint is recorded;
- host_kill: SIGKILL to every process of one host (its launcher included, and its slurmd once the SLURM cluster
  runs: SLURM sees the node down and ends the job; the controller's daemons on h0 are spared, standing for a machine
  of their own; the slurmd is started again once the launch has ended), likewise;
- link_cut: h1's link cut for good (restored once the launch has ended);
- launcher_term: SIGTERM to the launch on h0 (the deepspeed script: a preemption, the stop checkpoint and 75; the
  torchrun agent: its ranks stop and checkpoint as on SIGTERM); under SLURM the job's steps get SLURM's own SIGTERM
  (`scancel --signal`, as a time limit sends it): the stop checkpoint, and the script ends 75;
- kill_in_save: SIGKILL to one drafter inside the checkpoint of a step (DFLASH_FAULT_KILL_IN_SAVE);
- disk_full: the run folder (a tmpfs of its own) filled while a checkpoint is being written (held open by
  DFLASH_FAULT_SLOW_SAVE_AT), freed once the launch has ended;
- corrupt_newest: once a launch has ended, the newest checkpoint's largest shard zeroed in its first 4 KiB (the
  resume must pass over it: runtime/checkpoint_manifest.py).

After the last fault a clean launch finishes the run. Then every batch of the uninterrupted run's (conftest.py's
`reference` for the suite's 3 faults; a reference of its own, 4 steps a fault, for DFLASH_SOAK_FAULTS more) was
trained once along the final lineage, at its step, with its loss (records/ cut back on each resume), and the final
export's weights equal the reference's. `make soak` runs 20 faults and prints the table docs/OPERATIONS.md keeps.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest_runtime import COMMON, HEARTBEAT_S, STEPS, assert_reference_losses
from dflash_ds.runtime.checkpoint import is_complete, newest_intact
from hosts import only_sshd_left, two_hosts
from proc_utils import dump_rank_stacks
from runtime_utils import REPO, env_for_children, per_batch, torchrun
from slurm_cluster import DAEMONS, SlurmCluster, SlurmJob, unavailable

FAULTS = int(os.environ.get("DFLASH_SOAK_FAULTS", "3"))
# Seed 14's first 3 faults (`make test`): rank_kill (torchrun), kill_in_save (slurm), disk_full (deepspeed): the
# three launchers and two saves cut short (a corrupt checkpoint passed over: tests/test_reliability/
# test_checkpoint_errors.py; a link cut: test_multihost_train.py). `make soak` draws 20 with seed 21.
SEED = int(os.environ.get("DFLASH_SOAK_SEED", "14"))
KINDS = ("rank_kill", "host_kill", "link_cut", "launcher_term", "kill_in_save", "disk_full", "corrupt_newest")
LAUNCHERS = ("deepspeed", "torchrun", "slurm")
SAVE_EVERY = 2
DISK_MB = 256  # the run folder's own filesystem (a tiny drafter's checkpoint is ~2 MB)

pytestmark = pytest.mark.timeout(600 + 120 * FAULTS)
hosts = pytest.fixture(two_hosts, name="hosts")


def draw(n: int, seed: int) -> list[tuple[str, str]]:
    """(fault kind, launcher) x n: every kind once before any twice, the launcher drawn at random; never
    corrupt_newest first or twice in a row (it damages the checkpoint the launches before it left)."""
    rng, kinds, out = random.Random(seed), [], []
    for _ in range(n):
        if not kinds:
            kinds = list(KINDS)
            rng.shuffle(kinds)
        kind = kinds.pop()
        if kind == "corrupt_newest" and (not out or out[-1][0] == kind) and kinds:
            kinds.insert(0, kind)
            kind = kinds.pop()
        out.append((kind, rng.choice(LAUNCHERS)))
    return out


def test_the_fault_sequence_covers_every_kind_and_every_launcher():
    seq = draw(20, SEED)
    assert sorted(k for k, _ in seq[:7]) == sorted(KINDS) and seq[0][0] != "corrupt_newest"
    assert {launcher for _, launcher in seq} == set(LAUNCHERS) and seq == draw(20, SEED)
    assert len({k for k, _ in draw(3, SEED)}) == 3


@pytest.fixture
def disk(tmp_path):
    """The run folder's own small filesystem (a tmpfs: a real ENOSPC from the kernel). Mounted before the hosts
    are made: their mount namespaces (private propagation) copy the mounts that exist when they start."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m,mode=0755", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


class Soak:
    """One run folder trained through launches that faults end; `table` holds a row a fault."""

    def __init__(self, hosts, setup, out: Path, steps: int, work: Path) -> None:
        target, data = setup
        self.hosts, self.out, self.steps, self.work = hosts, out, steps, work
        self.args = [*COMMON, "--target", str(target), "--data", str(data), "--output-dir", str(out),
                     "--zero-stage", "2", "--max-steps", str(steps), "--train.save_interval", str(SAVE_EVERY),
                     "--train.heartbeat_timeout_s", str(HEARTBEAT_S)]
        (work / "hostfile").write_text("h0 slots=1\nh1 slots=2\n")
        self.table: list[dict] = []
        self.saved: dict[str, list[int]] = {}  # checkpoint folder -> sizes of each save of it
        self.launches = 0
        self.slurm: SlurmCluster | None = None  # started at the first SLURM launch

    # -- launches ---------------------------------------------------------------------------------------------

    def start(self, launcher: str, env: dict[str, str] | None = None) -> dict[str, subprocess.Popen]:
        self.launches += 1
        base = self.hosts.env({**env_for_children(), **(env or {})})
        base.pop("GLOO_SOCKET_IFNAME", None)
        kw = dict(cwd=self.work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if launcher == "slurm":
            if self.slurm is None:
                self.slurm = SlurmCluster(self.hosts, self.work / "slurm", heartbeat_s=HEARTBEAT_S // 2).start()
            n, log = self.launches, self.work / f"slurm-{self.launches}.out"
            job = self.slurm.sbatch(["--nodes", "2", "--no-requeue", "--output", str(log),
                                     str(REPO / "launch/train_slurm.sbatch"), *self.args], cwd=self.work,
                                    env=self.slurm.env({**base, "NPROC": "1,2", "RDZV_PORT": str(29400 + n),
                                                        "DFLASH_SLURM_DIR": str(self.work / f"job{n}")}))
            procs = {"h0": SlurmJob(self.slurm, job, log)}
        elif launcher == "deepspeed":
            cmd = ["bash", str(REPO / "launch/train_deepspeed.sh"), *self.args]
            procs = {"h0": self.hosts.popen("h0", cmd, env={**base, "HOSTFILE": str(self.work / "hostfile"),
                                                              "MASTER_PORT": str(29500 + 2 * self.launches)}, **kw)}
        else:
            rdzv = {"NNODES": "2", "RDZV_HOST": "h0", "RDZV_PORT": str(29400 + self.launches),
                    "RDZV_ID": f"soak{self.launches}"}
            procs = {h: self.hosts.popen(h, ["bash", str(REPO / "launch/train_multinode.sh"), *self.args],
                                         env={**base, **rdzv, "NPROC": n}, **kw)
                     for h, n in (("h0", "1"), ("h1", "2"))}
        self.t_launch = time.time()
        self._pool = ThreadPoolExecutor(len(procs))  # read the outputs while the launch runs (a pipe must not fill)
        self._reading = {h: self._pool.submit(p.communicate) for h, p in procs.items()}
        return procs

    def last_step(self) -> int:
        return max((r["step"] for r in per_batch(self.out).values()), default=-1) \
            if (self.out / "records").is_dir() else -1

    def new_since_launch(self, path: Path) -> bool:
        """`path` was written by this launch (records and .partial folders of earlier ones are still there until
        the launch's resume cuts or removes them)."""
        try:
            return path.stat().st_mtime > self.t_launch
        except OSError:
            return False

    def reached_step(self, past: int) -> bool:
        return self.new_since_launch(self.out / "records" / "drafter0.jsonl") and self.last_step() >= past

    def resumes_from(self) -> int:
        latest = newest_intact(self.out)
        return -1 if latest is None else int(latest.name.removeprefix("step_"))

    def wait(self, until, timeout: float = 300) -> bool:
        """Poll until `until()` holds (True: the launch still runs, for the caller to fault) or the launch has
        ended by itself (False); a launch that does neither within `timeout` fails the soak."""
        deadline = time.monotonic() + timeout
        while not all(f.done() for f in self._reading.values()):
            if until is not None and until():
                return True
            assert time.monotonic() < deadline, f"launch {self.launches} neither reached its fault nor ended"
            time.sleep(0.05)
        return False

    def ends_within(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not all(f.done() for f in self._reading.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return all(f.done() for f in self._reading.values())

    def finish(self, timeout: float = 300, ended=None) -> dict[str, str]:
        """The launch's output once every process of it has ended (a hang fails), and nothing left on a host;
        `ended()` runs once the launch has returned, before the wait for what it left."""
        outs = {h: f.result(timeout=timeout)[0] for h, f in self._reading.items()}
        self._pool.shutdown()
        if ended is not None:
            ended()
        deadline = time.monotonic() + 60
        while self.left() != {"h0": [], "h1": []} and time.monotonic() < deadline:
            time.sleep(0.25)
        assert self.left() == {"h0": [], "h1": []}, (self.left(), outs)
        return outs

    def left(self) -> dict[str, list[str]]:
        """Per host, what runs there but its sshd and SLURM's daemons: a launch's processes."""
        return {h: [c for c in cmds if os.path.basename(c.split(" ")[0]).rstrip(":") not in DAEMONS]
                for h, cmds in only_sshd_left(self.hosts).items()}

    def spared(self, h: str) -> set[int]:
        """The pids on host `h` a host_kill leaves: its sshd and the SLURM controller's daemons."""
        keep = {self.hosts.sshd[h].pid}
        if self.slurm is not None:
            keep |= {p.pid for name, p in self.slurm.procs.items() if name in ("munged", "slurmctld")}
            keep |= {pid for pid in self.hosts.pids(h) if _is_scriptd(pid)}  # slurmctld's helper
        return keep

    def note_saves(self, since: float) -> None:
        root = self.out / "checkpoints"
        for p in sorted(root.glob("step_*")) if root.is_dir() else []:
            if is_complete(p) and (p / "COMPLETE").stat().st_mtime >= since:
                self.saved.setdefault(p.name, []).append(sum(f.stat().st_size for f in p.rglob("*") if f.is_file()))

    # -- faults -----------------------------------------------------------------------------------------------

    def rank_pids(self) -> dict[int, tuple[str, int]]:
        """Global rank -> (host, pid) of every training rank now running."""
        found = {}
        for h in self.hosts.names:
            for pid in self.hosts.pids(h):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                rank = [e[5:] for e in env if e.startswith(b"RANK=")]
                if b"dflash_ds.train" in cmd and rank and b"dflash_ds.distributed.torchrun" not in cmd \
                        and b"deepspeed.launcher" not in cmd:
                    found[int(rank[0])] = (h, pid)
        return found

    def fault(self, kind: str, launcher: str, rng: random.Random) -> None:
        start, t0 = self.resumes_from(), time.time()
        if kind == "corrupt_newest":  # between launches: the next one must pass over it
            newest = newest_intact(self.out)
            assert newest is not None, "corrupt_newest: no checkpoint yet (the fault before it made no progress)"
            shard = max((p for p in (newest / "ds").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
            with open(shard, "r+b") as fh:
                fh.write(bytes(4096))
            self.table.append({"fault": kind, "launcher": "-", "where": f"{shard.relative_to(self.out)}: 4 KiB zeroed",
                               "status": {}, "last_step": self.last_step(), "resumed_from": start, "t_fault": None,
                               "output": ""})
            return
        env, where, restart = {}, "", None
        # a fault in a save hits the second or third save of the launch (saves fall on multiples of SAVE_EVERY; a
        # stop checkpoint may not): the first completes, so every launch makes progress
        first = (max(start, 0) // SAVE_EVERY + 1) * SAVE_EVERY
        save_step = min(first + SAVE_EVERY * rng.randint(1, 2), self.steps - SAVE_EVERY)
        if kind == "kill_in_save":
            rank = rng.choice((0, 1))
            env = {"DFLASH_FAULT_RANK": str(rank), "DFLASH_FAULT_KILL_IN_SAVE": str(save_step)}
            where = f"drafter rank {rank} in the save of step {save_step}"
        if kind == "disk_full":
            env = {"DFLASH_FAULT_SLOW_SAVE_AT": str(save_step), "DFLASH_FAULT_SLOW_SAVE_S": "6"}
            where = f"the save of step {save_step}"
        procs = self.start(launcher, env)
        partial = self.out / "checkpoints" / f"step_{save_step:08d}.partial"
        past = min(max(start, 0) + rng.randint(2, 4), self.steps - 2)  # past a new checkpoint: progress
        until = {"disk_full": lambda: self.new_since_launch(partial), "kill_in_save": None}.get(
            kind, lambda: self.reached_step(past))
        reached = self.wait(until)
        at_step, when = self.last_step(), time.monotonic()
        if reached and kind == "rank_kill":
            pids = self.rank_pids()
            rank = rng.choice(sorted(pids))
            os.kill(pids[rank][1], signal.SIGKILL)
            where = f"rank {rank} on {pids[rank][0]}"
        elif reached and kind == "host_kill":
            h = rng.choice(self.hosts.names)
            restart, keep = h, self.spared(h)
            for pid in self.hosts.pids(h):
                if pid not in keep:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            where = f"every process on {h}"
        elif reached and kind == "link_cut":
            self.hosts.link("h1", up=False)
            where = "h1's link"
        elif reached and kind == "launcher_term":
            procs["h0"].send_signal(signal.SIGTERM)
            where = "the job's steps (scancel --signal)" if launcher == "slurm" else f"the {launcher} launch on h0"
        elif reached and kind == "disk_full":
            fill(self.out)
        if reached and kind == "launcher_term" and not self.ends_within(45):  # measured 1-5 s: stuck
            print(f"launch {self.launches}: still running 45 s after its stop; stacks of the ranks "
                  f"{dump_rank_stacks(2.0)} in its output")
        ended = []
        # the link back once the launch has returned: SLURM's step daemon on h1 reports its end to the controller
        outs = self.finish(ended=lambda: ended.append(time.monotonic()) or (
            kind == "link_cut" and self.hosts.link("h1", up=True)))
        ended = ended[0]
        if restart is not None and self.slurm is not None:
            self.slurm.restart_slurmd(restart)
        if kind == "disk_full":
            (self.out / "filler").unlink(missing_ok=True)
        self.note_saves(t0)
        text = "\n".join(outs.values())
        self.table.append({"fault": kind, "launcher": launcher, "where": where, "reached": reached or kind ==
                           "kill_in_save", "status": {h: p.returncode for h, p in procs.items()},
                           "last_step": at_step, "resumed_from": start, "ended_s": round(ended - when, 1),
                           "passed_over": "fails its manifest" in text, "output": text})

    def complete(self, launcher: str) -> str:
        t0 = time.time()
        procs = self.start(launcher)
        self.wait(None, timeout=420)
        outs = self.finish()
        self.note_saves(t0)
        assert all(p.returncode == 0 for p in procs.values()), {h: o[-3000:] for h, o in outs.items()}
        return "\n".join(outs.values())


def _is_scriptd(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"slurmctld: slurmscriptd")
    except OSError:
        return False


def fill(folder: Path) -> None:
    """Fill the filesystem of `folder` to the last block (a file `filler` there; unbuffered writes)."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            try:
                while os.write(fd, b"\0" * size):
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)


def test_chaos_soak_ends_with_the_uninterrupted_drafter(setup, reference, disk, hosts, tmp_path):
    """FAULTS faults (3 under `make test`, 20 under `make soak`), each then `--resume auto`, on the run folder's own
    small filesystem: the final records hold every batch of the uninterrupted run once, at its step and loss, the
    final export's weights equal the uninterrupted run's, no process is left on either host, and each fault's
    launch ended by itself (none hung)."""
    # DFLASH_SOAK_PLAN=kind:launcher,...: that sequence instead of the draw (to replay one fault or a failing run)
    plan = [tuple(f.split(":")) for f in os.environ.get("DFLASH_SOAK_PLAN", "").split(",") if f]
    faults = len(plan) or FAULTS
    if faults <= 3:
        steps, ref_out = STEPS, reference[0]
    else:
        steps = max(STEPS, 4 * faults)
        ref_out = tmp_path / "ref"
        target, data = setup
        r = torchrun(3, [*COMMON, "--target", str(target), "--data", str(data), "--output-dir", str(ref_out),
                         "--zero-stage", "2", "--max-steps", str(steps)], cwd=tmp_path)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    why = unavailable()
    if why is not None:
        (pytest.fail if os.environ.get("DFLASH_REQUIRE_HOSTS") == "1" else pytest.skip)(f"SLURM: {why}")
    soak = Soak(hosts, setup, disk / "run", steps, tmp_path)
    rng, t0 = random.Random(SEED), time.monotonic()
    for kind, launcher in plan or draw(FAULTS, SEED):
        if soak.resumes_from() >= steps - SAVE_EVERY:
            break  # too close to the end for another fault to land before the run finishes
        soak.fault(kind, launcher, rng)
    last = soak.complete(rng.choice(LAUNCHERS))
    wall = time.monotonic() - t0
    rows = [{k: v for k, v in row.items() if k != "output"} for row in soak.table]
    rewritten = sum(sum(sizes[:-1]) for sizes in soak.saved.values())
    print(json.dumps({"faults": rows, "wall_s": round(wall, 1), "launches": soak.launches,
                      "checkpoint_bytes_rewritten": rewritten,
                      "saves": {k: len(v) for k, v in soak.saved.items()}}, indent=1))
    print(markdown(rows))
    assert len(soak.table) == faults, rows
    assert all(row["reached"] for row in rows if row["fault"] != "corrupt_newest"), rows  # each fault landed
    assert all(row["status"] and all(s != 0 for s in row["status"].values())
               for row in rows if row["fault"] != "corrupt_newest"), rows  # and ended its launch
    for row in soak.table:  # a preemption: the stop checkpoint and 75 (a job that may not requeue says so)
        if row["fault"] == "launcher_term" and row["launcher"] != "torchrun":
            assert row["status"] == {"h0": 75}, row["output"][-3000:]
        if row["fault"] == "launcher_term" and row["launcher"] == "slurm":
            assert "was not requeued (submitted with --no-requeue?): the checkpoint is complete" in row["output"]
    outputs = [row["output"] for row in soak.table[1:]] + [last]
    for i, row in enumerate(soak.table):  # the launch after a damaged checkpoint passed over it, naming the file
        if row["fault"] == "corrupt_newest":
            assert "fails its manifest" in outputs[i] and row["where"].split(":")[0] in outputs[i], outputs[i][-3000:]
    if steps == STEPS:
        assert_reference_losses(soak.out, ref_out)
    else:
        _same_losses(soak.out, ref_out, steps)
    _same_weights(soak.out / f"checkpoints/step_{steps:08d}/export", ref_out / f"checkpoints/step_{steps:08d}/export")


def markdown(rows: list[dict]) -> str:
    """The table docs/OPERATIONS.md keeps, one row a fault."""
    lines = ["| # | fault | launcher | where | launch status | last step recorded | resumed from | launch ended (s "
             "after the fault) |", "|---:|---|---|---|---|---:|---:|---:|"]
    for i, r in enumerate(rows, 1):
        status = ", ".join(f"{h} {s}" for h, s in r["status"].items()) or "-"
        lines.append(f"| {i} | {r['fault']} | {r['launcher']} | {r['where']} | {status} | {r['last_step']} | "
                     f"{r['resumed_from']} | {r.get('ended_s', '-')} |")
    return "\n".join(lines)


def _same_losses(out: Path, ref_out: Path, steps: int) -> None:
    got, want = per_batch(out), per_batch(ref_out)
    assert sorted(got) == sorted(want) == list(range(2 * steps))
    for b, rec in want.items():
        assert got[b]["step"] == rec["step"] and abs(got[b]["loss"] - rec["loss"]) < 1e-4, (b, got[b], rec)


def _same_weights(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(wa) == sorted(wb)
    worst = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
    print(f"final export against the uninterrupted run's: max |difference| {worst:.3g}")
    assert worst <= 1e-5, worst
