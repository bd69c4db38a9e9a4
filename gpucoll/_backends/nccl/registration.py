"""Registering device memory with a backend's communicator: NCCL's conditions, checked
before NCCL is called, and NCCL's own refusals, named.

Local registration (``ncclCommRegister``, NCCL >= 2.19) takes any device memory of the
communicator's GPU; NCCL counts references and frees the registration at
``ncclCommDeregister`` (an unknown handle is ``ncclInvalidUsage``). A window
(``ncclCommWindowRegister``, NCCL >= 2.27, ``NCCL_WIN_COLL_SYMMETRIC``) is collective
over the group and needs cuMem memory (``ncclMemAlloc``): NCCL asks the driver for the
allocation behind the pointer (``cuMemRetainAllocationHandle``) and refuses an offset
into it that is not a multiple of ``NCCL_WIN_REQUIRED_ALIGNMENT`` (4096); symmetric
kernels need the same size on every rank. A rank that fails one of these inside NCCL
returns while its peers wait in NCCL's bootstrap all-gather, so the group checks them
first: every rank publishes its size and what it found through the group's store, and
every rank raises the same :class:`RegistrationError` when any rank broke a condition.
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable, Protocol

from ..._buffer import Buffer
from ...errors import RegistrationError
from ...store.base import Store
from .comm import CommSlot
from .lib import Features
from .protocols import Runtime

__all__ = ["Registrations", "WIN_COLL_SYMMETRIC", "WINDOW_ALIGNMENT", "register", "deregister"]

WIN_COLL_SYMMETRIC = 0x01   # NCCL_WIN_COLL_SYMMETRIC (nccl.h)
WINDOW_ALIGNMENT = 4096     # NCCL_WIN_REQUIRED_ALIGNMENT (nccl.h)


class Registrations:
    """One backend's registrations: live handles and the window count (keys the store exchange)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.windows = itertools.count()
        self.live: dict[int, tuple[int, int, bool]] = {}  # id -> (NCCL handle, nbytes, symmetric)
        self._ids = itertools.count(1)

    def add(self, handle: int, nbytes: int, symmetric: bool) -> int:
        """Keep NCCL's ``handle``; the registration's id."""
        with self.lock:
            rid = next(self._ids)
            self.live[rid] = (handle, nbytes, symmetric)
            return rid


class NCCLBackend(Protocol):
    """What registration reads of a backend (``backend.NCCLBackend``'s fields)."""

    rank: int
    size: int
    group_name: str
    store: Store
    runtime: Runtime
    features: Features
    comm_slot: CommSlot
    device_index: int
    registrations: Registrations


def _version(be: NCCLBackend) -> str:
    return ".".join(map(str, be.features.version))


def _nccl(be: NCCLBackend, what: str, call: Callable[[], int], about: str) -> int:
    """``call()`` on the communicator, under its lock; NCCL's refusal as a RegistrationError."""
    out = [0]

    def run() -> None:
        out[0] = call()
    try:
        be.comm_slot.call(run)
    except Exception as exc:  # NcclCallError, CuPy's NcclError, the fake's: NCCL said no
        raise RegistrationError(f"{what} of {about} on group {be.group_name!r} (rank {be.rank}) failed: "
                                f"{exc}") from exc
    return out[0]


