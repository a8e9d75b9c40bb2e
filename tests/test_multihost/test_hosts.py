"""The host harness itself (tests/hosts.py): what makes two namespaces real hosts, and that nothing outlives it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hosts import NETNS_DIR, only_sshd_left


def test_two_hosts_are_real_to_the_software_and_leave_nothing(hosts):
    """Own hostname, own name -> 127.0.1.1, the other's name -> its address, own /dev/shm, no route off the
    bridge, ssh and pdsh between them; a host's own address for its name; a clean close."""
    for h, other in (("h0", "h1"), ("h1", "h0")):
        r = hosts.run(h, ["sh", "-c", f"hostname; getent hosts {h} {other}; ip route; "
                                      f"echo {h} > /dev/shm/dflash-owner; cat /dev/shm/dflash-owner"])
        lines = r.stdout.split("\n")
        assert lines[0] == h and lines[1].split() == ["127.0.1.1", h], r.stdout
        assert lines[2].split() == [hosts.addr[other], other], r.stdout
        assert lines[3].startswith("198.18.0.0/24 dev eth0") and len([x for x in lines[3:-2] if x]) == 1, r.stdout
    assert hosts.run("h1", ["cat", "/dev/shm/dflash-owner"]).stdout == "h1\n"  # each host its own tmpfs
    assert not Path("/dev/shm/dflash-owner").exists()
    # Off the bridge there is nowhere to go (198.51.100.1: a documentation address, unroutable here).
    r = hosts.run("h0", [sys.executable, "-c", "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                                               "try: s.connect(('198.51.100.1', 9)); print('routed')\n"
                                               "except OSError as e: print(e.errno)"])
    assert r.stdout.strip() == "101", r.stdout + r.stderr  # ENETUNREACH
    r = hosts.run("h0", ["pdsh", "-R", "ssh", "-w", "h0,h1", "hostname -I"], env=hosts.env())
    assert sorted(r.stdout.split()) == ["198.18.0.1", "198.18.0.2", "h0:", "h1:"], r.stdout + r.stderr
    # A host's own address for its name or address (what its stores bind): h0's name is 127.0.1.1 there, so its one
    # address off loopback; on another host the name is one error naming it.
    node_address = [sys.executable, "-m", "dflash_ds.distributed.netif", "node-address"]
    for given, want in (("h0", "198.18.0.1"), ("198.18.0.1", "198.18.0.1"), ("localhost", "127.0.0.1")):
        assert hosts.run("h0", [*node_address, given]).stdout.split() == [want], given
    assert hosts.run("h0", [*node_address, "h0", "--alone"]).stdout.split() == ["127.0.1.1"]
    r = hosts.run("h1", [*node_address, "h0"])
    assert r.returncode == 2 and "h0 resolves to 198.18.0.1 on h1, which is no address of this host" in r.stderr
    sleeper = hosts.popen("h1", ["sleep", "600"])
    assert only_sshd_left(hosts)["h1"] == ["sleep 600 "]
    pids = [p for h in hosts.names for p in hosts.pids(h)]
    hosts.close()
    assert sleeper.wait(timeout=10) != 0
    assert hosts.leftovers() == [] and not any(os.path.exists(f"/proc/{p}") for p in pids)
    assert not any(p.name.startswith(hosts.tag) for p in NETNS_DIR.glob("*"))
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert hosts.tag not in listed


def test_hosts_go_with_a_test_process_that_is_sigkilled():
    """A harness whose owner is SIGKILLed (a CI time limit kills pytest) is removed by its guard at once, what
    runs on its hosts included: not only by the next harness's reap_stale."""
    import signal
    import time

    import pytest

    from hosts import unavailable

    why = unavailable()
    if why:  # the `hosts` fixture's rule: fail under make test (DFLASH_REQUIRE_HOSTS=1), skip elsewhere
        (pytest.fail if os.environ.get("DFLASH_REQUIRE_HOSTS") == "1" else pytest.skip)(f"several hosts: {why}")
    code = ("import sys, time\nfrom hosts import Hosts\nh = Hosts(1).__enter__()\n"
            "p = h.popen('h0', ['sleep', '600'])\nprint(h.tag, p.pid, flush=True)\ntime.sleep(600)\n")
    tests = Path(__file__).resolve().parents[1]
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(tests)})
    try:
        tag, sleeper = owner.stdout.readline().split()
        assert tag in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 15
        while (os.path.exists(f"/proc/{sleeper}") or tag in subprocess.run(
                ["ip", "netns", "list"], capture_output=True, text=True).stdout) and time.monotonic() < deadline:
            time.sleep(0.2)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert tag not in listed and not os.path.exists(f"/proc/{sleeper}")
        assert not any(p.name.startswith(tag) for p in NETNS_DIR.glob("*"))
    finally:
        owner.kill()
