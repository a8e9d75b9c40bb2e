"""The trainer on two hosts (tests/hosts.py: network namespaces with their own address, hostname, /dev/shm and
sshd; each host's own name resolves to 127.0.1.1), launched as a user would, against the reference run of
conftest.py (1 target + 2 drafters on one host): the same per-batch losses, with no interface named by the test.

Ranks: h0 runs rank 0 (drafter 0), h1 ranks 1 (drafter 1) and 2 (the target): the ZeRO all-reduce, the bridge
and the job's store all cross the link.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest_runtime import COMMON, HEARTBEAT_S, STEPS, assert_reference_losses
from dflash_ds.runtime.checkpoint import COMPLETE, find_latest, is_complete
from hosts import only_sshd_left, two_hosts
from proc_utils import run_bounded
from runtime_utils import (REPO, command_lines, env_for_children, exit_statuses, files_changed_since, per_batch,
                           read_jsonl)

pytestmark = pytest.mark.timeout(420)


hosts = pytest.fixture(two_hosts, name="hosts")
# A stop held at step 12 (runtime/faults.py) whose checkpoint takes longer than the 30 s DeepSpeed's launch.py waits
# between its SIGTERM and its SIGKILL, with the target (beside drafter 1 on h1) reaching the stop step's batches
# after the drafters agreed on it, as a target slower than its drafters does.
SLOW_STOP_SAVE = {"DFLASH_FAULT_SLOW_SAVE_AT": "12,13", "DFLASH_FAULT_SLOW_SAVE_S": "32",
                  "DFLASH_FAULT_TARGET_HOLD_UNTIL_STOP_STEP_AT": "13"}
# A stop held at step 16 whose checkpoint would take a minute: launch.py's SIGKILL, 30 s after its SIGTERM, comes first.
KILLED_STOP_SAVE = {"DFLASH_FAULT_SLOW_SAVE_AT": "16,17", "DFLASH_FAULT_SLOW_SAVE_S": "60"}


def test_deepspeed_launcher_over_ssh_on_two_hosts(setup, reference, hosts, tmp_path):
    """launch/train_deepspeed.sh on h0 with a 2-host hostfile (pdsh + ssh); the env file it writes carries the
    job's variables (here DFLASH_EXIT_STATUS_DIR: every rank on both hosts records its exit). A SIGTERM to the
    script mid-run leaves the agreed step's checkpoint and 75 (not the runner's 1 with nothing saved), also when
    that save takes longer than the 30 s DeepSpeed's launch.py waits before it SIGKILLs a host's ranks once one has
    exited: no rank (the target beside drafter 1 included) exits before the checkpoint is complete. The same command
    resumes it, and the launches train the reference's batches, each once.

    With sentinel credentials in the launching environment (HF_TOKEN, WANDB_API_KEY, MLFLOW_TRACKING_TOKEN, which
    the deepspeed launcher itself forwards by prefix, and HF_HUB_TOKEN_X and WANDB_KEY, which an HF_* / WANDB_*
    prefix would forward; an MLFLOW_TRACKING_URI whose URL carries the password, a JSON key in GCP_CREDENTIALS_JSON):
    the ranks on h1 read them as the libraries do (huggingface_hub.get_token(), W&B's
    WANDB_API_KEY; each rank records an HMAC under the test's salt), while no process's command line on any host
    (sampled all along), no output and no file left under /tmp or the run folder holds one or its sha256; no
    file of the run (records, checkpoints, exit records) is readable by others (train.umask).
    The job's listening sockets are bound to a host's own address, none to all addresses.

    Between the two, another launch resumes the stop with a heartbeat of HEARTBEAT_S and h1's link is cut once it
    has recorded a step past that checkpoint: the script returns within 2 heartbeats of the cut with ssh's 255
    (pdsh's session to h1 ends on its keep-alives, where it waited for good) and says so, and every rank ends
    within 2 heartbeats. Then a launch that resumes it gets SIGTERM in every process at once (a cgroup-wide kill:
    the runner pkills and exits 1, launch.py SIGKILLs the ranks 30 s later) while its stop checkpoint is being
    written, slowed past those 30 s: the status is not 75, the checkpoint cut short stays a .partial folder and the
    previous one the newest. The last launch resumes that one: the records hold each batch once."""
    target, data = setup
    ref_out, _ = reference
    (tmp_path / "hostfile").write_text("h0 slots=1\nh1 slots=2\n")
    (tmp_path / "exits").mkdir()
    sentinels = {k: f"{k.lower()}-sentinel-{uuid.uuid4().hex}" for k in ("HF_TOKEN", "WANDB_API_KEY",
                                                                         "MLFLOW_TRACKING_TOKEN", "HF_HUB_TOKEN_X",
                                                                         "WANDB_KEY")}
    # Credentials in other forms: a URL carrying its password under an innocent name (MLFLOW_* goes by value through
    # the launcher's own forwarding) and a JSON key file's text; the searches below look for the secret parts.
    inner = {k: f"{k.lower()}-sentinel-{uuid.uuid4().hex}" for k in ("MLFLOW_TRACKING_URI", "GCP_CREDENTIALS_JSON")}
    wrapped = {"MLFLOW_TRACKING_URI": f"https://dflash:{inner['MLFLOW_TRACKING_URI']}@mlflow.invalid/",
               "GCP_CREDENTIALS_JSON": json.dumps({"type": "service_account",
                                                   "private_key": inner["GCP_CREDENTIALS_JSON"]})}
    searched = {**sentinels, **inner}
    salt = uuid.uuid4().hex
    env = hosts.env({**env_for_children(), "HOSTFILE": str(tmp_path / "hostfile"), "MASTER_PORT": "29500",
                     "DFLASH_EXIT_STATUS_DIR": str(tmp_path / "exits"), "TMPDIR": str(tmp_path),
                     "DFLASH_TEST_EXIT_SALT": salt, **sentinels, **wrapped})
    env.pop("GLOO_SOCKET_IFNAME", None)
    started = time.time()
    cmd = ["bash", str(REPO / "launch/train_deepspeed.sh"), *COMMON, "--target", str(target), "--data", str(data),
           "--output-dir", str(tmp_path / "out"), "--zero-stage", "2"]
    seen, listening, samples, outs = set(), {}, 0, []
    # 1: preempted. The drafters hold at the start of step 12 until they see a stop; SIGTERM to the script then (the
    # deepspeed runner itself would kill every rank on both hosts with no checkpoint) must checkpoint the agreed
    # step and end 75. 2: the same command resumes it (train.resume auto) and h1's link is cut past that
    # checkpoint. 3: the link back, the same command resumes it, holds at step 16 and every process of the launch
    # gets SIGTERM (the runner's status, 1). 4: the same command resumes the same checkpoint and finishes.
    stop = cut = None
    for hold, want, slow in (("12", 75, SLOW_STOP_SAVE), ("cut", 255, {}), ("16", 1, KILLED_STOP_SAVE), ("", 0, {})):
        extra = ["--train.heartbeat_timeout_s", str(HEARTBEAT_S)] if hold == "cut" else []
        for old in (tmp_path / "exits").glob("rank*.json"):  # this launch's ranks' exits only
            old.unlink()
        proc = hosts.popen("h0", [*cmd, *extra], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env={**env, "DFLASH_FAULT_HOLD_UNTIL_STOP_AT": "" if hold == "cut" else hold,
                                           **slow})
        termed = armed = False
        with ThreadPoolExecutor(1) as pool:
            reading = pool.submit(proc.communicate, timeout=360)
            while not reading.done():  # every process of the machine: the hosts share one pid namespace
                seen |= {(pid, name) for pid, cmd_line in command_lines().items() for name, v in searched.items()
                         if v in cmd_line}
                samples += 1
                if not listening and _records(tmp_path / "out"):  # training: every socket of the job is open
                    listening = {h: hosts.listening(h) for h in hosts.names}
                if hold == "12" and not termed and _last_step(tmp_path / "out") >= 11:
                    proc.send_signal(signal.SIGTERM)  # the script only (its own session: the runner's is apart)
                    termed = True
                if hold == "cut" and cut is None and _last_step(tmp_path / "out") >= stop:  # a step to redo
                    hosts.link("h1", up=False)
                    cut = (time.monotonic(), time.time())
                armed = armed or (hold == "16" and _last_step(tmp_path / "out") < stop)  # records cut back to it
                if hold == "16" and armed and not termed and _last_step(tmp_path / "out") >= 15:
                    hosts.terminate_all()  # every process of the launch on both hosts: the runner's pkill, exit 1
                    termed = True
                time.sleep(0.05)
            out, err = reading.result()
        outs.append(out + err)
        assert proc.returncode == want, out[-3000:] + err[-5000:]
        if hold == "16":
            _assert_the_killed_save_is_not_taken(hosts, tmp_path, stop, out + err)
        elif hold == "cut":
            _assert_the_cut_ended_the_launch(hosts, tmp_path, cut, stop, out + err)
        elif hold:
            # held at the start of step 12 when the stop comes, they finish it and checkpoint 13 (12 if the stop
            # reached them between step 11's record and the hold)
            stop = int((tmp_path / "out/checkpoints/latest").read_text().strip().removeprefix("step_"))
            assert stop in (12, 13) and _last_step(tmp_path / "out") == stop - 1, (stop, out[-3000:])
            assert f"stop requested (stop file {tmp_path}/.dflash-stop." in out, out[-3000:]
            assert sorted(exit_statuses(tmp_path / "exits")) == [0, 1, 2]
            assert {e["status"] for e in exit_statuses(tmp_path / "exits").values()} == {75}
            # The save took longer than the 30 s h1's launch.py gives its ranks after one exits: none left before
            # the checkpoint was complete (the target used to, and its launch.py then killed drafter 1 mid-save).
            complete = (tmp_path / f"out/checkpoints/step_{stop:08d}/{COMPLETE}").stat().st_mtime
            exits = exit_statuses(tmp_path / "exits")
            assert all(e["time"] > complete - 0.1 for e in exits.values()), (complete, exits)
            assert not list(tmp_path.glob(".dflash-stop.*"))
    out, err = outs[-1], ""
    assert "h0: [dflash-ds] h0: GLOO_SOCKET_IFNAME=eth0: routes to MASTER_ADDR 198.18.0.1" in out
    assert "h1: [dflash-ds] h1: GLOO_SOCKET_IFNAME=eth0: routes to MASTER_ADDR 198.18.0.1" in out
    assert f"resuming from {tmp_path}/out/checkpoints/step_{stop:08d} " in out, out[-3000:]
    assert_reference_losses(tmp_path / "out", ref_out)  # every batch, at the reference's step and loss
    records = [r for f in (tmp_path / "out/records").glob("drafter*.jsonl") for r in read_jsonl(f)]
    assert len(records) == 2 * STEPS  # across the stop and the cut: none lost, none repeated
    for d in (0, 1):  # what a resume reads back (the record windows est_tau scales to): a step once
        steps = [r["step"] for r in read_jsonl(tmp_path / f"out/records/uniform{d}.jsonl")]
        assert steps == [5, 10, 15, 20] or steps == [5, 10, stop, 15, 20], (d, steps)  # a stop closes a window
    exits = exit_statuses(tmp_path / "exits")
    assert sorted(exits) == [0, 1, 2]
    mac = {k: hmac.new(salt.encode(), v.encode(), hashlib.sha256).hexdigest() for k, v in sentinels.items()}
    for rank in (0, 1, 2):  # 1 and 2 run on h1
        assert exits[rank]["credentials"] == {"hf_token": mac["HF_TOKEN"],
                                              "wandb_api_key": mac["WANDB_API_KEY"]}, (rank, exits[rank])
    print(f"{samples} samples of every command line during the run; listening: {listening}")
    assert samples > 20 and seen == set(), seen
    assert not any(v in text for v in searched.values() for text in outs)
    traces = [v.encode() for v in searched.values()] + [hashlib.sha256(v.encode()).hexdigest().encode()
                                                        for v in [*searched.values(), *wrapped.values()]]
    leaks = [p for p in files_changed_since(tmp_path, Path("/tmp"), since=started) if any(t in p.read_bytes() for t in traces)]
    assert leaks == []
    readable = [p for d in (tmp_path / "out", tmp_path / "exits") for p in d.rglob("*") if p.stat().st_mode & 0o004]
    assert readable == []
    assert not list(tmp_path.glob("dflash-deepspeed-env.*")) and not list(tmp_path.glob(".dflash-credentials.*"))
    # The job's store on h0's own address; gloo's pairs (the bridge, ZeRO's group) on eth0's, by GLOO_SOCKET_IFNAME.
    assert "198.18.0.1:29501" in listening["h0"], listening
    assert all(addr.rsplit(":", 1)[0] in ("198.18.0.1", "198.18.0.2", "127.0.0.1")
               for h in hosts.names for addr in listening[h]), listening
    assert only_sshd_left(hosts) == {"h0": [], "h1": []}


def _assert_the_cut_ended_the_launch(hosts, tmp_path: Path, cut: tuple[float, float] | None, stop: int,
                                     text: str) -> None:
    """After the cut launch (`cut`: when, monotonic and wall clock): it ended within 2 heartbeats of the cut, with
    255 and a line that says why, and so did every rank on both sides; steps past the checkpoint were recorded."""
    assert cut is not None, text[-4000:]
    took = time.monotonic() - cut[0]
    exits = _wait_exits(tmp_path / "exits", [0, 1, 2], timeout=2 * HEARTBEAT_S)
    ranks = {rank: (e["status"], round(e["time"] - cut[1], 1)) for rank, e in exits.items()}
    print(f"link cut at step {_last_step(tmp_path / 'out')} (checkpoint {stop}): the launch returned {took:.1f} s "
          f"later (heartbeat {HEARTBEAT_S} s); rank: (status, seconds after the cut) {ranks}")
    assert took <= 2 * HEARTBEAT_S, (took, text[-4000:])
    assert "pdsh@h0: h1: ssh exited with exit code 255" in text, text[-4000:]
    assert "[dflash-ds] exit 255: pdsh lost its ssh session to a host (named above): it did not answer the " \
           "keep-alives (-o ServerAliveInterval=1 -o ServerAliveCountMax=13: its link is cut" in text, text[-4000:]
    for lost in (r"rank 1 \(drafter 1\)", r"rank 2 \(target 0\)"):
        assert re.search(rf"rank 0 at step \d+: lost {lost}: no heartbeat", text), text[-4000:]
    assert sorted(ranks) == [0, 1, 2] and all(s == 3 and t <= 2 * HEARTBEAT_S for s, t in ranks.values()), ranks
    assert _last_step(tmp_path / "out") >= stop  # recorded past the checkpoint: the resume trains it again
    hosts.link("h1", up=True)


def _assert_the_killed_save_is_not_taken(hosts, tmp_path: Path, stop: int, text: str) -> None:
    """After the launch whose every process got SIGTERM in its slowed stop checkpoint: once launch.py has SIGKILLed
    the ranks, that save is a .partial folder, the checkpoint of `stop` still the newest, and no rank said 75."""
    deadline = time.monotonic() + 90
    while only_sshd_left(hosts) != {"h0": [], "h1": []} and time.monotonic() < deadline:
        time.sleep(0.5)
    assert only_sshd_left(hosts) == {"h0": [], "h1": []}
    root = tmp_path / "out/checkpoints"
    assert find_latest(tmp_path / "out") == root / f"step_{stop:08d}"
    partial = sorted(p.name for p in root.iterdir() if p.name.startswith("step_") and not is_complete(p))
    exits = exit_statuses(tmp_path / "exits")
    assert partial in (["step_00000016.partial"], ["step_00000017.partial"]), (os.listdir(root), exits, text[-6000:])
    assert 75 not in {e["status"] for e in exits.values()}, (exits, text[-4000:])


def test_torchrun_on_both_hosts_over_a_slow_lossy_link_that_pauses(setup, reference, hosts, tmp_path):
    """launch/train_multinode.sh on h0 and h1 with RDZV_HOST=h0, which is 127.0.1.1 on h0 itself: h0's agent
    hosts the rendezvous on h0's one address off loopback, which becomes MASTER_ADDR, and every rank takes the
    interface that routes there; nobody names one. Every listening socket of the job (the rendezvous store, the
    agents' store, the job's store, gloo's pairs) is on its host's own address, none on all of them. h1's
    link is slow (tc tbf, 200 Mbit/s out) and drops 1% of its packets both ways (nftables; this kernel has no
    netem for a fixed delay), and is cut for PAUSE_S after step 5 (shorter than every timeout): no step
    completes while it is down (every step crosses it: ZeRO's all-reduce, the target's hidden states), the
    job goes on once it is back and trains the reference's losses all the same."""
    target, data = setup
    ref_out, _ = reference
    out = tmp_path / "out"
    args = [*COMMON, "--target", str(target), "--data", str(data), "--output-dir", str(out), "--zero-stage", "2"]
    base = hosts.env({**env_for_children(), "NNODES": "2", "RDZV_HOST": "h0", "RDZV_PORT": "29400"})
    base.pop("GLOO_SOCKET_IFNAME", None)
    hosts.shape("h1", "tbf", "rate", "200mbit", "burst", "256kb", "latency", "50ms")
    hosts.lossy("h1", 1)
    procs = {h: hosts.popen(h, ["bash", str(REPO / "launch/train_multinode.sh"), *args], cwd=tmp_path,
                            env={**base, "NPROC": n}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for h, n in (("h0", "1"), ("h1", "2"))}
    with ThreadPoolExecutor(2) as pool:  # read both outputs while the link is cut and restored
        reading = {h: pool.submit(p.communicate, timeout=360) for h, p in procs.items()}
        deadline, seen = time.monotonic() + 300, {}
        while _last_step(out) < 5 and time.monotonic() < deadline:
            _fail_if_ended(hosts, procs, reading, "before step 5")
            seen.setdefault(_last_step(out), time.monotonic())
            time.sleep(0.1)
        listening = {h: hosts.listening(h) for h in hosts.names}  # training: every socket of the job is open
        # Long enough for 3 steps at the pace so far (a link that was never cut shows steps), short of every timeout.
        pause = min(20.0, max(PAUSE_S, 3 * (time.monotonic() - seen.get(1, seen[min(seen)])) / 4))
        hosts.link("h1", up=False)
        # A step whose last collective was through as the link went may still be recorded in the first moment; a
        # step needs the link (ZeRO's all-reduce, the target's hidden states): after that nothing may complete.
        time.sleep(1)
        stalled_from = _last_step(out)
        time.sleep(pause - 1)
        stalled_to = _last_step(out)
        hosts.link("h1", up=True)
        outs = {h: f.result()[0] for h, f in reading.items()}
    for h, p in procs.items():
        assert p.returncode == 0, (h, outs[h][-5000:])
    print(f"link down for {pause:.1f}s: last step {stalled_from} 1 s after the cut, {stalled_to} as it came back; "
          f"{hosts.dropped('h1')} packets dropped")
    assert 5 <= stalled_from < STEPS - 1, stalled_from  # the pause fell inside the run
    assert stalled_to == stalled_from  # stalled: no step completed while the link was down
    assert _last_step(out) == STEPS - 1 > stalled_to  # and went on after it
    assert hosts.dropped("h1") > 0  # the loss was real
    text = outs["h0"] + outs["h1"]
    assert "[dflash-ds] h0: rendezvous store on 198.18.0.1:29400" in text
    assert "[dflash-ds] h0: GLOO_SOCKET_IFNAME=eth0: routes to MASTER_ADDR 198.18.0.1 = 198.18.0.1" in text
    print(f"listening: {listening}")
    assert "198.18.0.1:29400" in listening["h0"] and len(listening["h0"]) >= 3 and listening["h1"], listening
    assert all(a.startswith(f"{hosts.addr[h]}:") for h in hosts.names for a in listening[h]), listening
    assert re.search(r"\[dflash-ds\] h1: GLOO_SOCKET_IFNAME=eth0: routes to MASTER_ADDR \S+ = 198\.18\.0\.1", text), \
        text[-3000:]
    assert "(the user's)" not in text
    assert_reference_losses(out, ref_out)
    assert only_sshd_left(hosts) == {"h0": [], "h1": []}


PAUSE_S = 4  # the shortest pause (s)


def _last_step(out) -> int:
    return max((r["step"] for r in _records(out)), default=-1)


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
    """h1 (drafter 1 and the target) loses its link for good after the step-10 checkpoint: every rank, on both
    sides of the cut, ends within 2 heartbeats (HEARTBEAT_S) of it, naming the ranks it lost: h0's rank both of
    h1's, h1's ranks the store's host, rank 0. So does each host's launch: h0's torchrun by itself, h1's (blocked
    on the rendezvous store across the cut) SIGKILLed by its watcher, which its ranks told. The checkpoint
    survives, and h0 alone (launch/train.sh, 1 target + 1 drafter accumulating the global batch of 2) resumes
    it: steps 10-19 train the reference's losses."""
    target, data = setup
    ref_out, _ = reference
    out = tmp_path / "out"
    args = [*COMMON, "--target", str(target), "--data", str(data), "--zero-stage", "2"]
    (tmp_path / "exits").mkdir()
    base = hosts.env({**env_for_children(), "NNODES": "2", "RDZV_HOST": "h0", "RDZV_PORT": "29400"})
    hosts.shape("h1", "tbf", "rate", "200mbit", "burst", "256kb", "latency", "50ms")  # steps slow enough to cut
    procs = {h: hosts.popen(h, ["bash", str(REPO / "launch/train_multinode.sh"), *args, "--output-dir", str(out),
                                "--train.heartbeat_timeout_s", str(HEARTBEAT_S)], cwd=tmp_path,
                            env={**base, "NPROC": n, "DFLASH_EXIT_STATUS_DIR": str(tmp_path / "exits")},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for h, n in (("h0", "1"), ("h1", "2"))}
    with ThreadPoolExecutor(2) as pool:
        reading = {h: pool.submit(p.communicate, timeout=360) for h, p in procs.items()}
        latest = out / "checkpoints" / "latest"
        deadline = time.monotonic() + 300
        while not (latest.exists() and latest.read_text().strip() == "step_00000010"
                   and any(r["step"] >= 11 for r in _records(out))) and time.monotonic() < deadline:
            assert procs["h0"].poll() is None, "the job ended before the cut"
            time.sleep(0.1)
        hosts.link("h1", up=False)
        cut, t0 = time.time(), time.monotonic()
        ended: dict[str, float] = {}  # host -> seconds from the cut to the end of its launch
        while len(ended) < 2 and time.monotonic() - t0 < 3 * HEARTBEAT_S:
            ended |= {h: round(time.monotonic() - t0, 1) for h, p in procs.items() if h not in ended and p.poll()
                      is not None}
            time.sleep(0.1)
        exits = _wait_exits(tmp_path / "exits", [0, 1, 2], timeout=HEARTBEAT_S)
        left = only_sshd_left(hosts)
        hosts.close()  # a launch still running would hold the test up to its timeout: the asserts come below
        text, text_h1 = reading["h0"].result()[0], reading["h1"].result()[0]
    cut_at = max(r["step"] for r in _records(out))
    assert cut_at < STEPS - 1 and procs["h0"].returncode != 0, (cut_at, text[-3000:])
    ours = "\n".join(line for line in text.splitlines() if "[dflash-ds]" in line)
    for lost in (r"rank 1 \(drafter 1\)", r"rank 2 \(target 0\)"):
        assert re.search(rf"rank 0 at step \d+: lost {lost}: no heartbeat for \d+s \(its last step was \d+\)",
                         ours), ours
    for rank in (1, 2):
        assert re.search(rf"rank {rank} at step \d+: lost contact with the job store on rank 0 \(drafter 0\): "
                         r"no answer for \d+s", text_h1), text_h1[-3000:]
    took = {rank: round(e["time"] - cut, 1) for rank, e in exits.items()}
    print(f"link cut at step {cut_at}: ranks ended {took} s later (heartbeat {HEARTBEAT_S} s)")
    assert sorted(exits) == [0, 1, 2] and all(e["status"] != 0 for e in exits.values()), exits
    assert max(took.values()) <= 2 * HEARTBEAT_S, took
    print(f"launches ended {ended} s after the cut")
    assert sorted(ended) == ["h0", "h1"] and max(ended.values()) <= 2 * HEARTBEAT_S, (ended, left)
    assert left == {"h0": [], "h1": []}, left
    assert re.search(r"\[dflash-ds\] torchrun agent \d+ still running 5 s after its ranks ended cut off from the "
                     r"job store's host", text_h1) and procs["h1"].returncode == -signal.SIGKILL, text_h1[-3000:]
    run = tmp_path / "resume"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(out / "checkpoints" / "step_00000010", run / "checkpoints" / "step_00000010")
    (run / "checkpoints" / "latest").write_text("step_00000010\n")
    r = run_bounded(["bash", str(REPO / "launch/train.sh"), *args, "--output-dir", str(run)], 300, cwd=tmp_path,
                    env={**base, "NPROC": "2", "MASTER_PORT": "29500"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got, want = per_batch(run), per_batch(ref_out)
    assert sorted(got) == [b for b in sorted(want) if want[b]["step"] >= 10]
    for b, rec in got.items():
        assert rec["step"] == want[b]["step"] and abs(rec["loss"] - want[b]["loss"]) < 1e-4, (b, rec, want[b])


def _fail_if_ended(hosts, procs, reading, when: str) -> None:
    """Fail with both hosts' output if a host's launcher has exited already."""
    if all(p.poll() is None for p in procs.values()):
        return
    hosts.close()  # the other host's job would wait for the missing one: end it to read its output
    outs = {h: f.result()[0][-4000:] for h, f in reading.items()}
    pytest.fail(f"the job ended {when}: {outs}")


def _wait_exits(folder: Path, ranks: list[int], timeout: float) -> dict[int, dict]:
    """The exit records of `ranks` (DFLASH_EXIT_STATUS_DIR), waiting up to `timeout` s for the last of them."""
    deadline = time.monotonic() + timeout
    while not all((folder / f"rank{r}.json").exists() for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    return exit_statuses(folder)


