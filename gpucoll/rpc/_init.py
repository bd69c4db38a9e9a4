"""Joining RPC: the store (rendezvous), this worker's listening port, the others' addresses."""

from __future__ import annotations

import json
import os
import socket
import urllib.parse
from typing import Any

from ..errors import DistError, DistStoreTimeoutError
from ..store import FileStore, PrefixStore, Store, TCPStore
from .._env import STORE_HOSTED_ENV, STORE_TOKEN_ENV
from .._rendezvous import rendezvous, tcp_store
from ._agent import Agent
from . import _local
from ._members import join_dynamic
from ._peers import build_agent, store_timeout
from ._faults import FaultSpec

__all__ = ["make_store", "start_agent", "listen"]

def _generation(store: Store, rank: int) -> str:
    """The prefix ``rpc/<n>`` of this init_rpc's keys, ``n`` this rank's count of its init_rpc calls on
    this store.

    Each init_rpc of a group gets keys of its own (torch's ``_init_counter``), and every rank
    of the group must agree on them. A count per process would not: a rank that also ran a
    group of its own on another store (``world_size=1``) would be one ahead of the others and
    wait for ever under a prefix nobody else writes. Counted in the store itself, per rank,
    the ``n``-th group a rank joins on a store is the ``n``-th of every other rank on it.
    """
    return f"rpc/{store.add(f'rpc-inits/{rank}', 1)}"


def make_store(options: Any, rank: int, world_size: int | None) -> tuple[Store, int, int | None]:
    """The job's store from ``options.init_method``, under the prefix ``rpc/<n>`` (see
    :func:`_generation`)."""
    timeout = store_timeout(options)
    url = urllib.parse.urlparse(options.init_method)
    if url.scheme == "file":
        # A FileStore opened without a world size: RPC's workers may share the file with a
        # process group of another size (torch's tests do), and RPC does not own its lifetime.
        if rank < 0:
            raise ValueError(f"rank parameter missing: init_method={options.init_method!r} (a file store) needs "
                             f"rank=; got rank={rank}")
        path = urllib.parse.unquote(url.path)
        if not path:
            raise ValueError(f"init_method must look like file:///path/to/file; got {options.init_method!r}")
        files = FileStore(path, None, timeout=timeout)
        return PrefixStore(_generation(files, rank), files), rank, world_size
    if world_size is not None and url.scheme == "env":
        # torch's env:// for RPC takes world_size as given: an RPC group may be larger than
        # the launcher's job (a worker started by hand), so the launcher's count is no check.
        if rank < 0:
            rank = int(os.environ.get("RANK", "-1") or -1)
        host, raw = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
        if rank < 0 or not host or not raw.isdigit():
            raise ValueError(f"init_method='env://' needs MASTER_ADDR, MASTER_PORT and RANK (or rank=); got "
                             f"MASTER_ADDR={host!r}, MASTER_PORT={raw!r}, rank={rank}")
        store = tcp_store(host, int(raw), rank, world_size, os.environ.get(STORE_HOSTED_ENV) == "1", timeout,
                           os.environ.get(STORE_TOKEN_ENV) or None)
    elif world_size is not None:
        store, rank, world_size = rendezvous(options.init_method, rank, world_size, timeout)
    else:
        if rank < 0 and url.scheme == "env":
            if not os.environ.get("RANK", "").isdigit():
                raise ValueError("environment variable RANK expected, but not set: a dynamic group "
                                 "(world_size=None) over env:// takes its rank from RANK, or pass rank=")
            rank = int(os.environ["RANK"])
        if rank < 0:
            raise ValueError("rank parameter missing: init_rpc(world_size=None) (a dynamic group) needs rank=")
        token = os.environ.get(STORE_TOKEN_ENV) or None
        if url.scheme == "env":
            host, port = os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT", "0") or 0)
        elif url.scheme == "tcp":
            host, port = url.hostname or "", url.port or 0
        else:
            raise ValueError(f"a dynamic group (world_size=None) needs init_method env://, tcp:// or file://; got "
                             f"{options.init_method!r}")
        if not host or not port:
            raise ValueError(f"a dynamic group needs the store's address: MASTER_ADDR and MASTER_PORT "
                             f"(or tcp://host:port); got {host!r}:{port!r}")
        hosted = os.environ.get(STORE_HOSTED_ENV) == "1"
        store = TCPStore(host, port, None, is_master=(rank == 0 and not hosted), timeout=timeout,
                         wait_for_workers=False, token=token)
    # Closing RPC closes its store connection (the server too, where this worker hosts it);
    # a FileStore stays: closing it may remove the file while another worker still reads it.
    owns = not isinstance(store, FileStore)
    return PrefixStore(_generation(store, rank), store, owns_store=owns), rank, world_size


