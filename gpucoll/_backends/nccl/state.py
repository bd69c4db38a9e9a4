"""What the NCCL backend's function modules (hot, lifecycle, phases) read of a
backend, as a Protocol: a leaf module, so that none of
them imports :mod:`.backend` (which imports them), not even for a type. NCCLBackend
satisfies it; mypy checks that at every call that passes one."""

from __future__ import annotations

from typing import Any, Protocol

from ...store.base import Store
from .comm import CommSlot
from .ending import Ending
from .outstanding import Outstanding
from .lib import Features
from .plan import Planner
from .stream import CommStream
from .protocols import Runtime

__all__ = ["BackendState"]


class BackendState(Protocol):
    """One NCCL backend's state, read-only (declared in ``NCCLBackend.__init__``, which
    says what each field is for): plain attributes, no properties, since the hot path
    reads them per op. What changes after construction changes through the parts'
    methods (comm_slot, comm_stream, outstanding, ending) or the backend's."""

    rank: int
    size: int
    config: dict[str, Any]
    runtime: Runtime
    features: Features
    store: Store
    timeout: float
    group_name: str
    high_priority: bool
    issue_lock: Any      # threading.RLock: the issue path
    comm_slot: CommSlot  # the communicator, its lock, its end
    device_index: int    # the communicator's device, -1 until it exists
    comm_stream: CommStream  # the communication stream, its events, what lives as long as the backend
    planner: Planner | None
    scratch: int
    outstanding: Outstanding  # ops issued, not yet seen complete
    ending: Ending       # aborted / shut down, and why

    def abort(self, reason: str) -> None: ...

    def failure(self) -> str | None: ...

    def complete_until(self, stop: Any) -> Any: ...

    def complete_earlier(self, work: Any) -> None: ...
