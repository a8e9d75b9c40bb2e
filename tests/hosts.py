"""Several hosts on one machine, real to the software, for tests and benchmarks.

Each host is a network namespace with one veth link to a bridge that lives in a namespace of its own,
an address in 198.18.0.0/15 (the benchmarking range: never routed; no route anywhere else), its own
hostname (UTS namespace), its own tmpfs on /dev/shm (real hosts share no shared memory), and an sshd
on port 22 with a throw-away key. `/etc/netns/NS/hosts` (bind-mounted over /etc/hosts by `ip netns
exec`) makes a host's own name resolve to 127.0.1.1, as a stock Debian/Ubuntu /etc/hosts does, and the
other hosts' names to their addresses. The file system stays shared, as on a cluster with shared storage.

    with Hosts(2) as hosts:                      # h0, h1
        hosts.run("h0", ["hostname"])            # a command on h0 (nsenter into its namespaces)
        hosts.env()                              # PATH with an `ssh` that carries `-F <config>` first

`close()` (also on a failure, and for any harness a killed test left behind, see `reap_stale`) kills
every process in each namespace, deletes the namespaces and removes their /etc/netns files. A guard
process does the same as soon as the owning process dies, even by SIGKILL: no host outlives its test.
Root, iproute2, nftables, util-linux (unshare, nsenter), openssh-server and pdsh are needed: `unavailable()` says
which is missing.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NETNS_DIR = Path("/etc/netns")
PREFIX = "dfh"  # namespaces are named dfh<owner pid>-<host>: a dead owner's are stale
SUBNET = "198.18.0"  # host i gets 198.18.0.(i+1)/24
SSHD = "/usr/sbin/sshd"


def unavailable() -> str | None:
    """Why hosts cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "making hosts (network namespaces) needs root"
    for tool in ("ip", "tc", "nft", "unshare", "nsenter", "pdsh", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2 nftables util-linux pdsh openssh-client)"
    if not os.path.exists(SSHD):
        return f"{SSHD} is not installed (apt-get install openssh-server)"
    return None


