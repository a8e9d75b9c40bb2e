"""A real SLURM cluster on the hosts of tests/hosts.py: `munged` and `slurmctld` on h0, a `slurmd` on every host.

Debian's packages (`apt-get install slurm-wlm munge`, SLURM 22.05), nothing of /etc: the munge key, its socket,
slurm.conf, the state and spool folders are written into a folder of the test's (the shared filesystem: the one
munge socket there serves every host, as a Unix socket on a shared path works across network namespaces). The
daemons run in the foreground inside the hosts' namespaces, so `Hosts.close()` kills them (and every job step)
with the hosts. Clients (`sbatch`, `squeue`, `scontrol`, `scancel`) run on h0 with `SLURM_CONF` set (`env()`).

    with Hosts(2) as hosts:
        slurm = SlurmCluster(hosts, tmp_path / "slurm").start()
        job = slurm.sbatch(["--nodes", "2", "script.sbatch"], env=...)
        slurm.wait_state(job, ("COMPLETED",), timeout=300)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from hosts import Hosts

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel")
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def unavailable() -> str | None:
    """Why a SLURM cluster cannot be made here (None when it can)."""
    for tool in DAEMONS:
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"`{tool}` is not installed (apt-get install slurm-wlm munge)"
    return None


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """A controller on the first host and a compute node per host of `hosts`; the daemons die with the hosts."""

    def __init__(self, hosts: Hosts, folder: Path, heartbeat_s: int = 5):
        self.hosts, self.dir = hosts, Path(folder)
        self.head = hosts.names[0]
        self.heartbeat_s = heartbeat_s  # SlurmdTimeout and the like: a node lost is seen within a few of them
        self.procs: dict[str, subprocess.Popen] = {}

    # -- set-up ---------------------------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> SlurmCluster:
        """Write the configuration, start munged, slurmctld and every slurmd; return once every node is idle."""
        d = self.dir
        for sub in ("state", "log", *(f"spool-{h}" for h in self.hosts.names)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        d.chmod(0o700)  # munged wants its key and socket in folders only its user can write
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.socket = d / "munge.socket"
        self.conf = d / "slurm.conf"
        self.conf.write_text(self._slurm_conf())
        # slurmd loads a cgroup plugin whatever the others; autodetect looks at /sys/fs/cgroup, which the hosts'
        # own sysfs (`ip netns exec` mounts one) does not have. v1's needs nothing until a plugin uses it: none does.
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        (d / "plugstack.conf").write_text("")
        self._spawn("munged", self.head, [_daemon("munged"), "--foreground", "--force", f"--socket={self.socket}",
                                          f"--key-file={key}", f"--pid-file={d / 'munged.pid'}",
                                          f"--log-file={d / 'log' / 'munged.log'}", f"--seed-file={d / 'munged.seed'}"])
        self._wait(lambda: self.socket.exists(), 20, "munged's socket")
        self._spawn("slurmctld", self.head, [_daemon("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for h in self.hosts.names:
            self._spawn(f"slurmd-{h}", h, [_daemon("slurmd"), "-D", "-f", str(self.conf)])
        self._wait(lambda: self.node_states() == {h: "idle" for h in self.hosts.names}, timeout, "idle nodes")
        return self

    def restart_slurmd(self, h: str, timeout: float = 60) -> None:
        """Start host `h`'s slurmd again (after a crash that took it) and return once the node is idle again
        (ReturnToService=2: a node that was down rejoins when its slurmd registers)."""
        self.procs[f"slurmd-{h}"].wait(timeout=10)
        self._spawn(f"slurmd-{h}", h, [_daemon("slurmd"), "-D", "-f", str(self.conf)])
        self._wait(lambda: self.node_states().get(h) == "idle", timeout, f"idle {h} after its slurmd restarted")

    def _slurm_conf(self) -> str:
        d, hb = self.dir, self.heartbeat_s
        # No NodeAddr: SLURM's default, the node's name (which a host resolves to 127.0.1.1 for itself, as on a stock
        # Debian/Ubuntu node: tests/hosts.py), where launch/train_slurm.sbatch must find the node's own address.
        nodes = "\n".join(f"NodeName={h} CPUs={os.cpu_count()} State=UNKNOWN" for h in self.hosts.names)
        # Ports: each host is a network namespace of its own, with nothing else listening: these are free there.
        # cred_expire: a requeued job waits that long before it starts again (120 s by default).
        return f"""ClusterName=dflash
