"""Where a job's stores listen: loopback on one machine, the given address across machines.

[Note: no server on every interface]
torchrun's c10d rendezvous store and the TCPStore that rank 0 hosts for ``init_process_group``
both listen on ``::`` (every interface) whatever host name they are given: two unauthenticated
key-value servers, open to the network for the whole run. A TCPStore can instead take a socket
that is already listening (``master_listen_fd``), so:

- every launcher runs torchrun with the ``amsp-static`` rendezvous (below): node 0's agent
  hosts the store on a socket bound to the master address, 127.0.0.1 for a single-machine job
  (``amsp train``, ``amsp compare``, ``amsp tune``: :func:`loopback_torchrun_args`, with
  ``GLOO_SOCKET_IFNAME=lo`` so that gloo's pairs listen there too), the node address that
  ``amsp cluster run`` gives across machines;
- every rank initialises through :func:`init_process_group`: rank 0 binds its store's socket to
  ``MASTER_ADDR`` itself (127.0.0.1 above; the node address ``amsp cluster run`` gives across
  machines), the others connect to it as clients.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

__all__ = ["BOUND_BACKEND", "LOOPBACK", "bound_static_handler", "bound_torchrun_args", "init_process_group",
           "loopback_env", "loopback_torchrun_args", "main", "register"]

LOOPBACK = "127.0.0.1"
_JOIN_TIMEOUT_S = 900  # torchrun's own default rendezvous join timeout, when the config names none


def _listening_fd(host: str, port: int) -> tuple[int, int]:
    """A socket listening on ``host:port`` (0: any free port), as (port, fd); the TCPStore it is
    handed to owns it (and closes it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(1024)
    return s.getsockname()[1], s.detach()


def loopback_torchrun_args() -> list[str]:
    """torchrun's static flags, in place of ``--standalone``, for a job on this machine alone:
    node 0 of 1, its store on 127.0.0.1 at a free port. Run them through :func:`main` (the
    ``amsp-static`` rendezvous), which binds that store to the address and nothing else."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        port = s.getsockname()[1]
    return ["--nnodes=1", "--node-rank=0", f"--master-addr={LOOPBACK}", f"--master-port={port}"]


def loopback_env(env: dict) -> dict:
    """``env`` with gloo's pairs listening on loopback too."""
    return {**env, "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME") or "lo"}


