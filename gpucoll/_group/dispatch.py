"""Which backend runs a group's arrays: the CPU one for host memory, the device one
(made on first use, or bound at creation) for CUDA memory. Functions over a
:class:`ProcessGroup`'s state (its ``_cpu``, ``_nccl``, ``_device_id``: :class:`GroupBackends`),
called on every op."""

from __future__ import annotations

from typing import Protocol, Sequence

from .._backends.base import Backend, ReducesInto
from .._buffer import Buffer
from ..store import Store
from .core import Issuer, time_ops
from .options import PGOptions
from .registry import make_device_backend, split_device_backend

__all__ = ["GroupBackends", "backend_for", "backend_for_all", "make_device_backend_for", "set_device_backend",
           "split_device_backend_of"]


class GroupBackends(Protocol):
    """The state of a group these functions read and write (``group.ProcessGroup``'s,
    whose module imports this one)."""

    backend_name: str
    group_name: str
    timeout: float
    pg_options: PGOptions | None
    _store: Store
    _rank: int
    _size: int
    _cpu: Backend
    _nccl: Backend | None
    _nccl_into: ReducesInto | None
    _device_id: int | None
    _bound: bool  # bound to a device at creation
    _issuer: Issuer


def backend_for(pg: GroupBackends, buf: Buffer, name: str) -> Backend:
    """The backend that runs ``buf`` in ``pg``: the CPU one for host memory (and "fake"
    groups), else the device one, made on first use on ``buf``'s device."""
    if buf.device.type == "cpu" or pg.backend_name == "fake":
        return pg._cpu
    nccl = pg._nccl
    if nccl is None:
        if pg.backend_name != "nccl":
            raise TypeError(
                f"{name} is a device array ({buf.device}) but group {pg.group_name!r} uses the cpu "
                "backend, which moves host arrays only; use init_process_group('nccl') or "
                "new_group(backend='nccl') for device arrays")
        nccl = set_device_backend(pg, make_device_backend_for(pg, buf.device.index))
    elif buf.device.index != pg._device_id:
        raise ValueError(f"{name} is on {buf.device} but group {pg.group_name!r} communicates "
                         f"on cuda:{pg._device_id}")
    return nccl


def make_device_backend_for(pg: GroupBackends, device_id: int) -> Backend:
    """A new device backend for ``pg`` on ``device_id`` (which the group remembers)."""
    pg._device_id = device_id
    return make_device_backend(pg._store, pg._rank, pg._size, timeout=pg.timeout,
                               group_name=pg.group_name, device_id=device_id, pg_options=pg.pg_options)


def set_device_backend(pg: GroupBackends, backend: Backend) -> Backend:
    """Make ``backend`` ``pg``'s device backend (timed if a hook asks; its plans forgotten)."""
    pg._issuer.forget_plans()  # a plan names its backend
    pg._nccl = time_ops(backend) if pg._issuer.hooks else backend
    pg._nccl_into = backend if isinstance(backend, ReducesInto) else None
    return backend


def split_device_backend_of(pg: GroupBackends, members: Sequence[int] | None, color: int, *, store: Store,
                              group_name: str, timeout: float,
                            pg_options: PGOptions | None = None) -> Backend | None:
    """The device backend of a new group carved out of this one with ``ncclCommSplit``
    (:func:`~gpucoll._group.registry.split_device_backend`); None unless this group was
    bound to a device at creation."""
    if not pg._bound:
        return None
    return split_device_backend(pg._nccl, members, color, store=store, group_name=group_name,
                                timeout=timeout, pg_options=pg_options)


def backend_for_all(pg: GroupBackends, bufs: Sequence[Buffer], names: Sequence[str]) -> Backend:
    """The one backend that runs every buffer of ``bufs`` (all in one kind of memory)."""
    first = bufs[0]
    for buf, name in zip(bufs[1:], names[1:]):
        if buf.device != first.device:
            raise TypeError(f"cannot mix memory kinds in one call: {names[0]} is on {first.device} "
                            f"but {name} is on {buf.device}")
    return backend_for(pg, first, names[0])
