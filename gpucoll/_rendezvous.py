"""Rendezvous: from ``init_method`` (env://, tcp://, file://) to the job's store, rank and size.

Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) every rank joins the agent's
store, and each restart attempt gets its own namespace of it.
"""

from __future__ import annotations

import os
import urllib.parse
import warnings
from datetime import timedelta
from typing import Any, Iterator

from ._env import STORE_TOKEN_ENV
from .store import FileStore, PrefixStore, Store, TCPStore
from .store._client import is_local_host
from .store._relay import relay_address, relay_client

__all__ = ["rendezvous", "rendezvous_iterator", "tcp_store"]


def rendezvous_iterator(url: str, rank: int = -1, world_size: int = -1,
                        **kwargs: Any) -> Iterator[tuple[Store, int, int]]:
    """torch.distributed.rendezvous: a generator of one ``(store, rank, world_size)``.

    Args:
        url: ``env://``, ``tcp://host:port`` or ``file:///path``, as ``init_process_group``'s
            ``init_method``.
        rank, world_size: this process's rank and the job's size (-1: from the
            environment, for ``env://``).
        **kwargs: ``timeout`` (seconds or ``timedelta``; default 300) for joining the store.

    Yields:
        The job's store, the rank and the world size, once. As torch's, a second ``next()``
        raises ``RuntimeError`` (there is no re-rendezvous).

    Raises:
        ValueError: an unknown URL scheme, or tcp:// / file:// without rank and world_size.
        TypeError: ``url`` is not a str, or an unknown keyword argument.

    Example::

        store, rank, world_size = next(gpucoll.rendezvous("tcp://127.0.0.1:29500", rank=0, world_size=1))
    """
    from ._timeouts import to_seconds

    timeout = kwargs.pop("timeout", None)
    if kwargs:
        raise TypeError(f"rendezvous() got unexpected keyword arguments {sorted(kwargs)} (it takes timeout)")
    seconds = to_seconds(timeout if not isinstance(timeout, timedelta) else timeout.total_seconds(), name="timeout")
    yield rendezvous(url, rank, world_size, seconds)
    raise RuntimeError(f"Unable to perform re-rendezvous using {urllib.parse.urlparse(url).scheme}:// method")


def rendezvous(init_method: str, rank: int, world_size: int, timeout: float) -> tuple[Store, int, int]:
    if not isinstance(init_method, str):
        raise TypeError(f"init_method must be a str URL; got {type(init_method).__name__}")
    url = urllib.parse.urlparse(init_method)
    token = os.environ.get(STORE_TOKEN_ENV) or None
    if url.scheme == "env":
        if init_method.strip().lower() != "env://":
            raise ValueError(f"init_method={init_method!r} is not a rendezvous URL; did you mean 'env://' "
                             "(RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment)?")
        return _env_rendezvous(rank, world_size, timeout, token)
    if url.scheme == "tcp":
        if world_size < 1 or rank < 0:
            raise ValueError(f"init_method={init_method!r} needs rank and world_size; got rank={rank}, "
                             f"world_size={world_size}")
        host, port = url.hostname, url.port
        if not host or port is None:
            raise ValueError(f"init_method must look like tcp://host:port; got {init_method!r}")
        return tcp_store(host, port, rank, world_size, False, timeout, token), rank, world_size
    if url.scheme == "file":
        if world_size < 1 or rank < 0:
            raise ValueError(f"init_method={init_method!r} needs rank and world_size; got rank={rank}, "
                             f"world_size={world_size}")
        path = urllib.parse.unquote(url.path)
        if not path:
            raise ValueError(f"init_method must look like file:///path/to/file; got {init_method!r}")
        return FileStore(path, world_size, timeout=timeout), rank, world_size
    raise ValueError(f"init_method must start with env://, tcp:// or file://; got {init_method!r}")


