"""pdsh's ssh keep-alives (launch/train_deepspeed.sh, `python -m dflash_ds.distributed.hostfile ssh-args`): a session
to a host that went silent ends after more than one heartbeat and within two, the options reach pdsh ahead of the
user's own, a bad config fails before the launcher, and the script says what a 255 means. The cut link itself, on
two hosts through pdsh and ssh, is test_multihost_train.py::test_deepspeed_launcher_over_ssh_on_two_hosts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ds.distributed.hostfile import heartbeat_timeout_of, ssh_keepalive

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/tiny.yaml"


@pytest.mark.parametrize("heartbeat", [3, 4, 5, 8, 10, 30, 60, 61.5, 600, 3600])
def test_a_silent_host_is_given_up_after_one_heartbeat_and_within_two(heartbeat):
    """OpenSSH ends a session C x I to (C + 1) x I seconds after the host went silent (I = ServerAliveInterval,
    C = ServerAliveCountMax): more than a heartbeat (a link pause the ranks wait out keeps it), under two (from 8 s
    on, at most 1.5: the near side's ranks end about one heartbeat after a cut)."""
    opts = ssh_keepalive(heartbeat)
    assert opts[0::2] == ["-o", "-o"]
    interval = int(opts[1].removeprefix("ServerAliveInterval="))
    count = int(opts[3].removeprefix("ServerAliveCountMax="))
    assert heartbeat < count * interval and (count + 1) * interval <= (1.5 if heartbeat >= 8 else 2) * heartbeat


@pytest.mark.parametrize("args, want", [
    ([], 60.0), (["--config", "CFG"], 30.0), (["--config=CFG", "--target", "t"], 30.0),
    (["--config", "CFG", "--train.heartbeat_timeout_s", "10"], 10.0),
    (["--train.heartbeat-timeout-s=12.5", "--config", "CFG"], 12.5),
    (["--train.heartbeat_timeout_s", "20", "--train.seed", "3", "--train.heartbeat_timeout_s=5"], 5.0),
    (["--config", "CFG", "--help"], 30.0)])
def test_the_heartbeat_is_the_one_the_ranks_read(tmp_path, args, want):
    """The launcher reads train.heartbeat_timeout_s from the trainer's arguments as dflash_ds/train.py does: the
    default, a --config file that sets it (30 here), an override in either spelling, the last override winning."""
    from dflash_ds.train import config_from_args

    cfg = tmp_path / "run.yaml"
    cfg.write_text(TINY.read_text().replace("\ntrain:\n", "\ntrain:\n  heartbeat_timeout_s: 30\n", 1))
    args = [a.replace("CFG", str(cfg)) for a in args]
    assert heartbeat_timeout_of(args) == want
    assert config_from_args([a for a in args if a != "--help"]).train.heartbeat_timeout_s == want


def _ssh_args(*train_args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_ds.distributed.hostfile", "ssh-args", "--", *train_args],
                          capture_output=True, text=True, timeout=60)


def test_the_options_follow_the_runs_heartbeat_and_a_bad_one_is_one_error():
    r = _ssh_args("--config", str(TINY), "--train.heartbeat_timeout_s", "10")
    assert (r.returncode, r.stdout) == (0, "-o ServerAliveInterval=1 -o ServerAliveCountMax=13\n"), r.stderr
    r = _ssh_args("--config", str(TINY))  # the default, 60 s: given up after 77-84 s
    assert r.stdout == "-o ServerAliveInterval=7 -o ServerAliveCountMax=11\n", r.stderr
    r = _ssh_args("--help")  # the ranks print the help: the default
    assert r.stdout == "-o ServerAliveInterval=7 -o ServerAliveCountMax=11\n", r.stderr
    r = _ssh_args("--config", str(TINY), "--train.heartbeat_timeout_s", "0")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "[dflash-ds] error: config: train.heartbeat_timeout_s = 0.0 must be > 0\n"


def _launch(tmp_path: Path, *train_args: str, pdsh_args: str | None = None) -> subprocess.CompletedProcess:
    """launch/train_deepspeed.sh over two hosts with a stand-in `deepspeed` that records the PDSH_SSH_ARGS_APPEND
    it was given and exits 255, as the runner does when pdsh's ssh session to a host ended on its keep-alives."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "deepspeed").write_text(f'#!/bin/sh\nprintf %s "$PDSH_SSH_ARGS_APPEND" > {tmp_path / "called"}\n'
                                       "exit 255\n")
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # the script's "$PYTHON"
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    (tmp_path / "hostfile").write_text("h0 slots=1\nh1 slots=2\n")
    env = {**os.environ, "HOSTFILE": str(tmp_path / "hostfile"), "TMPDIR": str(tmp_path),
           "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])}
    env.pop("PDSH_SSH_ARGS_APPEND", None)
    if pdsh_args is not None:
        env["PDSH_SSH_ARGS_APPEND"] = pdsh_args
    return subprocess.run(["bash", str(REPO / "launch/train_deepspeed.sh"), "--config", str(TINY), *train_args],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


def test_the_script_gives_pdsh_the_keepalives_first_and_says_what_255_means(tmp_path):
    r = _launch(tmp_path, "--train.heartbeat_timeout_s", "10", pdsh_args="-p 2222 -o ServerAliveInterval=99")
    assert r.returncode == 255, r.stderr
    # ssh takes the first value of an option: the job's, over the user's and ~/.ssh/config
    assert (tmp_path / "called").read_text() == \
        "-o ServerAliveInterval=1 -o ServerAliveCountMax=13 -p 2222 -o ServerAliveInterval=99"
    assert "[dflash-ds] exit 255: pdsh lost its ssh session to a host (named above): it did not answer the " \
           "keep-alives (-o ServerAliveInterval=1 -o ServerAliveCountMax=13: its link is cut or it is gone) or ssh " \
           "failed." in r.stderr


def test_a_bad_heartbeat_fails_before_the_launcher_starts(tmp_path):
    r = _launch(tmp_path, "--train.heartbeat_timeout_s", "-1")
    assert r.returncode == 2
    assert "[dflash-ds] error: config: train.heartbeat_timeout_s = -1.0 must be > 0" in r.stderr
    assert not (tmp_path / "called").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "hostfile"]  # no env file, no credentials left
