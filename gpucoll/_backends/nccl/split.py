"""``ncclCommSplit`` for a new group, guarded so that a missing rank is a timeout, not a hang:
a function over explicit arguments (the parent's communicator, lock, runtime, device,
store); ``NCCLBackend.split`` decides when to split and makes the child backend."""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping

from ...errors import DistBackendError
from ...store.base import Store
from .bootstrap import _all_arrive
from .runtime import Comm, Runtime, enter_device, leave_device

__all__ = ["split_comm", "check_split"]


def split_comm(comm: Comm, rt: Runtime, device: int, store: Store, key: str, size: int, *, timeout: float,
               parent_timeout: float, drain: Callable[[float], bool], parent_name: str, group_name: str,
               color: int, new_rank: int, config: Mapping[str, Any] | None = None,
               comm_lock: threading.Lock | None = None) -> Comm | None:
    """Split ``comm`` (of group ``parent_name``, ``size`` ranks) for new group ``group_name``;
    the caller holds the parent backend's lock. ``color`` -1 joins no new communicator.
    ``config``: the new communicator's ncclConfig_t fields (None: inherited).
    ``comm_lock``: held around ncclCommSplit (no other call on ``comm`` meanwhile).
    Returns the new communicator, or None on a rank that joins none."""
    # ncclCommSplit blocks until every rank of this group calls it: count the
    # ranks in through the store first, so that one that never comes is a
    # timeout naming how many did, not a hang inside NCCL.
    arrived = _all_arrive(store, f"{key}/arrived", f"{key}/all", size, timeout)
    if arrived is not None:
        raise DistBackendError(
            f"new group {group_name!r}: only {arrived} ranks of group {parent_name!r} reached "
            f"its split (ncclCommSplit) within {timeout:.3g} s; every rank of the parent group "
            "must create the new groups, in the same order")
    # ncclCommSplit must not race ops still queued on this communicator.
    if not drain(parent_timeout):
        raise DistBackendError(f"new group {group_name!r}: ops of group {parent_name!r} "
                               f"did not finish within {parent_timeout:.3g} s before the split")
    prev = enter_device(rt, device)
    try:
        # NCCL_SPLIT_NOCOLOR (-1): this rank joins no new communicator.
        if comm_lock is not None:
            comm_lock.acquire()
        try:
            new = comm.split(color, new_rank, config) if config else comm.split(color, new_rank)
        finally:
            if comm_lock is not None:
                comm_lock.release()
    except Exception as exc:
        raise DistBackendError(f"ncclCommSplit of group {parent_name!r} into "
                               f"{group_name!r} failed: {exc}") from exc
    finally:
        leave_device(rt, prev)
    return new


def check_split(new: Comm, rank: int, size: int, group_name: str) -> None:
    """``new`` (made by :func:`split_comm`) is rank ``rank`` of ``size``, as this rank's
    member list says.

    Raises:
        DistBackendError: it is not: ranks passed different member lists for one color.
    """
    if new.size != size or new.rank != rank:
        raise DistBackendError(
            f"ncclCommSplit made group {group_name!r} with rank {new.rank} of {new.size}; expected "
            f"rank {rank} of {size}: ranks passed different member lists for one color")