def _window_checks(be: NCCLBackend, buf: Buffer) -> None:
    """Every rank's size, memory kind and alignment, through the store; the same error on
    every rank when any rank breaks a window's condition."""
    n = next(be.registrations.windows)
    vmm = be.runtime.is_vmm(buf.ptr, buf.nbytes)
    mine = f"{buf.nbytes},{'?' if vmm is None else int(vmm)},{int(buf.ptr % WINDOW_ALIGNMENT == 0)}"
    key = f"gpucoll/window/{n}/"
    be.store.set(key + str(be.rank), mine)
    peers = [be.store.get(key + str(r)).decode().split(",") for r in range(be.size)]
    sizes = [int(p[0]) for p in peers]
    problems = []
    not_vmm = [r for r, p in enumerate(peers) if p[1] == "0"]
    if not_vmm:
        problems.append(f"rank(s) {not_vmm} passed memory that is not from ncclMemAlloc or cuMem (a window needs "
                        "cuMem memory: allocate it from gpucoll.nccl_mem_pool())")
    unaligned = [r for r, p in enumerate(peers) if p[2] == "0"]
    if unaligned:
        problems.append(f"rank(s) {unaligned} passed an address that is not {WINDOW_ALIGNMENT}-byte aligned "
                        "(NCCL_WIN_REQUIRED_ALIGNMENT)")
    if len(set(sizes)) > 1:
        problems.append("the sizes differ between ranks (a symmetric window has the same size on every rank): "
                        + ", ".join(f"rank {r} {s} B" for r, s in enumerate(sizes)))
    if problems:
        raise RegistrationError(f"symmetric window #{n} on group {be.group_name!r} (ncclCommWindowRegister, "
                                f"this rank {be.rank}: {buf.nbytes} B at {buf.ptr:#x}): " + "; ".join(problems))


def register(be: NCCLBackend, buf: Buffer, symmetric: bool) -> int:
    """Register ``buf`` with ``be``'s communicator; the id of the registration.

    Raises:
        RegistrationError: no communicator yet, another device, an NCCL too old, a window's
            condition broken on some rank, or NCCL refused.
    """
    comm = be.comm_slot.comm
    if comm is None:
        raise RegistrationError(f"group {be.group_name!r} has no NCCL communicator yet: create the group with "
                                "device_id, or run a collective on the device first, then register")
    if buf.device.index != be.device_index:
        raise RegistrationError(f"the buffer is on {buf.device} but group {be.group_name!r} communicates on "
                                f"cuda:{be.device_index}")
    if buf.nbytes <= 0:
        raise RegistrationError(f"cannot register an empty buffer (0 bytes at {buf.ptr:#x}); NCCL refuses it")
    about = f"{buf.nbytes} B at {buf.ptr:#x}"
    if not symmetric:
        if not be.features.register:
            raise RegistrationError(f"buffer registration needs ncclCommRegister (NCCL >= 2.19); this is "
                                    f"NCCL {_version(be)}")
        handle = _nccl(be, "ncclCommRegister", lambda: comm.register(buf.ptr, buf.nbytes), about)
    else:
        if not be.features.window:
            raise RegistrationError(f"a symmetric window needs ncclCommWindowRegister (NCCL >= 2.27); this is "
                                    f"NCCL {_version(be)}; register it locally (symmetric=False) instead")
        _window_checks(be, buf)
        handle = _nccl(be, "ncclCommWindowRegister",
                       lambda: comm.window_register(buf.ptr, buf.nbytes, WIN_COLL_SYMMETRIC), about)
    return be.registrations.add(handle, buf.nbytes, symmetric)


def deregister(be: NCCLBackend, rid: int, symmetric: bool) -> None:
    """Undo :func:`register` (``rid`` is its answer); collective for a window.

    Raises:
        RegistrationError: ``rid`` is not a live registration of this backend, or NCCL refused.
    """
    with be.registrations.lock:
        entry = be.registrations.live.pop(rid, None)
    if entry is None:
        raise RegistrationError(f"registration #{rid} is not live on group {be.group_name!r} "
                                "(deregistered already, or made on another group)")
    handle, nbytes, was_symmetric = entry
    if was_symmetric != symmetric:
        raise RegistrationError(f"registration #{rid} was made with symmetric={was_symmetric}")
    comm = be.comm_slot.comm
    if comm is None or be.comm_slot.gone:
        return  # the communicator is gone, and NCCL freed its registrations with it
    what = "ncclCommWindowDeregister" if symmetric else "ncclCommDeregister"

    def call() -> int:
        (comm.window_deregister if symmetric else comm.deregister)(handle)
        return 0
    _nccl(be, what, call, f"registration #{rid} ({nbytes} B)")