SlurmctldHost={self.head}({self.hosts.addr[self.head]})
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
AuthInfo=socket={self.socket},cred_expire=5
CredType=cred/munge
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool-%n'}
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'slurmd-%n.pid'}
SlurmctldLogFile={d / 'log' / 'slurmctld.log'}
SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
PlugStackConfig={d / 'plugstack.conf'}
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout={2 * hb}
MessageTimeout={hb}
# SLURM's default: the tests' bounds after a scancel must hold without a shorter one
KillWait=30
InactiveLimit=0
SlurmdParameters=config_overrides
MinJobAge=300
JobRequeue=1
{nodes}
PartitionName=all Nodes={','.join(self.hosts.names)} Default=YES MaxTime=INFINITE State=UP
"""

    def _spawn(self, name: str, h: str, cmd: list[str]) -> None:
        log = open(self.dir / "log" / f"{name}.out", "w")
        self.procs[name] = self.hosts.popen(h, cmd, env=self.env(), stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def _wait(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"SLURM: no {what} after {timeout}s (exited: {dead})\n{self.logs()}")
            time.sleep(0.3)

    # -- use ------------------------------------------------------------------------------------------------

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default os.environ, with the hosts' ssh first in PATH) with SLURM_CONF set for the clients."""
        return {**self.hosts.env(base), "SLURM_CONF": str(self.conf)}

    def client(self, cmd: list[str], timeout: float = 30, env: dict[str, str] | None = None,
               cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        """A SLURM client command on the controller's host; raises on a hang, not on a failed status."""
        return self.hosts.run(self.head, cmd, timeout=timeout, env=env or self.env(), cwd=cwd)

    def sbatch(self, args: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None) -> str:
        """Submit a batch job from the controller's host; its id."""
        r = self.client(["sbatch", "--parsable", *args], env=env, cwd=cwd)
        if r.returncode != 0:
            raise RuntimeError(f"sbatch failed ({r.returncode}): {r.stderr.strip()}\n{self.logs()}")
        return r.stdout.strip().split(";")[0]

    def job(self, job: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, NodeList, ...)."""
        out = self.client(["scontrol", "-o", "show", "job", job]).stdout
        return dict(w.split("=", 1) for w in out.split() if "=" in w)

    def wait_state(self, job: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        """The job's record once its state is one of `states`; fails naming the last one after `timeout`."""
        deadline, info = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            info = self.job(job)
            if info.get("JobState") in states:
                return info
            time.sleep(0.3)
        raise AssertionError(f"job {job} not in {states} after {timeout}s: {info}\n{self.logs()}")

    def node_states(self) -> dict[str, str]:
        """Node -> its state as sinfo shows it (idle, alloc, down*, drain, ...)."""
        r = self.client(["sinfo", "-h", "-N", "-o", "%N %t"])
        return dict(line.split() for line in r.stdout.splitlines() if line.strip())

    def logs(self, tail: int = 2000) -> str:
        """The end of every daemon's log (for a failure's message)."""
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}"
                         for p in sorted((self.dir / "log").glob("*")) if p.is_file())


class SlurmJob:
    """A batch job seen as a launch (the chaos soak's third launcher): `send_signal` is SLURM's own signal to the
    job's steps (`scancel --signal`, as its time limit or a preemption sends it), `communicate` waits for the job to
    end and returns its log, `returncode` is the batch script's exit status (COMPLETED, FAILED) or the job's state
    where SLURM ended it (NODE_FAIL, CANCELLED, TIMEOUT)."""

    def __init__(self, cluster: SlurmCluster, job: str, log: Path) -> None:
        self.cluster, self.job, self.log = cluster, job, Path(log)
        self.returncode: int | str | None = None

    def send_signal(self, sig: int) -> None:
        r = self.cluster.client(["scancel", f"--signal={int(sig)}", self.job])
        if r.returncode != 0:
            raise RuntimeError(f"scancel --signal={int(sig)} {self.job}: {r.stderr.strip()}")

    def poll(self) -> int | str | None:
        info = self.cluster.job(self.job)
        if info.get("JobState") in DONE:
            code = int(info.get("ExitCode", "0:0").split(":")[0])
            self.returncode = code if info["JobState"] in ("COMPLETED", "FAILED") else info["JobState"]
        return self.returncode

    def communicate(self, timeout: float = 600) -> tuple[str, str]:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job} still {self.cluster.job(self.job).get('JobState')} after "
                                   f"{timeout}s")
            time.sleep(0.3)
        return (self.log.read_text(errors="replace") if self.log.exists() else ""), ""
