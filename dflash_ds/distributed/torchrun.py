"""torchrun whose agents listen on this node's own address only: `python -m dflash_ds.distributed.torchrun ARGS`.

torchrun's agents open two TCPStores: the c10d rendezvous store (on the agent that hosts the endpoint) and the
store they share with the ranks (on the rank-0 agent: the ranks' MASTER_ADDR:MASTER_PORT). PyTorch's store server
listens on every address whatever host it is given (2.13: `*:PORT`), so both were reachable on any interface of
the node. This is torchrun itself (`torch.distributed.run`, the same arguments) but for `--rdzv-backend c10d`
and `--standalone`, which take a c10d rendezvous whose stores are bound to one address before PyTorch gets them
(TCPStore's `master_listen_fd`):

- the rendezvous store to the node's own address for the endpoint (`netif.node_address`: a host name that
  resolves to loopback here, as a stock Debian/Ubuntu host's own name does, is the node's one address off
  loopback; where it has several, an error asks for the address);
- the agents' store to the node's `--local-addr`, set here when not given: that same address on the node that
  hosts the rendezvous, elsewhere the address this node's route to it leaves from. MASTER_ADDR is then an
  address on every node, and the job's store binds it too (`store.py`).

`--standalone` is a rendezvous on 127.0.0.1 (torchrun's own is on `localhost:0`, and on every address). Other
backends (static, etcd) are torchrun's own.
"""

from __future__ import annotations

import datetime
import errno
import socket
import sys
import uuid

from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT, C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config, parse_rendezvous_endpoint

from dflash_ds.distributed import netif
from dflash_ds.errors import DFlashError

BACKEND = "dflash-c10d"
AGENT_STORE_TIMEOUT = datetime.timedelta(seconds=300)  # torchrun's for the agents' store (TCPStore's default)


class _Backend(C10dRendezvousBackend):
    """torchrun's c10d backend under the name it is registered with (torchrun checks the two agree)."""

    @property
    def name(self) -> str:
        """See base class."""
        return BACKEND


def _store_server(addr: str, port: int, timeout: datetime.timedelta) -> TCPStore:
    """A TCPStore server (multi-tenant, as torchrun's) listening on `addr` alone."""
    fd, port = netif.listen_socket(addr, port)
    return TCPStore(addr, port, is_master=True, multi_tenant=True, timeout=timeout, master_listen_fd=fd)


def _hosts(host: str, is_host: bool | None) -> bool:
    """Whether this node hosts the rendezvous store: `is_host` from --rdzv-conf, else whether `host` is this one."""
    return netif.designates_this_host(host) if is_host is None else is_host


def create_bound_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torchrun's c10d rendezvous handler (`registry._create_c10d_handler`), its two stores bound to one address."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    alone = params.max_nodes == 1
    timeout = datetime.timedelta(seconds=params.get_as_int("read_timeout", 60))
    is_host = params.get_as_bool("is_host")
    here = netif.designates_this_host(host)
    store = None
    if _hosts(host, is_host):
        addr = netif.node_address(host, alone=alone)
        try:
            store = _store_server(addr, port, timeout)
            print(f"[dflash-ds] {socket.gethostname()}: rendezvous store on {addr}:{store.port}", flush=True)
        except OSError as exc:
            # As torchrun: an agent that only guessed it hosts the store finds it open (another agent of this
            # machine hosts it) and joins it as a client.
            if is_host is not None or exc.errno != errno.EADDRINUSE:
                raise DFlashError(f"the rendezvous store cannot listen on {addr}:{port} ({exc.strerror}): "
                                  "RDZV_PORT must be free") from None
    if store is None:
        # This machine's own endpoint is reached where it is bound, not where its name resolves to here.
        store = TCPStore(netif.node_address(host, alone=alone) if here else host, port, is_master=False,
                         multi_tenant=True, timeout=timeout)
    handler = create_handler(store, _Backend(store, params.run_id), params)
    # The rank-0 agent's store for the ranks, on its node address (--local-addr; see `local_address`). A private
    # method of torchrun's handler: a PyTorch that renamed it would listen on every address again, which the
    # launch tests' `ss` checks would see.
    handler._create_tcp_store_server = lambda master_addr, master_port: _store_server(
        netif.node_address(master_addr, alone=alone), master_port, AGENT_STORE_TIMEOUT)
    return handler


def local_address(endpoint: str, is_host: bool | None, alone: bool) -> str:
    """This node's address (torchrun's --local-addr, the ranks' MASTER_ADDR when it gets rank 0): the address it
    binds the rendezvous store to where it hosts it, else the address its route to that host leaves from."""
    host, _ = parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORT)
    return netif.node_address(host, alone=alone) if _hosts(host, is_host) else netif.route_address(host)


def bound_args(argv: list[str] | None):
    """torchrun's parsed ARGV, a c10d rendezvous (or --standalone) turned into the bound one, with --local-addr."""
    from torch.distributed.run import parse_args, parse_min_max_nnodes

    args = parse_args(argv)
    if args.standalone:  # torchrun's single-node rendezvous, on loopback
        args.standalone = False
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "127.0.0.1:0", str(uuid.uuid4())
    if args.rdzv_backend == "c10d":
        registry.register(BACKEND, create_bound_handler)  # the same creator again is a no-op
        args.rdzv_backend = BACKEND
        if not args.local_addr:
            conf = _parse_rendezvous_config(args.rdzv_conf)
            is_host = RendezvousParameters(BACKEND, args.rdzv_endpoint, args.rdzv_id, 1, 1, **conf).get_as_bool(
                "is_host")
            alone = parse_min_max_nnodes(args.nnodes)[1] == 1
            args.local_addr = local_address(args.rdzv_endpoint, is_host, alone)
    return args


@record
def _run(args) -> None:
    from torch.distributed.run import run

    run(args)


def main(argv: list[str] | None = None) -> int:
    """torchrun with ARGV; a c10d rendezvous (or --standalone) with its stores bound to this node's address."""
    try:
        args = bound_args(argv)
    except DFlashError as exc:
        print(f"[dflash-ds] error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    _run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