def _sh(cmd: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _kill_netns(ns: str) -> None:
    """SIGKILL every process in namespace `ns` until none is left, then delete it and its /etc/netns files."""
    for _ in range(50):
        pids = [int(p) for p in _sh(["ip", "netns", "pids", ns], check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    _sh(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(NETNS_DIR / ns, ignore_errors=True)


def _owner_alive(ns: str) -> bool:
    try:
        pid = int(ns[len(PREFIX):].split("-", 1)[0])
    except ValueError:
        return True  # not ours
    return os.path.exists(f"/proc/{pid}")


def reap_stale() -> list[str]:
    """Remove the namespaces (and /etc/netns files) of harnesses whose owning process is gone."""
    names = [line.split()[0] for line in _sh(["ip", "netns", "list"], check=False).stdout.splitlines() if line]
    if NETNS_DIR.is_dir():
        names += [p.name for p in NETNS_DIR.iterdir()]
    stale = sorted({n for n in names if n.startswith(PREFIX) and not _owner_alive(n)})
    for ns in stale:
        _kill_netns(ns)
    return stale


class Hosts:
    """N hosts h0..h{N-1} on one bridge; a context manager that always cleans up."""

    def __init__(self, n: int = 2, names: list[str] | None = None):
        self.names = names or [f"h{i}" for i in range(n)]
        self.addr = {h: f"{SUBNET}.{i + 1}" for i, h in enumerate(self.names)}
        self.ifname = "eth0"  # every host's link, as on a cloud VM
        self.tag = f"{PREFIX}{os.getpid()}"
        self.netns = {h: f"{self.tag}-{h}" for h in self.names}
        self.bridge_ns = f"{self.tag}-br"
        self.dir = Path(tempfile.mkdtemp(prefix="dflash-hosts-"))
        self.sshd: dict[str, subprocess.Popen] = {}
        self.port: dict[str, str] = {}  # host -> its link's port on the bridge
        self.guard: subprocess.Popen | None = None

    # -- set-up ---------------------------------------------------------------------------------------------

    def __enter__(self) -> Hosts:
        reap_stale()
        # Started first: if this process is SIGKILLed while the hosts are made or used, the guard removes them.
        self.guard = subprocess.Popen([sys.executable, "-I", "-S", __file__, str(os.getpid())], start_new_session=True,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        ip = ["ip", "netns", "exec"]
        _sh(["ip", "netns", "add", self.bridge_ns])
        _sh([*ip, self.bridge_ns, "ip", "link", "add", "br0", "type", "bridge"])
        _sh([*ip, self.bridge_ns, "ip", "link", "set", "br0", "up"])
        self._keys()
        for i, h in enumerate(self.names):
            ns = self.netns[h]
            (NETNS_DIR / ns).mkdir(parents=True, exist_ok=True)
            lines = ["127.0.0.1 localhost", f"127.0.1.1 {h}"]  # stock Debian/Ubuntu: own name -> 127.0.1.1
            lines += [f"{self.addr[o]} {o}" for o in self.names if o != h]
            (NETNS_DIR / ns / "hosts").write_text("\n".join(lines) + "\n")
            _sh(["ip", "netns", "add", ns])
            port = f"{self.tag[-8:]}p{i}"[-15:]  # bridge-side name, unique per harness (15 chars at most)
            _sh(["ip", "link", "add", self.ifname, "netns", ns, "type", "veth", "peer", "name", port,
                 "netns", self.bridge_ns])
            _sh([*ip, self.bridge_ns, "ip", "link", "set", port, "master", "br0", "up"])
            _sh([*ip, ns, "ip", "addr", "add", f"{self.addr[h]}/24", "dev", self.ifname])
            _sh([*ip, ns, "ip", "link", "set", self.ifname, "up"])
            _sh([*ip, ns, "ip", "link", "set", "lo", "up"])
            self.port[h] = port
            self._start_sshd(h)
        for h in self.names:
            self._wait_ssh(h)

    def _keys(self) -> None:
        d = self.dir
        for name in ("client_key", "host_key"):
            _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)])
        (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
        # OpenSSH reads ~/.ssh of the passwd home, not $HOME: the client config travels in a wrapper instead.
        (d / "ssh_config").write_text(
            f"Host *\n  User root\n  IdentityFile {d / 'client_key'}\n  IdentitiesOnly yes\n"
            "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  ConnectTimeout 10\n"
            "  BatchMode yes\n")
        (d / "bin").mkdir()
        wrapper = d / "bin" / "ssh"
        wrapper.write_text(f"#!/bin/sh\nexec {shutil.which('ssh')} -F {d / 'ssh_config'} \"$@\"\n")
        wrapper.chmod(0o755)
        (d / "sshd_config").write_text(
            f"Port 22\nListenAddress 0.0.0.0\nHostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            f"StrictModes no\nUsePAM no\nPidFile none\nAcceptEnv LANG LC_*\nPrintMotd no\n")
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory

    def _start_sshd(self, h: str) -> None:
        # `ip netns exec` gives /etc/hosts from /etc/netns/NS; unshare then gives the host its own hostname and
        # its own /dev/shm (mount propagation private: the tmpfs stays inside). sshd -D holds the namespaces.
        script = (f"hostname {h} && mount -t tmpfs -o size=2g tmpfs /dev/shm && "
                  f"exec {SSHD} -D -e -f {self.dir / 'sshd_config'}")
        log = open(self.dir / f"sshd-{h}.log", "w")
        self.sshd[h] = subprocess.Popen(["ip", "netns", "exec", self.netns[h], "unshare", "--uts", "--mount",
                                         "--propagation", "private", "sh", "-c", script],
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def _wait_ssh(self, h: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            r = self.run(self.names[0], ["ssh", h, "hostname"], env=self.env())  # as a user on h0 would
            if r.returncode == 0 and r.stdout.strip() == h:
                return
            if time.monotonic() > deadline or self.sshd[h].poll() is not None:
                log = (self.dir / f"sshd-{h}.log").read_text()[-2000:]
                raise RuntimeError(f"sshd on {h} did not answer: {r.stderr.strip()}\nsshd log:\n{log}")
            time.sleep(0.2)

    # -- use ------------------------------------------------------------------------------------------------

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default os.environ) with the `ssh` wrapper first in PATH."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return env

    def enter(self, h: str) -> list[str]:
        """The command prefix that runs a program on host `h` (its network, hostname and mount namespaces)."""
        return ["nsenter", "--target", str(self.sshd[h].pid), "--net", "--uts", "--mount", "--"]

    def command(self, h: str, cmd: list[str], cwd: str | Path | None = None) -> list[str]:
        """`cmd` as run on host `h` in `cwd` (nsenter into the mount namespace starts in its root directory)."""
        return [*self.enter(h), "env", "-C", str(cwd or os.getcwd()), *cmd]

    def run(self, h: str, cmd: list[str], timeout: float = 30, cwd: str | Path | None = None,
            **kw) -> subprocess.CompletedProcess:
        """Run `cmd` on host `h` to completion (text output captured); a hang raises."""
        return subprocess.run(self.command(h, cmd, cwd), capture_output=True, text=True, timeout=timeout, **kw)

    def popen(self, h: str, cmd: list[str], cwd: str | Path | None = None, **kw) -> subprocess.Popen:
        """Start `cmd` on host `h` in a new session (close() kills it with the namespace)."""
        return subprocess.Popen(self.command(h, cmd, cwd), start_new_session=True, **kw)

    def listening(self, h: str) -> list[str]:
        """The local addresses (ADDR:PORT) of host h's listening TCP sockets, but its sshd's (port 22)."""
        r = self.run(h, ["ss", "-ltnH"])
        addrs = [line.split()[3] for line in r.stdout.splitlines() if line.strip()]
        return sorted(a for a in addrs if not a.endswith(":22"))

    def pids(self, h: str) -> list[int]:
        """Every process on host `h` (sshd included)."""
        return [int(p) for p in _sh(["ip", "netns", "pids", self.netns[h]], check=False).stdout.split()]

    def terminate_all(self) -> None:
        """SIGTERM to every process on every host but the hosts' sshd (listener and sessions), all at once: what a
        job's processes get from a cgroup-wide kill (systemd, scancel)."""
        pids = [pid for h in self.names for pid in self.pids(h)]
        for pid in pids:
            try:
                name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].rsplit(b"/", 1)[-1]
                if not name.startswith(b"sshd"):
                    os.kill(pid, signal.SIGTERM)
            except OSError:
                pass  # exited meanwhile

    def link(self, h: str, up: bool) -> None:
        """Cut (`up=False`) or restore host `h`'s link at its bridge port."""
        _sh(["ip", "netns", "exec", self.bridge_ns, "ip", "link", "set", self.port[h], "up" if up else "down"])

    def shape(self, h: str, *qdisc: str) -> None:
        """`tc qdisc replace dev eth0 root ARGS` on host `h`, e.g. shape("h1", "tbf", "rate", "200mbit", ...).
        This machine's kernel has tbf and htb but no netem (CONFIG_NET_SCH_NETEM unset): no fixed delay."""
        _sh(["ip", "netns", "exec", self.netns[h], "tc", "qdisc", "replace", "dev", self.ifname, "root", *qdisc])

    def lossy(self, h: str, percent: int) -> None:
        """Drop `percent`% of host `h`'s packets on its link, both ways, at random (nftables' numgen: tc's netem
        is not in this kernel)."""
        ns = ["ip", "netns", "exec", self.netns[h], "nft"]
        _sh([*ns, "add", "table", "inet", "dflash_loss"])
        for chain, hook, match in (("out", "output", "oifname"), ("in", "input", "iifname")):
            _sh([*ns, "add", "chain", "inet", "dflash_loss", chain, f"{{ type filter hook {hook} priority 0; }}"])
            _sh([*ns, "add", "rule", "inet", "dflash_loss", chain, match, self.ifname, "numgen", "random", "mod",
                 "100", "<", str(percent), "counter", "drop"])

    def dropped(self, h: str) -> int:
        """Packets `lossy` has dropped on host `h` so far."""
        out = _sh(["ip", "netns", "exec", self.netns[h], "nft", "list", "table", "inet", "dflash_loss"]).stdout
        return sum(int(w) for w in re.findall(r"counter packets (\d+)", out))

    # -- clean-up -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process on every host, delete the namespaces and their /etc/netns files."""
        for h in self.names:
            _kill_netns(self.netns[h])
        for p in self.sshd.values():
            with contextlib.suppress(Exception):
                p.wait(timeout=5)
        _kill_netns(self.bridge_ns)
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.guard is not None:
            self.guard.kill()
            self.guard.wait()
        with contextlib.suppress(OSError):
            if NETNS_DIR.is_dir() and not any(NETNS_DIR.iterdir()):
                NETNS_DIR.rmdir()  # we made it; leave /etc as it was

    def leftovers(self) -> list[str]:
        """What close() should have removed and did not (empty after a clean close)."""
        left = [ns for ns in [*self.netns.values(), self.bridge_ns]
                if ns in _sh(["ip", "netns", "list"], check=False).stdout.split()]
        left += [str(NETNS_DIR / ns) for ns in self.netns.values() if (NETNS_DIR / ns).exists()]
        return left


def hosts_or_skip(n: int = 2) -> Hosts:
    """A started `Hosts(n)` for a test, or skip naming why it cannot be made; under DFLASH_REQUIRE_HOSTS=1
    (`make test`) fail instead, as the serving tests do under DFLASH_REQUIRE_VLLM. The caller closes it."""
    import pytest

    why = unavailable()
    if why is None:
        try:
            return Hosts(n).__enter__()
        except Exception as exc:  # noqa: BLE001 - any failure to build the hosts is the reason
            why = f"cannot make hosts: {exc}"
    if os.environ.get("DFLASH_REQUIRE_HOSTS") == "1":
        pytest.fail(f"DFLASH_REQUIRE_HOSTS=1 but {why}")
    pytest.skip(f"several hosts: {why}")


def two_hosts():
    """The body of the `hosts` fixture (`hosts = pytest.fixture(two_hosts, name="hosts")` where it is used):
    h0 and h1, torn down (every process killed, namespaces and /etc/netns files removed) after the test."""
    made = hosts_or_skip(2)
    try:
        yield made
    finally:
        made.close()


def only_sshd_left(hosts: Hosts) -> dict[str, list[str]]:
    """Per host, the command lines of its processes other than its sshd (empty lists: nothing left running)."""
    left: dict[str, list[str]] = {}
    for h in hosts.names:
        cmds = []
        for pid in hosts.pids(h):
            if pid == hosts.sshd[h].pid:
                continue
            try:
                cmds.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
            except OSError:
                pass  # exited meanwhile
        left[h] = cmds
    return left


if __name__ == "__main__":  # the guard of Hosts: `python hosts.py OWNER_PID`, reaps the owner's hosts once it is gone
    owner = int(sys.argv[1])
    while os.getppid() == owner:
        time.sleep(0.5)
    reap_stale()
