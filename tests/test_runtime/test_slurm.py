"""launch/train_slurm.sbatch on a real SLURM (Debian's slurm-wlm 22.05: munged and slurmctld on h0, a slurmd on h0
and h1; tests/slurm_cluster.py) over the hosts of tests/hosts.py, against the reference run of conftest.py.

The layout is the reference's and test_multihost_train's: NPROC=1,2 puts rank 0 (drafter 0) on h0, ranks 1
(drafter 1) and 2 (the target) on h1; the ZeRO all-reduce, the bridge and the job's store all cross the link.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import os
import re
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest

from conftest_runtime import COMMON, HEARTBEAT_S, STEPS, assert_reference_losses
from hosts import Hosts, hosts_or_skip, only_sshd_left
from proc_utils import dump_rank_stacks
from runtime_utils import (REPO, command_lines, env_for_children, exit_statuses, files_changed_since, per_batch,
                           read_jsonl)
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


def _submit(slurm: SlurmCluster, tmp_path: Path, setup, extra_env: dict[str, str], *args: str,
            sbatch_args: tuple[str, ...] = ()) -> tuple[str, Path]:
    """sbatch --nodes 2 the script with the reference's arguments; the job id and its run folder."""
    target, data = setup
    out = tmp_path / "out"
    env = slurm.env({**env_for_children(), "NPROC": "1,2", "DFLASH_SLURM_DIR": str(tmp_path / "job"), **extra_env})
    env.pop("GLOO_SOCKET_IFNAME", None)
    job = slurm.sbatch(["--nodes", "2", *sbatch_args, "--output", str(tmp_path / "slurm-%j.out"), str(SCRIPT), *COMMON,
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


def _job_listeners(hosts: Hosts, h: str) -> list[str]:
    """ADDR:PORT of every listening TCP socket the job's processes on host `h` own: its torchrun agent (the
    rendezvous store, the agents' store) and its ranks (the job's store, gloo's pairs); not SLURM's."""
    found = []
    for line in hosts.run(h, ["ss", "-ltnpH"]).stdout.splitlines():
        cmds = []
        for pid in re.findall(r"pid=(\d+)", line):
            try:
                cmds.append(Path(f"/proc/{pid}/cmdline").read_bytes())
            except OSError:
                pass  # exited meanwhile
        if any(b"-m\0dflash_ds." in c for c in cmds):  # python -m dflash_ds.distributed.torchrun, -m dflash_ds.train
            found.append(line.split()[3])
    return sorted(found)


def _ranks(hosts: Hosts, h: str) -> list[str]:
    """The torchrun agent and ranks on host `h`."""
    return [c for c in _job_processes(hosts)[h] if "dflash_ds" in c or "torch" in c]


def test_a_time_limit_signal_checkpoints_requeues_and_trains_the_reference(setup, reference, slurm, tmp_path):
    """`sbatch --nodes 2 --time 10`; once step 6 is recorded the job's time limit is brought to 5 minutes
    (`scontrol update`, as a job whose --time runs out), so the script's own `#SBATCH --signal=TERM@300` is due at
    once: slurmctld sends it at its next time-limit check (up to 30 s later) to every process of the job's steps.
    Every rank on both hosts stops with the checkpoint of step 8 (status 75), the script requeues the job, which
    resumes from that checkpoint and completes: every batch of the reference recorded exactly once (none lost,
    none repeated) with its loss. The time limit goes back to 30 minutes once the stop is seen, before the requeue,
    or the next attempt would be signalled at its start.

    Submitted as docs/TRAINING.md says (credentials by path: HF_TOKEN_PATH, DFLASH_SECRETS_FILE with WANDB_API_KEY,
    MLFLOW_TRACKING_TOKEN, HF_HUB_TOKEN_X, WANDB_KEY, a URL carrying its password and a JSON key): the ranks on
    both hosts read them (an HMAC under the test's salt in their exit records), while no command line on any host
    (sampled all along), the job's log, its records, checkpoints and exit records, or any file written under /tmp
    but the user's own two holds one or its sha256; nothing of the run is readable by others."""
    ref_out, _ = reference
    secrets = {k: f"{k.lower()}-sentinel-{uuid.uuid4().hex}" for k in (
        "HF_TOKEN", "WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN", "HF_HUB_TOKEN_X", "WANDB_KEY", "MLFLOW_TRACKING_URI",
        "GCP_CREDENTIALS_JSON")}
    lines = {**secrets, "MLFLOW_TRACKING_URI": f"https://dflash:{secrets['MLFLOW_TRACKING_URI']}@mlflow.invalid/",
             "GCP_CREDENTIALS_JSON": json.dumps({"private_key": secrets["GCP_CREDENTIALS_JSON"]})}
    mine = tmp_path / "user-secrets"
    mine.mkdir(mode=0o700)
    (mine / "hf_token").write_text(lines.pop("HF_TOKEN"))
    (mine / "secrets.env").write_text("".join(f"{k}={v}\n" for k, v in lines.items()))
    salt, started = uuid.uuid4().hex, time.time()
    # The drafters wait at step 7 until the stop is visible: the signal sent once step 6 is recorded lands there.
    job, out = _submit(slurm, tmp_path, setup, {"DFLASH_FAULT_HOLD_UNTIL_STOP_AT": "7", "DFLASH_TEST_EXIT_SALT": salt,
                                                "HF_TOKEN_PATH": str(mine / "hf_token"),
                                                "DFLASH_SECRETS_FILE": str(mine / "secrets.env")},
                       sbatch_args=("--time", "10"))
    sampler = ArgvSampler(secrets.values())
    _wait_step(slurm, job, out, 6)
    # Every listening socket of the job (the rendezvous store on RDZV_PORT and the agents' store on h0's agent, the
    # job's store on rank 0, gloo's pairs) on its node's own address, none on all of them (`*`, 0.0.0.0): the
    # cluster's NodeAddrs are the nodes' names, which h0 resolves to 127.0.1.1 for itself (tests/slurm_cluster.py).
    listening = {h: _job_listeners(slurm.hosts, h) for h in slurm.hosts.names}
    print(f"the job's listening sockets: {listening}")
    assert f"{slurm.hosts.addr['h0']}:29400" in listening["h0"] and len(listening["h0"]) >= 3, listening
    assert listening["h1"] and all(a.startswith(f"{slurm.hosts.addr[h]}:") for h in listening
                                   for a in listening[h]), listening
    assert slurm.job(job)["TimeLimit"] == "00:10:00"
    r = slurm.client(["scontrol", "update", f"JobId={job}", "TimeLimit=5"])
    assert r.returncode == 0, r.stderr
    limited = time.monotonic()
    while "[dflash-ds] stop requested (SIGTERM" not in _log(tmp_path, job) and time.monotonic() - limited < 120:
        time.sleep(0.1)
    signalled = time.monotonic() - limited
    if signalled >= 120:  # stuck: every rank's stacks into the job's log, printed whole below the failure
        print(f"ranks signalled for their stacks: {dump_rank_stacks(2.0)}\n{_log(tmp_path, job)}")
    r = slurm.client(["scontrol", "update", f"JobId={job}", "TimeLimit=30"])
    assert r.returncode == 0 and signalled < 120, (r.stderr, _log(tmp_path, job)[-4000:])
    print(f"time limit near: every rank stopped with its checkpoint {signalled:.1f} s later")
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

    found, samples = sampler.stop()
    mac = {k: hmac.new(salt.encode(), secrets[k].encode(), hashlib.sha256).hexdigest()
           for k in ("HF_TOKEN", "WANDB_API_KEY")}
    assert all(e["credentials"] == {"hf_token": mac["HF_TOKEN"], "wandb_api_key": mac["WANDB_API_KEY"]}
               for e in [*first.values(), *second.values()]), (first, second)
    assert samples > 20 and found == set(), found
    traces = [v.encode() for v in secrets.values()] + [hashlib.sha256(v.encode()).hexdigest().encode()
                                                       for v in [*secrets.values(), *lines.values()]]
    leaks = [p for p in files_changed_since(tmp_path, Path("/tmp"), since=started)
             if p.parent != mine and any(t in p.read_bytes() for t in traces)]
    assert leaks == []
    readable = [p for d in (out, tmp_path / "job") for p in d.rglob("*") if p.stat().st_mode & 0o004]
    assert readable == []


class ArgvSampler:
    """Every process's command line, sampled in a thread until `stop()`: the names of `values` seen in one."""

    def __init__(self, values) -> None:
        self.values, self.found, self.samples = list(values), set(), 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            self.found |= {(pid, v) for pid, line in command_lines().items() for v in self.values if v in line}
            self.samples += 1
            time.sleep(0.1)

    def stop(self) -> tuple[set, int]:
        self._done.set()
        self._thread.join(timeout=10)
        return self.found, self.samples


def test_scancel_mid_run_leaves_no_rank_on_any_host(setup, slurm, tmp_path):
    """`scancel` after step 3: SLURM signals every step's processes and the batch shell, then kills what is left
    after KillWait (SLURM's default, 30 s, in this cluster: longer than the bound): no torchrun agent and no rank
    on either host within 2 heartbeats (an agent stuck after its ranks left is killed by train_multinode.sh's
    watcher), and the job is CANCELLED, not requeued."""
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
