"""launch/train_slurm.sbatch on a real SLURM (Debian's slurm-wlm 22.05: munged and slurmctld on h0, a slurmd on h0
and h1; tests/slurm_cluster.py) over the hosts of tests/hosts.py, against the reference run of conftest.py.

The layout is the reference's and test_multihost_train's: NPROC=1,2 puts rank 0 (drafter 0) on h0, ranks 1
(drafter 1) and 2 (the target) on h1; the ZeRO all-reduce, the bridge and the job's store all cross the link.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import time
from pathlib import Path

import pytest

from conftest_runtime import COMMON, HEARTBEAT_S, STEPS, assert_reference_losses
from hosts import Hosts, hosts_or_skip, only_sshd_left
from runtime_utils import REPO, env_for_children, exit_statuses, per_batch, read_jsonl
from slurm_cluster import SlurmCluster, unavailable

pytestmark = pytest.mark.timeout(420)

SCRIPT = REPO / "launch/train_slurm.sbatch"
DAEMONS = ("munged", "slurmctld", "slurmd")


@pytest.fixture(name="slurm")
def slurm_on_two_hosts(tmp_path):
    """A controller on h0 and a slurmd on h0 and h1; every daemon, job and host is gone after the test."""
    why = unavailable()
    if why is not None:
        if os.environ.get("DFLASH_REQUIRE_HOSTS") == "1":
            pytest.fail(f"DFLASH_REQUIRE_HOSTS=1 but {why}")
        pytest.skip(f"SLURM: {why}")
    hosts = hosts_or_skip(2)
    try:
        yield SlurmCluster(hosts, tmp_path / "slurm", heartbeat_s=HEARTBEAT_S // 2).start()
    finally:
        hosts.close()
    assert hosts.leftovers() == []
    assert _slurm_processes() == [], "a SLURM daemon outlived its hosts"


def _slurm_processes() -> list[str]:
    """The command lines of every slurm or munge daemon on this machine (the hosts share one pid namespace)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0].decode()
        except (OSError, ValueError):
            continue
        if entry.isdigit() and _daemon(cmd) in (*DAEMONS, "slurmstepd"):
            found.append(cmd)
    return found


def _daemon(cmd: str) -> str:
    """The daemon a command line belongs to (slurmctld's helper calls itself `slurmctld: slurmscriptd`)."""
    return os.path.basename(cmd.split(" ")[0]).rstrip(":")


def _submit(slurm: SlurmCluster, tmp_path: Path, setup, extra_env: dict[str, str], *args: str) -> tuple[str, Path]:
    """sbatch --nodes 2 the script with the reference's arguments; the job id and its run folder."""
    target, data = setup
    out = tmp_path / "out"
    env = slurm.env({**env_for_children(), "NPROC": "1,2", "DFLASH_SLURM_DIR": str(tmp_path / "job"), **extra_env})
    env.pop("GLOO_SOCKET_IFNAME", None)
    job = slurm.sbatch(["--nodes", "2", "--output", str(tmp_path / "slurm-%j.out"), str(SCRIPT), *COMMON,
                        "--target", str(target), "--data", str(data), "--output-dir", str(out), "--zero-stage", "2",
                        *args], env=env, cwd=tmp_path)
    return job, out


def _wait_step(slurm: SlurmCluster, job: str, out: Path, step: int, timeout: float = 300) -> None:
    """Until a batch of `step` is recorded; fails with the job's output if the job ends first."""
    deadline = time.monotonic() + timeout
    while not any(r["step"] >= step for r in _records(out)):
        info = slurm.job(job)
        assert info.get("JobState") in ("PENDING", "CONFIGURING", "RUNNING") and time.monotonic() < deadline, \
            (info, _log(out.parent, job)[-4000:])
        time.sleep(0.2)


def _records(out: Path) -> list[dict]:
    return list(per_batch(out).values()) if (out / "records").is_dir() else []


def _log(tmp_path: Path, job: str) -> str:
    path = tmp_path / f"slurm-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def _job_processes(hosts: Hosts) -> dict[str, list[str]]:
    """Per host, what runs there but its sshd and the SLURM daemons: the job's steps and ranks."""
    return {h: [c for c in cmds if _daemon(c) not in DAEMONS]
            for h, cmds in only_sshd_left(hosts).items()}


