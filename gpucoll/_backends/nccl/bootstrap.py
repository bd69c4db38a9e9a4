"""Whether NCCL can run here, the rendezvous that makes a communicator's unique id
known to every rank through the group's store, and a backend's communicator made from
it (functions over an NCCLBackend's state)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ...errors import DistBackendError, DistStoreError
from ...store.base import Store
from . import lib as _nccl_lib
from .lib import normalise_unique_id
from .plan import Planner
from .runtime import Comm, enter_device, leave_device

if TYPE_CHECKING:
    from .backend import NCCLBackend

__all__ = ["nccl_unavailable_reason", "is_nccl_available", "nccl_version", "rendezvous", "create_comm", "adopt"]

_UID_KEY = "nccl/unique_id"
_ARRIVED_KEY = "nccl/arrived"
_ALL_ARRIVED_KEY = "nccl/all_arrived"


def nccl_unavailable_reason() -> str | None:
    """Why the NCCL backend cannot run in this process, or None if it can.

    Checks that CuPy imports, that it found an NCCL library, and that a CUDA device
    is visible (which initialises the CUDA driver: fork no workers afterwards).

    Example:
        >>> reason = nccl_unavailable_reason()
        >>> backend = "nccl" if reason is None else "cpu"
    """
    return _nccl_lib.unavailable_reason()


def is_nccl_available() -> bool:
    """True if the NCCL backend can run here (see :func:`nccl_unavailable_reason`)."""
    return nccl_unavailable_reason() is None


def nccl_version() -> tuple[int, int, int]:
    """The (major, minor, patch) of the NCCL library CuPy loads; needs no GPU.

    Raises:
        BackendUnavailableError: CuPy or NCCL is not installed.
    """
    return _nccl_lib.load().version


def rendezvous(store: Store, rank: int, size: int, *, timeout: float, group_name: str,
               make_uid: Callable[[], bytes]) -> bytes:
    """Agree on an NCCL unique id through ``store`` and wait until every rank has it.

    Rank 0 calls ``make_uid`` and publishes the id; the others wait for it. Then every
    rank counts itself in and waits for the last one: ``ncclCommInitRank`` blocks
    until all ranks join, and a missing rank is better reported here, as a timeout
    that says how many arrived, than as a hang inside NCCL.

    Args:
        store: the group's private store (keys ``nccl/...``; one communicator per store).
        rank, size: this rank and the group size.
        timeout: seconds to wait for rank 0's id and for all ranks to arrive.
        group_name: for errors.
        make_uid: makes a new unique id (``ncclGetUniqueId``); called on rank 0 only.

    Returns:
        The 128-byte unique id, the same on every rank.

    Raises:
        DistBackendError: the id or some ranks did not arrive within ``timeout``.
    """
    try:
        if rank == 0:
            uid = normalise_unique_id(make_uid())
            store.set(_UID_KEY, uid)
        else:
            uid = normalise_unique_id(store.get(_UID_KEY, timeout=timeout))
    except DistStoreError as exc:
        raise DistBackendError(
            f"group {group_name!r}: rank {rank} did not get the NCCL unique id from rank 0 through the "
            f"store within {timeout:.3g} s: {exc}") from exc
    arrived = _all_arrive(store, _ARRIVED_KEY, _ALL_ARRIVED_KEY, size, timeout)
    if arrived is not None:
        raise DistBackendError(f"group {group_name!r}: only {arrived} ranks reached NCCL communicator "
                               f"setup within {timeout:.3g} s")
    return uid


def _all_arrive(store: Store, counter: str, flag: str, size: int, timeout: float) -> str | None:
    """Count this rank in at ``counter`` and wait until all ``size`` ranks are: None once
    they are, else how many arrived ("k of n") when ``timeout`` seconds ran out."""
    try:
        if store.add(counter, 1) == size:
            store.set(flag, b"1")
        store.wait([flag], timeout)
        return None
    except DistStoreError:
        try:
            return f"{store.add(counter, 0)} of {size}"
        except DistStoreError:
            return f"not all {size}"


def create_comm(b: NCCLBackend, device: int) -> None:
    """Make ``b``'s communicator on ``device``: its unique id through the group's store
    (:func:`rendezvous`), then ncclCommInitRank(Config); see :func:`adopt`."""
    rt = b._rt
    prev = enter_device(rt, device)
    try:
        uid = rendezvous(b._store, b.rank, b.size, timeout=b._timeout,
                         group_name=b._group_name, make_uid=rt.unique_id)
        try:
            comm = rt.new_comm(b.size, uid, b.rank, b.config or None)
        except Exception as exc:
            raise DistBackendError(
                f"creating the NCCL communicator of group {b._group_name!r} (rank {b.rank} of "
                f"{b.size}, cuda:{device}) failed: {type(exc).__name__}: {exc}. With several ranks "
                "on one GPU, NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1 are needed") from exc
        adopt(b, comm, device)
    finally:
        leave_device(rt, prev)

def adopt(b: NCCLBackend, comm: Comm, device: int) -> None:
    """Give ``b`` the communicator ``comm`` on ``device``, with its stream, scratch word
    and op planner."""
    rt = b._rt
    prev = enter_device(rt, device)
    try:
        stream = rt.new_stream(b._high_priority) if b._high_priority else rt.new_stream()
        cc = rt.compute_capability(device)
        scratch, owner = rt.alloc(4, stream)
    finally:
        leave_device(rt, prev)
    b._keep.append(owner)
    b._scratch = scratch
    b._stream, b._stream_ptr = stream, int(stream.ptr)
    b._planner = Planner(b.rank, b.size, b._features,
                            b._features.fp8 and cc >= (9, 0), b._alloc_temp)
    b._device = device
    b._comm = comm