def _addresses(options: Any) -> tuple[str, str]:
    """(address to bind, address to publish): loopback for a one-host job, else the route to the store."""
    url = urllib.parse.urlparse(options.init_method)
    host = os.environ.get("MASTER_ADDR", "") if url.scheme == "env" else (url.hostname or "")
    if url.scheme == "file" or not host:
        return "127.0.0.1", "127.0.0.1"
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        return "0.0.0.0", socket.gethostname()
    if ip.startswith("127."):
        return "127.0.0.1", "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((ip, 9))
        return "0.0.0.0", probe.getsockname()[0]
    finally:
        probe.close()


def listen(options: Any) -> tuple[socket.socket, str]:
    bind, public = _addresses(options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((bind, 0))
    sock.listen(1024)
    return sock, public


def _published(store: Store, name: str, rank: int, world_size: int, timeout: float) -> list[bytes]:
    """Every worker's record; after ``timeout`` an error naming the ranks that never published."""
    keys = [f"worker/{r}" for r in range(world_size)]
    try:
        return store.multi_get(keys, timeout=timeout)
    except DistStoreTimeoutError as e:
        missing = [r for r in range(world_size) if not store.check([keys[r]])]
        where = getattr(store, "prefix", "")
        raise DistStoreTimeoutError(
            f"init_rpc({name!r}, rank={rank}, world_size={world_size}) waited {timeout:g} s for the workers of "
            f"ranks {missing} to publish their addresses in the store (keys {where}/worker/<rank>); they never "
            f"joined this group") from e


def start_agent(store: Store, name: str, rank: int, world_size: int | None, options: Any,
                faults: FaultSpec | None = None) -> Agent:
    """Publish this worker, learn the others (all of them: a static group), start the agent.

    Raises:
        ValueError: a name or rank that another worker already has.
    """
    mine, theirs = ("group/dynamic", "group/static") if world_size is None else ("group/static", "group/dynamic")
    if store.check([theirs]):
        raise DistError("RPC group mixes statically and dynamically initialized members which is not supported. "
                        f"This worker ({name!r}) asked for a {mine[6:]} group; the group's workers are {theirs[6:]}")
    store.set(mine, b"1")
    listener, public = listen(options)
    local = _local.listen()  # same-host peers connect here (None: TCP only)
    unix = local[0] if local is not None else None
    try:
        published: dict[str, Any] = {"name": name, "host": public, "port": listener.getsockname()[1],
                                     "maps": getattr(options, "device_maps", {}) or {}}
        identity = _local.host_identity()
        if local is not None and identity is not None:
            published.update(unix=local[1], local=identity)
        record = json.dumps(published)
        if store.add(f"rank/{rank}", 1) != 1:
            raise ValueError(f"init_rpc(rank={rank}): another worker already joined with rank {rank}")
        store.set(f"worker/{rank}", record)
        if world_size is None:
            return join_dynamic(store, name, rank, record, listener, options, faults, unix)
        timeout = store_timeout(options)
        raw = _published(store, name, rank, world_size, timeout)
        records = {r: json.loads(v) for r, v in enumerate(raw)}
        return build_agent(store, rank, records, listener, options, faults, unix)
    except BaseException:
        listener.close()
        if unix is not None:
            unix.close()
        raise
