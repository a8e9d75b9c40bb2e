"""The trainer on two hosts (tests/hosts.py: network namespaces with their own address, hostname, /dev/shm and
sshd; each host's own name resolves to 127.0.1.1), launched as a user would, against the reference run of
conftest.py (1 target + 2 drafters on one host): the same per-batch losses, with no interface named by the test.

Ranks: h0 runs rank 0 (drafter 0), h1 ranks 1 (drafter 1) and 2 (the target): the ZeRO all-reduce, the bridge
and the job's store all cross the link.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest_runtime import COMMON, STEPS
from hosts import only_sshd_left, two_hosts
from runtime_utils import REPO, env_for_children, exit_statuses, per_batch

pytestmark = pytest.mark.timeout(420)


hosts = pytest.fixture(two_hosts, name="hosts")


def assert_reference_losses(out, ref_out):
    got, want = per_batch(out), per_batch(ref_out)
    assert sorted(got) == sorted(want) == list(range(2 * STEPS))
    for b, rec in want.items():
        assert got[b]["step"] == rec["step"] and abs(got[b]["loss"] - rec["loss"]) < 1e-4, (b, got[b], rec)


def test_deepspeed_launcher_over_ssh_on_two_hosts(setup, reference, hosts, tmp_path):
    """launch/train_deepspeed.sh on h0 with a 2-host hostfile (pdsh + ssh); the env file it writes carries the
    job's variables (here DFLASH_EXIT_STATUS_DIR: every rank on both hosts records its exit)."""
    target, data = setup
    ref_out, _ = reference
    (tmp_path / "hostfile").write_text("h0 slots=1\nh1 slots=2\n")
    (tmp_path / "exits").mkdir()
    env = hosts.env({**env_for_children(), "HOSTFILE": str(tmp_path / "hostfile"), "MASTER_PORT": "29500",
                     "DFLASH_EXIT_STATUS_DIR": str(tmp_path / "exits"), "TMPDIR": str(tmp_path)})
    env.pop("GLOO_SOCKET_IFNAME", None)
    r = hosts.run("h0", ["bash", str(REPO / "launch/train_deepspeed.sh"), *COMMON, "--target", str(target),
                         "--data", str(data), "--output-dir", str(tmp_path / "out"), "--zero-stage", "2"],
                  timeout=360, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "h0: [dflash-ds] h0: GLOO_SOCKET_IFNAME=eth0: routes to MASTER_ADDR 198.18.0.1" in r.stdout
    assert "h1: [dflash-ds] h1: GLOO_SOCKET_IFNAME=eth0: routes to MASTER_ADDR 198.18.0.1" in r.stdout
    assert_reference_losses(tmp_path / "out", ref_out)
    assert sorted(exit_statuses(tmp_path / "exits")) == [0, 1, 2]
    env_file = next(tmp_path.glob("dflash-deepspeed-env.*")).read_text()
    assert "DFLASH_EXIT_STATUS_DIR=" in env_file and "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in env_file
    assert only_sshd_left(hosts) == {"h0": [], "h1": []}


def test_torchrun_on_both_hosts_over_a_slow_lossy_link_that_pauses(setup, reference, hosts, tmp_path):
    """launch/train_multinode.sh on h0 and h1 with RDZV_HOST=h0, which is 127.0.1.1 on h0 itself: h0's ranks
    find the interface from the address h1 reaches it at; h1 names its interface itself (a user's
    GLOO_SOCKET_IFNAME wins). h1's link is slow (tc tbf, 200 Mbit/s out) and drops 1% of its packets both
    ways (nftables; this kernel has no netem for a fixed delay), and is cut for 3 s after step 5 (shorter
    than every timeout): the job trains the reference's losses all the same."""
    target, data = setup
    ref_out, _ = reference
    out = tmp_path / "out"
    args = [*COMMON, "--target", str(target), "--data", str(data), "--output-dir", str(out), "--zero-stage", "2"]
    base = hosts.env({**env_for_children(), "NNODES": "2", "RDZV_HOST": "h0", "RDZV_PORT": "29400"})
    base.pop("GLOO_SOCKET_IFNAME", None)
    hosts.shape("h1", "tbf", "rate", "200mbit", "burst", "256kb", "latency", "50ms")
    hosts.lossy("h1", 1)
    procs = {h: hosts.popen(h, ["bash", str(REPO / "launch/train_multinode.sh"), *args], cwd=tmp_path,
                            env={**base, **extra}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for h, extra in (("h0", {"NPROC": "1"}), ("h1", {"NPROC": "2", "GLOO_SOCKET_IFNAME": "eth0"}))}
    with ThreadPoolExecutor(2) as pool:  # read both outputs while the link is cut and restored
        reading = {h: pool.submit(p.communicate, timeout=360) for h, p in procs.items()}
        deadline = time.monotonic() + 300
        while not any(r["step"] >= 5 for r in _records(out)) and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs.values()), "the job ended before step 5"
            time.sleep(0.2)
        hosts.link("h1", up=False)
        time.sleep(3)
        hosts.link("h1", up=True)
        paused_at = max(r["step"] for r in _records(out))
        outs = {h: f.result()[0] for h, f in reading.items()}
    for h, p in procs.items():
        assert p.returncode == 0, (h, outs[h][-5000:])
    assert 5 <= paused_at < STEPS - 1, paused_at  # the pause fell inside the run
    print(f"link paused at step {paused_at}; {hosts.dropped('h1')} packets dropped")
    assert hosts.dropped("h1") > 0  # the loss was real
    text = outs["h0"] + outs["h1"]
    assert "[dflash-ds] h0: GLOO_SOCKET_IFNAME=eth0: owns 198.18.0.1, the address other hosts reach" in text
    assert "[dflash-ds] h1: GLOO_SOCKET_IFNAME=eth0 (the user's): set by the user" in text
    assert_reference_losses(out, ref_out)
    assert only_sshd_left(hosts) == {"h0": [], "h1": []}


def _records(out):
    return list(per_batch(out).values()) if (out / "records").is_dir() else []


def test_a_host_that_fails_to_start_ends_the_job_on_the_other(setup, hosts, tmp_path):
    """h1's ranks stop at once on a GLOO_SOCKET_IFNAME naming no interface (one error naming the variable) and
    publish it in the job's store: h0's rank, left waiting for them, ends within seconds naming the failed rank
    and its reason, not at train.startup_timeout_s (120 s here) nor after gloo's timeouts."""
    target, data = setup
    args = [*COMMON, "--target", str(target), "--data", str(data), "--output-dir", str(tmp_path / "out"),
            "--train.startup_timeout_s", "120"]
    (tmp_path / "exits").mkdir()
    base = hosts.env({**env_for_children(), "NNODES": "2", "RDZV_HOST": "h0", "RDZV_PORT": "29400",
                      "DFLASH_EXIT_STATUS_DIR": str(tmp_path / "exits")})
    base.pop("GLOO_SOCKET_IFNAME", None)
    procs = {h: hosts.popen(h, ["bash", str(REPO / "launch/train_multinode.sh"), *args], cwd=tmp_path,
                            env={**base, **extra}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for h, extra in (("h0", {"NPROC": "1"}), ("h1", {"NPROC": "2", "GLOO_SOCKET_IFNAME": "nosuch0"}))}
    outs = {h: p.communicate(timeout=180)[0] for h, p in procs.items()}
    assert procs["h1"].returncode != 0 and procs["h0"].returncode != 0, outs
    reason = "GLOO_SOCKET_IFNAME=nosuch0: h1 has no interface 'nosuch0' (it has eth0, lo)"
    assert reason in outs["h1"], outs["h1"]
    assert re.search(r"rank 0: rank [12] failed to start \(joining the job's process groups\): "
                     + re.escape(reason), outs["h0"]), outs["h0"][-4000:]
    exits = exit_statuses(tmp_path / "exits")  # each rank's exit time, as it left (the clock of one machine)
    took = exits[0]["time"] - min(exits[r]["time"] for r in (1, 2))
    print(f"h0's rank 0 exited {took:.2f}s after h1's first rank failed")
    assert exits[0]["status"] == 1 and took < 5, (exits, took)  # the store is polled every 0.5 s
    assert only_sshd_left(hosts) == {"h0": [], "h1": []}


def test_a_cut_link_ends_the_job_and_the_remaining_host_resumes_exactly(setup, reference, hosts, tmp_path):
    """h1 (drafter 1 and the target) loses its link for good after the step-10 checkpoint: h0's rank names a
    lost rank of h1 and exits within the heartbeat bound (10 s here); the checkpoint survives, and h0 alone
    (launch/train.sh, 1 target + 1 drafter accumulating the global batch of 2) resumes it: steps 10-19 train
    the reference's losses."""
    target, data = setup
    ref_out, _ = reference
    out = tmp_path / "out"
    args = [*COMMON, "--target", str(target), "--data", str(data), "--zero-stage", "2"]
    base = hosts.env({**env_for_children(), "NNODES": "2", "RDZV_HOST": "h0", "RDZV_PORT": "29400"})
    hosts.shape("h1", "tbf", "rate", "200mbit", "burst", "256kb", "latency", "50ms")  # steps slow enough to cut
    procs = {h: hosts.popen(h, ["bash", str(REPO / "launch/train_multinode.sh"), *args, "--output-dir", str(out),
                                "--train.heartbeat_timeout_s", "10"], cwd=tmp_path, env={**base, "NPROC": n},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for h, n in (("h0", "1"), ("h1", "2"))}
    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(procs["h0"].communicate, timeout=360)
        latest = out / "checkpoints" / "latest"
        deadline = time.monotonic() + 300
        while not (latest.exists() and latest.read_text().strip() == "step_00000010"
                   and any(r["step"] >= 11 for r in _records(out))) and time.monotonic() < deadline:
            assert procs["h0"].poll() is None, "the job ended before the cut"
            time.sleep(0.1)
        hosts.link("h1", up=False)
        cut = time.monotonic()
        text = reading.result()[0]
        took = time.monotonic() - cut
    cut_at = max(r["step"] for r in _records(out))
    assert cut_at < STEPS - 1 and procs["h0"].returncode != 0, (cut_at, text[-3000:])
    ours = "\n".join(line for line in text.splitlines() if "[dflash-ds]" in line)
    lost = (r"rank 0 at step \d+: lost rank [12] \((drafter 1|target 0)\): "
            r"no heartbeat for 1\ds \(its last step was \d+\)")
    assert re.search(lost, ours), ours
    print(f"link cut at step {cut_at}: h0's job ended {took:.1f}s later")
    assert took < 10 + 30, took  # the heartbeat bound, plus the launcher's teardown
    assert only_sshd_left(hosts)["h0"] == []
    run = tmp_path / "resume"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(out / "checkpoints" / "step_00000010", run / "checkpoints" / "step_00000010")
    (run / "checkpoints" / "latest").write_text("step_00000010\n")
    r = hosts.run("h0", ["bash", str(REPO / "launch/train.sh"), *args, "--output-dir", str(run)], timeout=300,
                  cwd=tmp_path, env={**base, "NPROC": "2", "MASTER_PORT": "29500"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got, want = per_batch(run), per_batch(ref_out)
    assert sorted(got) == [b for b in sorted(want) if want[b]["step"] >= 10]
    for b, rec in got.items():
        assert rec["step"] == want[b]["step"] and abs(rec["loss"] - want[b]["loss"]) < 1e-4, (b, rec, want[b])


def test_a_host_whose_processes_are_killed_is_named_by_the_other(setup, hosts, tmp_path):
    """Every process of h1 (its torchrun agent, drafter 1 and the target) SIGKILLed after step 3, as when a
    host crashes: h0's rank names a lost rank of h1 and exits within the heartbeat bound (10 s here)."""
    target, data = setup
    out = tmp_path / "out"
    args = [*COMMON, "--target", str(target), "--data", str(data), "--output-dir", str(out),
            "--train.heartbeat_timeout_s", "10"]
    base = hosts.env({**env_for_children(), "NNODES": "2", "RDZV_HOST": "h0", "RDZV_PORT": "29400"})
    hosts.shape("h1", "tbf", "rate", "200mbit", "burst", "256kb", "latency", "50ms")  # steps slow enough to kill
    procs = {h: hosts.popen(h, ["bash", str(REPO / "launch/train_multinode.sh"), *args], cwd=tmp_path,
                            env={**base, "NPROC": n}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for h, n in (("h0", "1"), ("h1", "2"))}
    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(procs["h0"].communicate, timeout=360)
        deadline = time.monotonic() + 300
        while not any(r["step"] >= 3 for r in _records(out)) and time.monotonic() < deadline:
            assert procs["h0"].poll() is None, "the job ended before the kill"
            time.sleep(0.1)
        for pid in hosts.pids("h1"):
            if pid != hosts.sshd["h1"].pid:
                os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        text = reading.result()[0]
        took = time.monotonic() - killed
    ours = "\n".join(line for line in text.splitlines() if "[dflash-ds]" in line)
    assert procs["h0"].returncode != 0 and max(r["step"] for r in _records(out)) < STEPS - 1, ours
    assert re.search(r"rank 0 at step \d+: lost rank [12] \((drafter 1|target 0)\)", ours), ours
    print(f"h1 killed: h0's job ended {took:.1f}s later")
    assert took < 10 + 30, took  # the heartbeat bound, plus the launcher's teardown
    assert only_sshd_left(hosts) == {"h0": [], "h1": []}
