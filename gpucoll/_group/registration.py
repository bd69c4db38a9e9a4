"""A group's memory registration: ``register_buffer``/``deregister_buffer`` and
``register_mem_pool``/``deregister_mem_pool`` (torch's names), as functions over the group.

Device memory goes to the group's device backend (NCCL: ncclCommRegister, or a symmetric
window with ncclCommWindowRegister; see gpucoll/_backends/nccl/registration.py for NCCL's
conditions). Host memory needs no registration: the CPU backend's handle is a no-op.
A handle keeps its array alive until it is deregistered: NCCL does not notice memory
freed under a registration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .. import array as _array
from ..array import ArrayLike
from .._backends.base import RegistersBuffers
from .._buffer import DTYPES, Buffer, Device
from ..errors import RegistrationError
from .dispatch import GroupBackends, backend_for

if TYPE_CHECKING:
    from .._backends.nccl.mempool import NcclMemPool

__all__ = ["BufferRegistration", "register_buffer", "deregister_buffer", "register_mem_pool", "deregister_mem_pool",
           "METHODS"]


@dataclass(eq=False)
class BufferRegistration:
    """Memory registered with a group's communicator (``ProcessGroup.register_buffer``).

    Attributes:
        ptr: the first byte's address.
        nbytes: the registered size.
        symmetric: a symmetric window (``ncclCommWindowRegister``) rather than a local
            registration (``ncclCommRegister``).
        device: where the memory is (``cuda:0``; ``cpu`` for the CPU backend's no-op).
        group_name: the group it was registered with.
        active: False once deregistered.
    """

    ptr: int
    nbytes: int
    symmetric: bool
    device: str
    group_name: str
    active: bool = True
    _backend: RegistersBuffers | None = field(default=None, repr=False)
    _id: int = field(default=0, repr=False)
    _owner: object = field(default=None, repr=False)  # keeps the array alive while registered


def _register(pg: GroupBackends, buf: Buffer, symmetric: bool, owner: object) -> BufferRegistration:
    if buf.device.type == "cpu":
        # Host memory: the CPU backend moves it through its own transport; nothing to register.
        return BufferRegistration(buf.ptr, buf.nbytes, symmetric, "cpu", pg.group_name, _owner=owner)
    backend = backend_for(pg, buf, "array")
    if not isinstance(backend, RegistersBuffers):
        raise RegistrationError(f"group {pg.group_name!r}'s {getattr(backend, 'name', '?')} backend does not "
                                "register memory")
    rid = backend.register_buffer(buf, symmetric)
    return BufferRegistration(buf.ptr, buf.nbytes, symmetric, str(buf.device), pg.group_name,
                              _backend=backend, _id=rid, _owner=owner)


class _Group(GroupBackends, Protocol):
    """What these methods need of a ProcessGroup beyond its backends."""

    _destroyed: bool

    def _check_usable(self) -> None: ...


def register_buffer(self: _Group, array: ArrayLike, symmetric: bool = False) -> BufferRegistration:
    """Register ``array``'s memory with the group's communicator, so that NCCL uses it
    without staging through its own buffers (NVLink SHARP, zero-copy networking and, with
    ``symmetric=True``, NCCL's symmetric kernels).

    ``symmetric=False``: ``ncclCommRegister`` (NCCL >= 2.19), local to this rank.
    ``symmetric=True``: a window, ``ncclCommWindowRegister`` (NCCL >= 2.27), collective
    over the group: every rank calls it, in the same order, with the same size, on memory
    from :func:`gpucoll.nccl_mem_pool` (cuMem) at a 4096-byte-aligned address. Every rank
    checks these first, and a break is the same error on every rank (not a hang in NCCL).
    Host arrays (the CPU backend) need no registration: the handle is a no-op. The handle
    keeps ``array`` alive until :meth:`deregister_buffer`.

    Args:
        array: a device array on the group's GPU, or a host array.
        symmetric: register a symmetric window instead of locally.

    Returns:
        A :class:`gpucoll.BufferRegistration` for :meth:`deregister_buffer`.

    Raises:
        RegistrationError: a condition above is broken on some rank, the loaded NCCL is
            too old, or NCCL refused.

    Example:
        >>> pool = gpucoll.nccl_mem_pool()
        >>> with cupy.cuda.using_allocator(pool.malloc):
        ...     x = cupy.zeros(1 << 20, cupy.float32)
        >>> h = group.register_buffer(x, symmetric=True)
        >>> group.deregister_buffer(h)
    """
    self._check_usable()
    buf = _array.as_buffer(array, name="array")
    return _register(self, buf, bool(symmetric), array)


def deregister_buffer(self: _Group, handle: BufferRegistration) -> None:
    """Undo :meth:`register_buffer`: ``ncclCommDeregister``, or for a window the collective
    ``ncclCommWindowDeregister`` (every rank calls it).

    Raises:
        RegistrationError: deregistered already, registered with another group, or NCCL refused.
    """
    self._check_usable()
    _deregister(self, handle)


def _deregister(pg: GroupBackends, handle: BufferRegistration) -> None:
    if not isinstance(handle, BufferRegistration):
        raise TypeError(f"handle must be what register_buffer returned; got {type(handle).__name__}")
    if handle.group_name != pg.group_name:
        raise RegistrationError(f"the buffer at {handle.ptr:#x} was registered with group {handle.group_name!r}, "
                                f"not {pg.group_name!r}")
    if not handle.active:
        raise RegistrationError(f"the buffer at {handle.ptr:#x} ({handle.nbytes} B) on group {pg.group_name!r} "
                                "is deregistered already")
    handle.active = False
    try:
        if handle._backend is not None:
            handle._backend.deregister_buffer(handle._id, handle.symmetric)
    finally:
        handle._owner = None


class _PoolWatcher:
    """Registers a pool's segments with one group as they come and go (the pool holds it)."""

    def __init__(self, group: _Group) -> None:
        self.group = group
        self.regs: dict[int, BufferRegistration] = {}

    def __call__(self, event: str, ptr: int, nbytes: int, device: int) -> None:
        group = self.group
        if group._destroyed:
            return  # the communicator's end freed its registrations
        if event == "alloc":
            buf = Buffer(ptr, nbytes, DTYPES["uint8"], (nbytes,), Device("cuda", device))
            self.regs[ptr] = _register(group, buf, False, None)
        else:
            reg = self.regs.pop(ptr, None)
            if reg is not None and reg.active:
                _deregister(group, reg)


def _watcher_of(group: _Group, pool: NcclMemPool) -> _PoolWatcher | None:
    found = pool._watching(lambda w: isinstance(w, _PoolWatcher) and w.group is group)
    return found if isinstance(found, _PoolWatcher) else None


def register_mem_pool(self: _Group, pool: NcclMemPool) -> None:
    """Register every segment of ``pool`` (from :func:`gpucoll.nccl_mem_pool`) with the
    communicator, those it holds now and those it allocates later, as torch's
    ``ProcessGroupNCCL.register_mem_pool`` does (local registration, ``ncclCommRegister``);
    a segment is deregistered before the pool gives it back to NCCL. Once the group is
    destroyed, the pool's new segments are no longer registered.

    Raises:
        TypeError: ``pool`` is not an NCCL memory pool.
        RegistrationError: registered with this group already, or NCCL refused a segment.
    """
    from .._backends.nccl.mempool import NcclMemPool

    self._check_usable()
    if not isinstance(pool, NcclMemPool):
        raise TypeError(f"pool must come from gpucoll.nccl_mem_pool(); got {type(pool).__name__}")
    if _watcher_of(self, pool) is not None:
        raise RegistrationError(f"this pool is registered with group {self.group_name!r} already")
    pool._watch(_PoolWatcher(self))


def deregister_mem_pool(self: _Group, pool: NcclMemPool) -> None:
    """Deregister every segment of ``pool`` and stop registering its new ones.

    Raises:
        RegistrationError: ``pool`` is not registered with this group.
    """
    self._check_usable()
    watcher = _watcher_of(self, pool)
    if watcher is None:
        raise RegistrationError(f"this pool is not registered with group {self.group_name!r}")
    pool._unwatch(watcher)


METHODS = (register_buffer, deregister_buffer, register_mem_pool, deregister_mem_pool)
"""ProcessGroup's registration methods, in the order its class body binds them."""
