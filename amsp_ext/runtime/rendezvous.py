"""Where a job's stores listen: loopback on one machine, the given address across machines.

[Note: no server on every interface]
torchrun's c10d rendezvous store and the TCPStore that rank 0 hosts for ``init_process_group``
both listen on ``::`` (every interface) whatever host name they are given: two unauthenticated
key-value servers, open to the network for the whole run. A TCPStore can instead take a socket
that is already listening (``master_listen_fd``), so:

- a single-machine launcher (``amsp train``, ``amsp compare``, ``amsp tune``) hosts the
  rendezvous store itself on a socket bound to 127.0.0.1 (:class:`LoopbackRendezvous`) and runs
  torchrun as a client of it (``--rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT
  is_host=false``), with ``--local-addr=127.0.0.1`` so that the ranks' ``MASTER_ADDR`` is loopback
  and ``GLOO_SOCKET_IFNAME=lo`` so that gloo's pairs listen there too;
- every rank initialises through :func:`init_process_group`: rank 0 binds its store's socket to
  ``MASTER_ADDR`` itself (127.0.0.1 above; the node address ``amsp cluster run`` gives across
  machines), the others connect to it as clients.
"""

from __future__ import annotations

import datetime
import os
import socket
import uuid

import torch.distributed as dist

__all__ = ["LoopbackRendezvous", "LOOPBACK", "init_process_group"]

LOOPBACK = "127.0.0.1"


def _listening_fd(host: str, port: int) -> tuple[int, int]:
    """A socket listening on ``host:port`` (0: any free port), as (port, fd); the TCPStore it is
    handed to owns it (and closes it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(1024)
    return s.getsockname()[1], s.detach()


class LoopbackRendezvous:
    """``with LoopbackRendezvous() as rdzv: torchrun [*rdzv.torchrun_args, ...]`` with ``env``
    updated by ``rdzv.env``: the rendezvous store lives in this process, on 127.0.0.1 only."""

    def __init__(self, timeout_s: float = 900) -> None:
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._store = None

    def __enter__(self) -> "LoopbackRendezvous":
        self.port, fd = _listening_fd(LOOPBACK, 0)
        self._store = dist.TCPStore(LOOPBACK, self.port, None, True, self._timeout, wait_for_workers=False,
                                    multi_tenant=True, master_listen_fd=fd)
        return self

    def __exit__(self, *exc) -> None:
        self._store = None  # closes its socket

    @property
    def torchrun_args(self) -> list[str]:
        """In place of ``--standalone``."""
        return ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={LOOPBACK}:{self.port}",
                f"--rdzv-id={uuid.uuid4().hex}", "--rdzv-conf=is_host=false", f"--local-addr={LOOPBACK}"]

    @staticmethod
    def env(env: dict) -> dict:
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
    if not host or not port or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or \
            (rank == 0 and not _is_local(host)):
        dist.init_process_group(backend, timeout=timeout, **kw)
        return
    if rank == 0:
        _, fd = _listening_fd(socket.getaddrinfo(host, None)[0][4][0], int(port))
        store = dist.TCPStore(host, int(port), world, True, timeout, master_listen_fd=fd,
                              wait_for_workers=False)
    else:
        store = dist.TCPStore(host, int(port), world, False, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kw)