def _is_local(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    for family, *_, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def init_process_group(backend: str, *, timeout: datetime.timedelta, **kw) -> None:
    """``dist.init_process_group`` from torchrun's environment, rank 0's store listening on
    ``MASTER_ADDR`` only (see [Note: no server on every interface]). Without ``MASTER_ADDR``
    (or when that address is not this machine's), torch's own ``env://`` initialisation."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if host and port and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # the agent's store outlives an elastic restart: each attempt's keys under their own
        # prefix (see [Note: no pickle in a launch])
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"/amsp/attempt_{attempt}", dist.TCPStore(host, int(port), world, False, timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kw)
        return
    if not host or not port or (rank == 0 and not _is_local(host)):
        dist.init_process_group(backend, timeout=timeout, **kw)
        return
    if rank == 0:
        _, fd = _listening_fd(socket.getaddrinfo(host, None)[0][4][0], int(port))
        store = dist.TCPStore(host, int(port), world, True, timeout, master_listen_fd=fd,
                              wait_for_workers=False)
    else:
        store = dist.TCPStore(host, int(port), world, False, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kw)


# [Note: a static rendezvous bound to the master address]
# Across machines torchrun's static rendezvous (``--node-rank i --master-addr A --master-port P``:
# global rank = i * R + local rank, the order topology/groups.py assumes) makes node 0's agent host
# a TCPStore that every agent and, through ``TORCHELASTIC_USE_AGENT_STORE``, every rank uses; torch
# creates it listening on every interface. ``python -m amsp_ext.tools.rendezvous`` is torchrun
# with one change: the same static rendezvous under the backend name ``amsp-static``, whose node 0
# store listens on ``A`` only (a socket bound to it, handed over as ``master_listen_fd``). The
# ranks' gloo pairs follow ``GLOO_SOCKET_IFNAME`` (the lab's interface for ``amsp cluster run``).
#
# [Note: no pickle in a launch]
# torchrun's c10d (dynamic) rendezvous keeps its state as a pickle in its store
# (its state holder's ``sync`` in ``dynamic_rendezvous.py`` ``pickle.loads`` what the agents
# wrote), so any process that can reach the store could make an agent run code. The static
# rendezvous only counts nodes and hands out the store: every launcher of this project uses it
# (``amsp-static``), on one machine as node 0 of 1, so no launch unpickles anything; the ranks and
# checkpoints exchange no pickles either (state/dcp_io.py: [Note: DCP without its object
# collectives]). An elastic restart re-uses the agent's store, so :func:`init_process_group`
# puts each attempt's keys under their own prefix: the new ranks never read the dead ranks'
# gloo addresses.
BOUND_BACKEND = "amsp-static"


def _numeric(host: str) -> str:
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


def bound_static_handler(params):
    """torchrun's handler factory for ``amsp-static`` (``rank`` in the rendezvous config)."""
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint.strip(), -1)
    if port == -1:
        raise ValueError(f"amsp-static rendezvous: no port in endpoint {params.endpoint!r}")
    rank, world = int(params.config["rank"]), int(params.max_nodes)
    timeout = datetime.timedelta(seconds=int(params.config.get("timeout", _JOIN_TIMEOUT_S)))
    run_id = params.run_id

    class BoundStatic(RendezvousHandler):
        def __init__(self) -> None:
            self.store = None

        def get_backend(self) -> str:
            return BOUND_BACKEND

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self):
            if self.store is None:
                if rank == 0:
                    _, fd = _listening_fd(_numeric(host), port)
                    self.store = TCPStore(host, port, world, True, timeout, multi_tenant=True,
                                          master_listen_fd=fd)
                else:
                    self.store = TCPStore(host, port, world, False, timeout, multi_tenant=True)
            return RendezvousInfo(PrefixStore(run_id, self.store), rank, world, RendezvousStoreInfo(host, port))

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return run_id

        def shutdown(self) -> bool:
            self.store = None
            return True

    return BoundStatic()


def bound_torchrun_args(argv: list[str]) -> list[str]:
    """torchrun's static flags (``--node-rank=i --master-addr=A --master-port=P``) as the
    ``amsp-static`` rendezvous; every other argument as given."""
    opts: dict[str, str] = {}
    rest: list[str] = []
    for i, a in enumerate(argv):
        key = a.split("=", 1)[0].replace("_", "-")
        if key in ("--node-rank", "--master-addr", "--master-port") and "=" in a:
            opts[key] = a.split("=", 1)[1]
        elif a in ("-m", "--no-python") or not a.startswith("-"):
            rest += argv[i:]  # the program and its own arguments
            break
        else:
            rest.append(a)
    missing = [k for k in ("--node-rank", "--master-addr", "--master-port") if k not in opts]
    if missing:
        raise ValueError(f"amsp_ext.tools.rendezvous: needs {', '.join(m + '=...' for m in missing)}")
    return [f"--rdzv-backend={BOUND_BACKEND}", f"--rdzv-endpoint={opts['--master-addr']}:{opts['--master-port']}",
            f"--rdzv-conf=rank={opts['--node-rank']}", *rest]


def register() -> None:
    """Make ``--rdzv-backend=amsp-static`` known to torchrun in this process."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BOUND_BACKEND, bound_static_handler)  # again: a no-op


def main(argv: list[str] | None = None) -> None:
    import sys

    from torch.distributed.run import main as torchrun

    register()
    torchrun(bound_torchrun_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
