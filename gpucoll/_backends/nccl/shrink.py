"""``ncclCommShrink`` for ``shrink_group`` (NCCL >= 2.27): the ShrinksCommunicator capability."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ...errors import DistBackendError
from ...store.base import Store
from .runtime import enter_device, leave_device
from .lifecycle import abort, abort_comm
from .split import child_backend

if TYPE_CHECKING:
    from .state import BackendState

__all__ = ["shrink", "can_shrink", "NCCL_SHRINK_ABORT"]

NCCL_SHRINK_ABORT = 0x01
"""nccl.h: terminate the parent's ongoing operations first, then shrink."""


def can_shrink(b: BackendState) -> bool:
    """True when :meth:`shrink` can run: the communicator was created eagerly, the
    loaded NCCL has ncclCommShrink (>= 2.27), and it is neither aborted nor shut down."""
    return (b._eager and b.comm_slot.comm is not None and b._features.comm_shrink
            and b._aborted is None and b._closed is None)


def shrink(b: BackendState, exclude: Sequence[int], *, store: Store, group_name: str, timeout: float,
           config: Mapping[str, Any] | None = None, high_priority: bool = False) -> BackendState:
    """The backend of group ``group_name``: this communicator without the ranks in
    ``exclude``, made with ``ncclCommShrink(..., NCCL_SHRINK_ABORT)``; every rank not
    excluded calls it with the same list. This backend is aborted afterwards (its
    pending ops fail); the caller shuts it down. ``config`` (ncclConfig_t fields, None:
    inherited) reaches ncclCommShrink; ``high_priority`` is the new stream's priority.

    Raises:
        DistBackendError: :attr:`can_shrink` is False, or NCCL's shrink failed.
    """
    gone = sorted(set(exclude))
    config = b._checked_config(config)
    with b._lock:
        comm = b.comm_slot.comm
        if not can_shrink(b) or comm is None:
            raise DistBackendError(f"group {b._group_name!r}: its NCCL communicator cannot be shrunk "
                                   f"({b._aborted or b._closed or 'ncclCommShrink unavailable'})")
        rt, device = b._rt, b._device
        prev = enter_device(rt, device)
        try:
            with b.comm_slot.lock:  # no other call on the communicator meanwhile
                new = (comm.shrink(gone, NCCL_SHRINK_ABORT, config) if config
                       else comm.shrink(gone, NCCL_SHRINK_ABORT))
        except Exception as exc:
            raise DistBackendError(f"ncclCommShrink of group {b._group_name!r} without ranks {gone} "
                                   f"failed: {exc}") from exc
        finally:
            leave_device(rt, prev)
    if b._aborted is not None:
        abort_comm(b, blocking=True)  # an abort that arrived during the shrink
    abort(b, f"group {b._group_name!r} was shrunk into {group_name!r}")
    expected = [r for r in range(b.size) if r not in gone]
    if new.size != len(expected) or new.rank != expected.index(b.rank):
        raise DistBackendError(f"ncclCommShrink made {group_name!r} with rank {new.rank} of {new.size}; "
                               f"expected rank {expected.index(b.rank)} of {len(expected)}")
    return child_backend(b, store, new.rank, new.size, timeout=timeout, group_name=group_name,
                               device_id=device, comm=new, config=config, high_priority=high_priority)
