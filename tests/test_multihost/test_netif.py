"""Interface choice (dflash_ds/distributed/netif.py) on this one host, in process, through a real store: the
cases the two-host runs do not reach (tests/test_runtime/test_multihost_train.py runs the working ones)."""

from __future__ import annotations

import json
import os

import pytest
import torch.distributed as dist

from dflash_ds.distributed import netif
from dflash_ds.errors import DFlashError


@pytest.fixture
def clean_env(monkeypatch):
    for var in (netif.GLOO_VAR, netif.NCCL_VAR):  # set first: the undo then restores what was there, if anything
        monkeypatch.setenv(var, "x")
        monkeypatch.delenv(var)
    return monkeypatch


def peer(store, rank, host, master_ip, src):
    store.set(f"dflash/netif/{rank}", json.dumps({"host": host, "master_ip": master_ip, "src": src,
                                                  "loopback": src.startswith("127.")}))


def test_one_host_sets_nothing(clean_env):
    store = dist.HashStore()
    peer(store, 1, "same", "127.0.0.1", "127.0.0.1")
    assert netif.choose_socket_ifname(store, 0, 2, "127.0.0.1", cuda=False, timeout_s=5) is None
    assert netif.GLOO_VAR not in os.environ


def test_master_host_that_others_reach_at_a_foreign_address_fails_naming_the_variable(clean_env):
    """This host's name is loopback here, and the other host reaches the master at an address no interface
    here owns (a NAT, a wrong /etc/hosts): one error at once, not gloo's retries."""
    store = dist.HashStore()
    peer(store, 1, "h1", "198.19.7.7", "198.19.7.8")
    with pytest.raises(DFlashError) as err:
        netif.choose_socket_ifname(store, 0, 2, "localhost", cuda=True, timeout_s=5)
    msg = str(err.value)
    assert "GLOO_SOCKET_IFNAME is not set" in msg and "NCCL_SOCKET_IFNAME" in msg
    assert "127.0.0.1" in msg and "198.19.7.7" in msg and "h1" in msg


def test_the_users_setting_wins_and_a_missing_interface_is_named(clean_env):
    store = dist.HashStore()
    peer(store, 1, "h1", "198.19.7.7", "198.19.7.8")  # would fail if the choice were ours
    clean_env.setenv(netif.GLOO_VAR, "lo")
    assert netif.choose_socket_ifname(store, 0, 2, "localhost", cuda=False, timeout_s=5) == "lo"
    clean_env.setenv(netif.GLOO_VAR, "nosuch0")
    with pytest.raises(DFlashError, match="GLOO_SOCKET_IFNAME=nosuch0: .* has no interface 'nosuch0'"):
        netif.choose_socket_ifname(dist.HashStore(), 0, 1, "localhost", cuda=False, timeout_s=5)


def test_a_master_reached_by_an_own_address_takes_its_interface(clean_env):
    """As under the deepspeed launcher (master = `hostname -I`'s first word): the interface that owns it."""
    name, addrs = next((n, a) for n, a in netif.interface_addresses().items() if n != "lo" and a)
    ipv4 = [a for a in addrs if ":" not in a][0]
    assert netif.choose_socket_ifname(dist.HashStore(), 0, 1, ipv4, cuda=False, timeout_s=5) == name
    assert os.environ[netif.GLOO_VAR] == name


def _own_ipv4() -> tuple[str, str]:
    """An interface of this host off loopback and its IPv4 address."""
    return next((n, [x for x in a if ":" not in x][0]) for n, a in netif.interface_addresses().items()
                if n != "lo" and any(":" not in x for x in a))


def test_the_masters_own_host_takes_the_interface_the_others_reach_it_at(clean_env):
    """MASTER_ADDR a name that is loopback here (a plain torchrun's rank-0 host name on a stock Debian/Ubuntu host):
    the interface that owns the address the other host reaches the master at."""
    name, ipv4 = _own_ipv4()
    store = dist.HashStore()
    peer(store, 1, "h1", ipv4, "198.19.7.8")
    assert netif.choose_socket_ifname(store, 0, 2, "localhost", cuda=False, timeout_s=5) == name


def test_the_job_store_listens_on_its_hosts_own_address_alone():
    """The job's store on MASTER_ADDR's own address (`ss`), loopback given as such on loopback, every address only
    for a name that is loopback here; an address this host does not own is one error naming it."""
    import datetime
    import socket
    import subprocess

    from dflash_ds.distributed.store import job_store, listen_address

    _, ipv4 = _own_ipv4()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = job_store(ipv4, port - 1, 0, 1, datetime.timedelta(seconds=10), agent_store=False)
    listening = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout.split()
    assert listening[3] == f"{ipv4}:{port}", listening
    del store
    assert listen_address("127.0.0.1") == "127.0.0.1" and listen_address("localhost") == "127.0.0.1"
    with pytest.raises(DFlashError, match="MASTER_ADDR 198.19.7.7 resolves to 198.19.7.7 on .*owns no such address"):
        listen_address("198.19.7.7")
