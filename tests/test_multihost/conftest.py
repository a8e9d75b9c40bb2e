"""The `hosts` fixture: two hosts (network namespaces with their own address, hostname, /dev/shm and sshd).

Root, openssh-server and pdsh are needed (`.ci/run` installs the packages). Elsewhere these tests skip with
the reason; under `make test`, which sets DFLASH_REQUIRE_HOSTS=1, they fail instead (tests/hosts.py).
"""

from __future__ import annotations

import pytest

from hosts import two_hosts

hosts = pytest.fixture(two_hosts, name="hosts")
