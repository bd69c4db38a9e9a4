"""``ncclCommShrink`` for ``shrink_group`` (NCCL >= 2.27): the ShrinksCommunicator capability."""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

from ...errors import DistBackendError
from ...store.base import Store
from .lib import Features
from .runtime import Comm, Runtime, enter_device, leave_device

__all__ = ["Shrinking", "NCCL_SHRINK_ABORT"]

NCCL_SHRINK_ABORT = 0x01
"""nccl.h: terminate the parent's ongoing operations first, then shrink."""


class Shrinking:
    """NCCLBackend's :meth:`shrink`; the backend's state it uses is declared here."""

    rank: int
    size: int
    _lock: threading.RLock
    _comm_lock: threading.Lock
    _comm: Comm | None
    _rt: Runtime
    _device: int
    _group_name: str
    _eager: bool
    _features: Features
    _aborted: str | None
    _closed: str | None

    def abort(self, reason: str) -> None:
        raise NotImplementedError

    def _abort_comm(self, *, blocking: bool) -> None:
        raise NotImplementedError

    def _split_backend(self, store: Store, rank: int, size: int, *, timeout: float, group_name: str,
                       device_id: int | None, comm: Comm | None, config: Mapping[str, Any] | None = None,
                       high_priority: bool = False) -> Any:
        raise NotImplementedError

    def _checked_config(self, config: Mapping[str, Any] | None) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def can_shrink(self) -> bool:
        """True when :meth:`shrink` can run: the communicator was created eagerly, the
        loaded NCCL has ncclCommShrink (>= 2.27), and it is neither aborted nor shut down."""
        return (self._eager and self._comm is not None and self._features.comm_shrink
                and self._aborted is None and self._closed is None)

    def shrink(self, exclude: Sequence[int], *, store: Store, group_name: str, timeout: float,
               config: Mapping[str, Any] | None = None, high_priority: bool = False) -> Any:
        """The backend of group ``group_name``: this communicator without the ranks in
        ``exclude``, made with ``ncclCommShrink(..., NCCL_SHRINK_ABORT)``; every rank not
        excluded calls it with the same list. This backend is aborted afterwards (its
        pending ops fail); the caller shuts it down. ``config`` (ncclConfig_t fields, None:
        inherited) reaches ncclCommShrink; ``high_priority`` is the new stream's priority.

        Raises:
            DistBackendError: :attr:`can_shrink` is False, or NCCL's shrink failed.
        """
        gone = sorted(set(exclude))
        config = self._checked_config(config)
        with self._lock:
            comm = self._comm
            if not self.can_shrink or comm is None:
                raise DistBackendError(f"group {self._group_name!r}: its NCCL communicator cannot be shrunk "
                                       f"({self._aborted or self._closed or 'ncclCommShrink unavailable'})")
            rt, device = self._rt, self._device
            prev = enter_device(rt, device)
            try:
                with self._comm_lock:  # no other call on the communicator meanwhile
                    new = (comm.shrink(gone, NCCL_SHRINK_ABORT, config) if config
                           else comm.shrink(gone, NCCL_SHRINK_ABORT))
            except Exception as exc:
                raise DistBackendError(f"ncclCommShrink of group {self._group_name!r} without ranks {gone} "
                                       f"failed: {exc}") from exc
            finally:
                leave_device(rt, prev)
        if self._aborted is not None:
            self._abort_comm(blocking=True)  # an abort that arrived during the shrink
        self.abort(f"group {self._group_name!r} was shrunk into {group_name!r}")
        expected = [r for r in range(self.size) if r not in gone]
        if new.size != len(expected) or new.rank != expected.index(self.rank):
            raise DistBackendError(f"ncclCommShrink made {group_name!r} with rank {new.rank} of {new.size}; "
                                   f"expected rank {expected.index(self.rank)} of {len(expected)}")
        return self._split_backend(store, new.rank, new.size, timeout=timeout, group_name=group_name,
                                   device_id=device, comm=new, config=config, high_priority=high_priority)
