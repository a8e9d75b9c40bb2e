"""Which network interface gloo (and NCCL's bootstrap) use between hosts, chosen when the user named none.

Without GLOO_SOCKET_IFNAME, gloo advertises the address this host's *name* resolves to. On a stock
Debian/Ubuntu host that is 127.0.1.1 (/etc/hosts), so ranks on other hosts are told to connect to their
own loopback and every rank fails in `init_process_group` after gloo's retries (measured on the hosts of
tests/hosts.py); NCCL's bootstrap picks its socket the same way (NCCL_SOCKET_IFNAME). Here every rank takes the interface that
carries its route to MASTER_ADDR, which the other hosts reach too:

- a rank whose route to the master leaves by a real interface (any rank when the launcher gives the
  master as an address, as the deepspeed launcher does) takes that interface;
- a rank on the master's own host, whose name resolves to loopback there (torchrun's c10d rendezvous
  gives the master as a host name), takes the interface that owns the address the *other* hosts reach
  the master at (they publish it in the job's store);
- when every rank reaches the master over loopback the job is on one host and nothing is set.

A variable the user set wins. Where no choice can work the job fails at once, naming the variable and the
addresses, instead of after gloo's retries.

The stores a job listens on (torchrun's, the job's) take one address the same way: `node_address` says which,
`listen_socket` binds it (PyTorch's own store server listens on every address).
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import json
import os
import socket
import struct
import sys
from pathlib import Path

from dflash_ds.errors import DFlashError

GLOO_VAR, NCCL_VAR = "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915


def interface_addresses() -> dict[str, list[str]]:
    """Interface name -> its addresses (IPv4 from the kernel's ioctl, IPv6 from /proc/net/if_inet6)."""
    out: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            out.setdefault(name, []).append(socket.inet_ntoa(raw[20:24]))
    inet6 = Path("/proc/net/if_inet6")
    if inet6.is_file():
        for line in inet6.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 6:
                out.setdefault(parts[5], []).append(str(ipaddress.IPv6Address(bytes.fromhex(parts[0]))))
    return out


def interface_of(address: str) -> str | None:
    """The local interface that owns `address`, or None."""
    want = ipaddress.ip_address(address)
    for name, addrs in interface_addresses().items():
        if any(ipaddress.ip_address(a) == want for a in addrs):
            return name
    return None


def resolve(host: str) -> str:
    """`host`'s address as this machine resolves it (the first answer, IPv4 preferred)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise DFlashError(f"MASTER_ADDR {host!r} does not resolve on {socket.gethostname()}: {exc}") from None
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    return infos[0][4][0]


def resolve_all(host: str) -> list[str]:
    """Every address `host` resolves to on this machine, IPv4 first; [] when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return []
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    return list(dict.fromkeys(str(i[4][0]) for i in infos))


def _loopback(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_loopback


def designates_this_host(host: str) -> bool:
    """`host` is this machine: its host name, or a name or address that resolves to one of its addresses."""
    if host in ("localhost", socket.gethostname()):
        return True
    return any(_loopback(a) or interface_of(a) is not None for a in resolve_all(host))


def node_address(host: str, peers: tuple[str, ...] = (), alone: bool = False) -> str:
    """The one address this host listens on for `host`, a name or address of this host: the address the other
    hosts reach it at.

    An address of its own, or a name that resolves to one, is that address; loopback given as such
    (`localhost`, 127.0.0.1) stays loopback. Any other name that resolves to loopback here (a stock
    Debian/Ubuntu host's own name: 127.0.1.1) is reached by the others at another address: the one this host's
    route to `peers` leaves from, else its only address off loopback; also loopback when the job is `alone`
    on this host. Anything else is one error naming `host`.
    """
    here = socket.gethostname()
    addrs = resolve_all(host)
    if not addrs:
        raise DFlashError(f"{host!r} does not resolve on {here}")
    own = [a for a in addrs if not _loopback(a) and interface_of(a) is not None]
    if own:
        return own[0]
    looped = [a for a in addrs if _loopback(a)]
    if not looped:
        raise DFlashError(f"{host} resolves to {', '.join(addrs)} on {here}, which is no address of this host: "
                          f"give {host}'s own address instead (RDZV_HOST, MASTER_ADDR, or the node's NodeAddr)")
    if alone or host == "localhost" or host in looped:
        return looped[0]
    for peer in peers:
        reached = resolve_all(peer)
        if reached and not _loopback(src := source_address(reached[0])):
            return src
    others = sorted({a for found in interface_addresses().values() for a in found
                     if not _loopback(a) and not ipaddress.ip_address(a).is_link_local})
    if len(others) == 1:
        return others[0]
    raise DFlashError(f"{host} resolves to loopback {looped[0]} on {here}, which the other hosts cannot reach, and "
                      f"this host has {'no other address' if not others else 'several: ' + ', '.join(others)}: "
                      f"give the address the other hosts reach {here} at instead of the name (RDZV_HOST)")


def route_address(host: str) -> str:
    """The local address this machine's route to `host` (a name or an address) leaves from."""
    addrs = resolve_all(host)
    if not addrs:
        raise DFlashError(f"{host!r} does not resolve on {socket.gethostname()}")
    return source_address(addrs[0])


def listen_socket(addr: str, port: int, backlog: int = 128) -> tuple[int, int]:
    """A TCP socket listening on `addr`:`port` (0: a free port) alone: (its descriptor, its port), for a
    TCPStore's `master_listen_fd` (PyTorch's own store server listens on every address). OSError if it cannot."""
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as PyTorch's own listener
        sock.bind((addr, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    port = sock.getsockname()[1]
    return sock.detach(), port  # the store owns the descriptor from here on: Python never closes it under it


def source_address(dest: str, port: int = 9) -> str:
    """The local address the kernel's routing picks for traffic to `dest` (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in dest else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((dest, port))
        except OSError as exc:
            raise DFlashError(f"no route from {socket.gethostname()} to MASTER_ADDR {dest}: {exc}") from None
        return s.getsockname()[0]


def _user_setting(var: str) -> str | None:
    value = os.environ.get(var, "").strip()
    if not value:
        return None
    # gloo takes a comma-separated list; NCCL also prefixes (^ exclude, = exact): check only plain names.
    for name in value.split(","):
        if name and name[0] not in "^=" and not Path("/sys/class/net", name).exists():
            raise DFlashError(f"{var}={value}: {socket.gethostname()} has no interface {name!r} "
                              f"(it has {', '.join(sorted(interface_addresses()))})")
    return value


def choose_socket_ifname(store, rank: int, world_size: int, master_addr: str, cuda: bool,
                         timeout_s: float, log: bool = True) -> str | None:
    """Set GLOO_SOCKET_IFNAME (and on CUDA NCCL_SOCKET_IFNAME) for this rank unless the user did; returns the
    interface used (None: one host, gloo's default). Every rank must call it: ranks publish their route in
    `store` so that the master's own host learns the address the others reach it at."""
    variables = [GLOO_VAR, NCCL_VAR] if cuda else [GLOO_VAR]
    user = {v: _user_setting(v) for v in variables}
    master_ip = resolve(master_addr)
    src = source_address(master_ip)
    loopback = ipaddress.ip_address(src).is_loopback
    me = {"host": socket.gethostname(), "master_ip": master_ip, "src": src, "loopback": loopback}
    store.set(f"dflash/netif/{rank}", json.dumps(me))
    keys = [f"dflash/netif/{r}" for r in range(world_size)]
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    peers = [json.loads(store.get(k)) for k in keys]
    if all(v is not None for v in user.values()):
        chosen, why = user[GLOO_VAR], "set by the user"
    elif not loopback:
        chosen, why = interface_of(src), f"routes to MASTER_ADDR {master_addr} = {master_ip}"
        if chosen is None:
            raise DFlashError(f"{GLOO_VAR} is not set and cannot be chosen on {me['host']}: the route to MASTER_ADDR "
                              f"{master_addr} = {master_ip} leaves from {src}, which no interface here owns; set "
                              f"{GLOO_VAR}")
    else:
        remote = sorted({p["master_ip"] for p in peers if not p["loopback"]})
        if not remote:
            return None  # every rank reaches the master over loopback: one host, gloo's default works
        owned = [(interface_of(a), a) for a in remote]
        owned = [(i, a) for i, a in owned if i is not None]
        if not owned:
            others = sorted({p["host"] for p in peers if not p["loopback"]})
            raise DFlashError(
                f"{GLOO_VAR} is not set and cannot be chosen on {me['host']} (rank {rank}): MASTER_ADDR "
                f"{master_addr} resolves to loopback {master_ip} here, while ranks on {', '.join(others)} reach it "
                f"at {', '.join(remote)}, which is no address of this host; set {GLOO_VAR} (on CUDA also "
                f"{NCCL_VAR}) to the interface the other hosts reach this one on, or MASTER_ADDR/RDZV_HOST to "
                "an address they share")
        chosen, why = owned[0][0], f"owns {owned[0][1]}, the address other hosts reach MASTER_ADDR {master_addr} at"
    for var in variables:
        if user[var] is None:
            os.environ[var] = chosen
    if log and os.environ.get("LOCAL_RANK", "0") == "0":  # once per host
        given = ", ".join(f"{v}={os.environ[v]}" + (" (the user's)" if user[v] else "") for v in variables)
        print(f"[dflash-ds] {me['host']}: {given}: {why}", flush=True)
    return chosen


def main(argv: list[str] | None = None) -> int:
    """`python -m dflash_ds.distributed.netif node-address HOST [--peer P ...]`: what train_slurm.sbatch binds."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dflash_ds.distributed.netif",
                                     description="Network helpers for the launch scripts.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("node-address", help="print the one address this host listens on for HOST, a name or an "
                                            "address of this host: the address the other hosts reach it at")
    p.add_argument("host", help="this host's name or address (SLURM's NodeAddr, RDZV_HOST)")
    p.add_argument("--peer", action="append", default=[],
                   help="another host of the job: where HOST resolves to loopback here (a stock Debian/Ubuntu "
                        "host's own name), the address this host's route to a peer leaves from")
    p.add_argument("--alone", action="store_true", help="the job has no other host: loopback will do")
    args = parser.parse_args(argv)
    try:
        print(node_address(args.host, tuple(args.peer), args.alone))
    except DFlashError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