def _env_rendezvous(rank: int, world_size: int, timeout: float, token: str | None) -> tuple[Store, int, int]:
    try:
        from .clusters import detect
    except ImportError:  # pragma: no cover - the package always ships clusters
        detect = None  # type: ignore[assignment]
    env = detect() if detect is not None else None
    hosted = False
    if env is not None:
        if world_size >= 1 and world_size != env.world_size:
            # The launcher started env.world_size processes: waiting for world_size of them
            # could only end in the store's timeout, minutes later.
            raise ValueError(f"init_process_group(world_size={world_size}) contradicts the launcher "
                             f"({env.source}), which started world_size={env.world_size} processes; "
                             f"pass world_size={env.world_size}, or leave world_size out to take the "
                             "launcher's")
        rank = env.rank if rank < 0 else rank
        world_size = env.world_size if world_size < 1 else world_size
        addr, port, hosted = env.master_addr, env.master_port, env.store_hosted
    else:
        addr = os.environ.get("MASTER_ADDR", "")
        raw_port = os.environ.get("MASTER_PORT", "")
        missing = [n for n, v in (("MASTER_ADDR", addr), ("MASTER_PORT", raw_port)) if not v]
        if rank < 0:
            missing.append("RANK")
        if world_size < 1:
            missing.append("WORLD_SIZE")
        if missing:
            raise ValueError(_env_missing_message(missing, world_size))
        try:
            port = int(raw_port)
        except ValueError:
            raise ValueError(f"MASTER_PORT must be an integer; got {raw_port!r}") from None
    store = tcp_store(addr, port, rank, world_size, hosted, timeout, token)
    # -- torchrun (begin) ----------------------------------------------------------------
    # torchrun's agent store outlives a restart of its workers: each attempt gets its own
    # namespace so that restarted workers never read the previous attempt's keys.
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "").strip()
    if hosted and restart and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = PrefixStore(f"gpucoll/attempt{restart}", store, owns_store=True)
    # -- torchrun (end) ------------------------------------------------------------------
    return store, rank, world_size


def _env_missing_message(missing: list[str], world_size: int) -> str:
    """What env:// lacks, and only the remedies that apply to what was passed."""
    text = f"init_method='env://' needs {', '.join(missing)} in the environment"
    passable = [m for m in missing if m in ("RANK", "WORLD_SIZE")]
    if passable:
        text += " (or pass " + " and ".join(f"{m.lower()}=" for m in passable) + ")"
    text += "; launchers set them all: gpucoll-run, torchrun, srun, mpirun"
    if world_size == 1:
        text += ("; a single process needs no environment with init_method='tcp://127.0.0.1:0', "
                 "rank=0, world_size=1")
    return text


_warned_no_token = False


def _warn_if_open(host: str, port: int, world_size: int, token: str | None) -> None:
    """Once per process, loudly: a job across hosts whose store has no token (see
    docs/security.md)."""
    global _warned_no_token
    if token is not None or _warned_no_token or world_size < 2:
        return
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "") or world_size)
    except ValueError:
        local = world_size
    if local >= world_size and is_local_host(host):
        return  # one host
    _warned_no_token = True
    warnings.warn(
        f"gpucoll: this job spans several hosts and its store ({host}:{port}) has no token: any "
        f"process that can reach that port can read and overwrite the job's keys (transport "
        f"addresses, object-collective payloads) and pose as a rank. Set the same secret on every "
        f"rank before launching, e.g. export GPUCOLL_STORE_TOKEN=$(python -c \"import secrets; "
        f"print(secrets.token_hex(16))\") (gpucoll-run sets one itself). See docs/security.md",
        RuntimeWarning, stacklevel=4)


def tcp_store(host: str, port: int, rank: int, world_size: int, hosted: bool, timeout: float,
              token: str | None) -> Store:
    """The job's TCPStore at ``host:port``: served here by rank 0 unless ``hosted`` (a
    launcher serves it; through this node's relay where there is one), joined otherwise.
    RPC's env:// uses it too, with the RPC group's own world size."""
    _warn_if_open(host, port, world_size, token)
    if hosted:
        relay = relay_address()
        if relay is not None:  # this node's store relay (gpucoll-run --store-relay)
            return relay_client(relay, f"{host}:{port}", world_size, timeout=timeout, token=token)
        return TCPStore(host, port, world_size, is_master=False, timeout=timeout, token=token)
    if port == 0 and world_size > 1:
        raise ValueError("MASTER_PORT=0 needs a launcher that hosts the store (GPUCOLL_STORE_HOSTED=1): with "
                         "rank 0 as the server, the other ranks cannot learn the port it picks. Set a port")
    # wait_for_workers=False: await_all_joined counts the ranks on every rank, not on rank 0 only.
    return TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout, token=token,
                    wait_for_workers=False)
