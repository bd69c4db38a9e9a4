"""What the NCCL backend's function modules (hot, lifecycle, phases, bootstrap) read
and write of a backend, as a Protocol: a leaf module, so that none of
them imports :mod:`.backend` (which imports them), not even for a type. NCCLBackend
satisfies it; mypy checks that at every call that passes one."""

from __future__ import annotations

from typing import Any, Protocol

from ...store.base import Store
from .comm import CommSlot
from .outstanding import Outstanding
from .lib import Features
from .plan import Planner
from .stream import CommStream
from .protocols import Runtime

__all__ = ["BackendState"]


class BackendState(Protocol):
    """One NCCL backend's state (declared in ``NCCLBackend.__init__``, which says what
    each field is for)."""

    rank: int
    size: int
    config: dict[str, Any]
    _rt: Runtime
    _features: Features
    _store: Store
    _timeout: float
    _group_name: str
    _high_priority: bool
    _lock: Any          # threading.RLock: the issue path
    comm_slot: CommSlot  # the communicator, its lock, its end
    _device: int
    comm_stream: CommStream  # the communication stream, its event pool, timing, tail
    _planner: Planner | None
    _scratch: int
    _keep: list[Any]
    _captured: bool
    outstanding: Outstanding  # ops issued, not yet seen complete; its lock guards _aborted
    _aborted: str | None
    _closed: str | None

    def abort(self, reason: str) -> None: ...

    def _failure(self) -> str | None: ...

    def _complete_until(self, stop: Any) -> Any: ...

    def _complete_earlier(self, work: Any) -> None: ...

    def _alloc_temp(self, nbytes: int) -> int: ...
