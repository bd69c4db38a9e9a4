"""``ncclCommSplit`` for a new group, guarded so that a missing rank is a timeout, not a hang."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ...errors import DistBackendError
from ...store.base import Store
from .bootstrap import _all_arrive
from .lifecycle import abort_comm, drain
from .runtime import Comm, Runtime, enter_device, leave_device

if TYPE_CHECKING:
    from .state import BackendState

__all__ = ["split_comm", "split", "child_backend"]


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


def split(b: BackendState, ranks: Sequence[int] | None, *, color: int = 0, store: Store, group_name: str,
          timeout: float, config: Mapping[str, Any] | None = None, high_priority: bool = False) -> BackendState | None:
    """The backend of a new group carved out of ``b``'s. Every rank of this group
    must call it, at the same point of its op sequence, whether it joins a new group
    or not (that is how ``ncclCommSplit`` works).

    Args:
        ranks: the members of this rank's new group as ranks of this group, in the
            new group's rank order; None (or a list without this rank) for a rank
            that joins no new group.
        color: tells new groups apart when one call makes several disjoint groups
            (torch's ``split_group``): ranks passing the same ``ranks`` pass the same
            color >= 0, different groups different colors.
        store: the new group's private store (used when no split is possible).
        group_name: the new group's name.
        timeout: the new group's timeout, seconds.
        config: the new group's ncclConfig_t fields (NCCLOptions.config), passed to
            ncclCommSplit (or ncclCommInitRankConfig); None: NCCL's defaults.
        high_priority: the new group's stream priority (NCCLOptions).

    When :attr:`can_split` (an eagerly created communicator and NCCL >= 2.18) the
    new communicator comes from ``ncclCommSplit``: no unique id round trip, and NCCL
    may share resources with this one. Every rank first counts itself in through
    this group's store, so a rank that never calls fails the others after
    ``timeout`` seconds instead of hanging them. Otherwise members build one from a
    fresh unique id exchanged through ``store``, and non-members return at once.

    Returns:
        The new group's backend on members; None elsewhere.

    Raises:
        ValueError: ``color`` < 0.
        BackendUnavailableError: a config field the loaded NCCL or runtime cannot apply.
        DistBackendError: the split failed, or not every rank reached it in time.
    """
    if not isinstance(color, int) or color < 0:
        raise ValueError(f"color must be an int >= 0; got {color!r}")
    config = b._checked_config(config)
    members = list(ranks) if ranks is not None else []
    member = b.rank in members
    new_rank = members.index(b.rank) if member else -1
    with b._lock:
        if b.can_split:
            comm = b.comm_slot.comm
            assert comm is not None
            b._splits += 1
            device = b._device
            new = split_comm(comm, b._rt, device, b._store, f"nccl/split{b._splits}", b.size,
                             timeout=timeout, parent_timeout=b._timeout, drain=lambda t: drain(b, t),
                             parent_name=b._group_name, group_name=group_name,
                             color=color if member else -1, new_rank=max(new_rank, 0), config=config,
                             comm_lock=b.comm_slot.lock)
            if b._aborted is not None:
                abort_comm(b, blocking=True)  # an abort that arrived during the split
            if new is None:
                return None
            if new.size != len(members) or new.rank != new_rank:
                raise DistBackendError(
                    f"ncclCommSplit made group {group_name!r} with rank {new.rank} of {new.size}; expected "
                    f"rank {new_rank} of {len(members)}: ranks passed different member lists for one color")
            return child_backend(b, store, new_rank, len(members), timeout=timeout, group_name=group_name,
                                 device_id=device, comm=new, config=config, high_priority=high_priority)
    if not member:
        return None
    return child_backend(b, store, new_rank, len(members), timeout=timeout, group_name=group_name,
                         device_id=b._device if b._eager else None, comm=None, config=config,
                         high_priority=high_priority)


def child_backend(b: BackendState, store: Store, rank: int, size: int, *, timeout: float, group_name: str,
                  device_id: int | None, comm: Comm | None, config: Mapping[str, Any] | None = None,
                  high_priority: bool = False) -> BackendState:
    """A new backend beside ``b`` (same runtime): on ``comm`` when given (a split's or a
    shrink's communicator), else one made through ``store``."""
    return b._child(store, rank, size, timeout=timeout, group_name=group_name, device_id=device_id, comm=comm,
                    config=config, high_priority=high_priority)
