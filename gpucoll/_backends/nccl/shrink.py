"""``ncclCommShrink`` for ``shrink_group`` (NCCL >= 2.27): the ShrinksCommunicator capability.
A function over explicit arguments; ``NCCLBackend.shrink`` decides and makes the child."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ...errors import DistBackendError
from .comm import CommSlot
from .protocols import Comm, Runtime
from .runtime import enter_device, leave_device

__all__ = ["shrink_comm", "check_shrunk", "NCCL_SHRINK_ABORT"]

NCCL_SHRINK_ABORT = 0x01
"""nccl.h: terminate the parent's ongoing operations first, then shrink."""


def shrink_comm(slot: CommSlot, rt: Runtime, device: int, exclude: Sequence[int], *, parent_name: str,
                group_name: str, config: Mapping[str, Any] | None = None) -> Comm:
    """``ncclCommShrink(..., NCCL_SHRINK_ABORT)`` of the communicator in ``slot`` (of group
    ``parent_name``) without the ranks in ``exclude``, for group ``group_name``, under the
    communicator's lock; ``config``: the new communicator's ncclConfig_t fields (None:
    inherited). The caller holds the parent backend's issue lock, and aborts the parent
    afterwards.

    Raises:
        DistBackendError: NCCL's shrink failed.
    """
    comm = slot.comm
    assert comm is not None
    gone = sorted(set(exclude))
    prev = enter_device(rt, device)
    try:
        with slot.lock:  # no other call on the communicator meanwhile
            return (comm.shrink(gone, NCCL_SHRINK_ABORT, config) if config
                    else comm.shrink(gone, NCCL_SHRINK_ABORT))
    except Exception as exc:
        raise DistBackendError(f"ncclCommShrink of group {parent_name!r} without ranks {gone} "
                               f"failed: {exc}") from exc
    finally:
        leave_device(rt, prev)


def check_shrunk(new: Comm, rank: int, size: int, gone: Sequence[int], group_name: str) -> None:
    """``new`` (made by :func:`shrink_comm` on rank ``rank`` of ``size`` without ``gone``)
    has this rank where the survivors' order puts it.

    Raises:
        DistBackendError: it does not.
    """
    expected = [r for r in range(size) if r not in gone]
    if new.size != len(expected) or new.rank != expected.index(rank):
        raise DistBackendError(f"ncclCommShrink made {group_name!r} with rank {new.rank} of {new.size}; "
                               f"expected rank {expected.index(rank)} of {len(expected)}")