def _rank_listeners(hosts: Hosts, h: str) -> list[str]:
    """ADDR:PORT of every listening TCP socket a rank on host `h` owns (not its torchrun agent's)."""
    found = []
    for line in hosts.run(h, ["ss", "-ltnpH"]).stdout.splitlines():
        cmds = [Path(f"/proc/{pid}/cmdline").read_bytes() if Path(f"/proc/{pid}").exists() else b""
                for pid in re.findall(r"pid=(\d+)", line)]
        if any(b"dflash_ds.train" in c and b"torchrun" not in c and b"torch.distributed.run" not in c for c in cmds):
            found.append(line.split()[3])
    return sorted(found)


def _ranks(hosts: Hosts, h: str) -> list[str]:
    """The torchrun agent and ranks on host `h`."""
    return [c for c in _job_processes(hosts)[h] if "dflash_ds" in c or "torch" in c]


def test_sbatch_signalled_before_its_time_limit_requeues_and_trains_the_reference(setup, reference, slurm,
                                                                                 tmp_path):
    """`sbatch --nodes 2`; at step 7 `scancel --signal=TERM` signals every process of the job's steps, as
    `#SBATCH --signal=TERM@300` does before the time limit (the same delivery: slurmstepd to each step's
    processes, the batch shell spared). Every rank on both hosts stops with the checkpoint of step 8 (status 75),
    the script requeues the job, which resumes from that checkpoint and completes: every batch of the reference
    recorded exactly once (none lost, none repeated) with its loss."""
    ref_out, _ = reference
    # The drafters wait at step 7 until the stop is visible: the signal sent once step 6 is recorded lands there.
    job, out = _submit(slurm, tmp_path, setup, {"DFLASH_FAULT_HOLD_UNTIL_STOP_AT": "7"})
    _wait_step(slurm, job, out, 6)
    # The ranks' listening sockets (the job's store on rank 0, gloo's pairs) on their node's own address only: the
    # script hands torchrun h0's NodeAddr, not its name (which would bind the store to every interface).
    listening = {h: _rank_listeners(slurm.hosts, h) for h in slurm.hosts.names}
    assert listening["h0"] and all(a.startswith(f"{slurm.hosts.addr[h]}:") for h in listening
                                   for a in listening[h]), listening
    r = slurm.client(["scancel", "--signal=TERM", job])
    assert r.returncode == 0, r.stderr
    first_exits = tmp_path / "job" / "attempt0" / "exits"
    deadline = time.monotonic() + 120
    while len(list(first_exits.glob("rank*.json"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    # Both drafters (h0's rank 0, h1's rank 1) wrote their ZeRO shards of step 8 (read before later saves prune it).
    shards = sorted(p.name for p in (out / "checkpoints" / "step_00000008").rglob("*optim_states.pt"))
    info = slurm.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), timeout=300)
    log = _log(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1" and info["ExitCode"] == "0:0", \
        (info, log[-5000:])
    first = exit_statuses(first_exits)
    assert {r: e["status"] for r, e in first.items()} == {0: 75, 1: 75, 2: 75}, first
    assert "[dflash-ds] slurm: every rank stopped with a checkpoint (status 75): requeueing job" in log
    assert re.search(r"\[dflash-ds\] stop requested \(SIGTERM on rank \d\): checkpoint at step 8 in \S+step_00000008",
                     log), log[-5000:]
    assert f"resuming from {out / 'checkpoints' / 'step_00000008'}" in log, log[-5000:]
    second = exit_statuses(tmp_path / "job" / "attempt1" / "exits")
    assert {r: e["status"] for r, e in second.items()} == {0: 0, 1: 0, 2: 0}, second
    assert len(shards) == 2, shards
    seen = collections.Counter(rec["batch_id"] for f in (out / "records").glob("drafter*.jsonl")
                               for rec in read_jsonl(f))
    assert sorted(seen) == list(range(2 * STEPS)) and set(seen.values()) == {1}, seen
    assert_reference_losses(out, ref_out)


def test_scancel_mid_run_leaves_no_rank_on_any_host(setup, slurm, tmp_path):
    """`scancel` after step 3: SLURM signals every step's processes and the batch shell, then kills what is left
    (KillWait): no torchrun and no rank on either host within 2 heartbeats, and the job is CANCELLED, not
    requeued."""
    job, out = _submit(slurm, tmp_path, setup, {}, "--train.heartbeat_timeout_s", str(HEARTBEAT_S))
    _wait_step(slurm, job, out, 3)
    r = slurm.client(["scancel", job])
    cancelled = time.monotonic()
    assert r.returncode == 0, r.stderr
    while any(_job_processes(slurm.hosts).values()) and time.monotonic() - cancelled < 4 * HEARTBEAT_S:
        time.sleep(0.2)
    took = time.monotonic() - cancelled
    print(f"scancel: every process of the job gone after {took:.1f}s (heartbeat {HEARTBEAT_S} s)")
    assert _job_processes(slurm.hosts) == {"h0": [], "h1": []} and took <= 2 * HEARTBEAT_S, took
    info = slurm.wait_state(job, ("CANCELLED",), timeout=30)
    assert info["Restarts"] == "0" and max(r["step"] for r in _records(out)) < STEPS - 1, info


def test_a_node_killed_mid_run_ends_the_job_naming_its_ranks(setup, slurm, tmp_path):
    """Every process of h1 (its slurmd, the step's slurmstepd, torchrun agent, drafter 1 and the target)
    SIGKILLed after step 3, as when a host crashes: h0's rank names both of h1's ranks and ends within 2
    heartbeats (HEARTBEAT_S) of the kill, and so does h0's torchrun agent."""
    job, out = _submit(slurm, tmp_path, setup, {}, "--train.heartbeat_timeout_s", str(HEARTBEAT_S))
    hosts = slurm.hosts
    hosts.shape("h1", "tbf", "rate", "200mbit", "burst", "256kb", "latency", "50ms")  # steps slow enough to kill
    _wait_step(slurm, job, out, 3)
    for pid in hosts.pids("h1"):
        if pid != hosts.sshd["h1"].pid:
            os.kill(pid, signal.SIGKILL)
    killed, t0 = time.time(), time.monotonic()
    exits_dir = tmp_path / "job" / "attempt0" / "exits"
    while not (exits_dir / "rank0.json").exists() and time.monotonic() - t0 < 4 * HEARTBEAT_S:
        time.sleep(0.2)
    while _ranks(hosts, "h0") and time.monotonic() - t0 < 4 * HEARTBEAT_S:
        time.sleep(0.2)
    gone = time.monotonic() - t0
    exits = exit_statuses(exits_dir)
    log = _log(tmp_path, job)
    ours = "\n".join(line for line in log.splitlines() if "[dflash-ds]" in line)
    took = round(exits[0]["time"] - killed, 1)
    print(f"h1 killed: h0's rank 0 ended {took} s later with status {exits[0]['status']}, the job's processes on h0 "
          f"after {gone:.1f} s (heartbeat {HEARTBEAT_S} s); job {slurm.job(job).get('JobState')}")
    assert max(r["step"] for r in _records(out)) < STEPS - 1, ours
    for lost in (r"rank 1 \(drafter 1\)", r"rank 2 \(target 0\)"):
        assert re.search(rf"rank 0 at step \d+: lost {lost}", ours), ours
    assert exits[0]["status"] not in (0, 75) and took <= 2 * HEARTBEAT_S, (exits, took)
    assert _ranks(hosts, "h0") == [] and gone <= 2 * HEARTBEAT_S, _job_processes(hosts)
    # h0's torchrun agent: srun prints its task's end a moment after the agent's own report (once seen missing
    # when read the instant h0's ranks were gone), so it is awaited within the same 2 heartbeats.
    agent_ended = r"srun: error: h0: task 0: Exited with exit code [1-9]"
    while not re.search(agent_ended, log) and time.monotonic() - t0 < 2 * HEARTBEAT_S:
        time.sleep(0.2)
        log = _log(tmp_path, job)
    assert re.search(agent_ended, log), log[-3000:]
    assert not (tmp_path / "job" / "attempt1").exists()  # not requeued by the script: no checkpointed stop
    # SLURM itself declares h1 down SlurmdTimeout later and requeues the job (node failure, --requeue) to wait for
    # it: the fixture's teardown ends the cluster and asserts that nothing is left.
