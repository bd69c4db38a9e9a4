"""Backends by name, their spellings, and a group's device-backend lifecycle.

``BACKENDS`` is the literal registry (name -> factory). A group always has a CPU
backend; its device (NCCL) backend is made on first device op, at creation when
``device_id`` is given, or split from its parent's communicator
(:func:`split_device_backend`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .._debug import get_debug_level
from ..errors import BackendUnavailableError
from .._backends.base import Backend, SplitsCommunicator
from ..store import PrefixStore, Store
from .options import CPUOptions, FakeOptions, NCCLOptions, PGOptions

__all__ = ["BACKENDS", "BackendFactory", "normalize_backend", "default_backend", "nccl_usable", "debug_level",
           "make_device_backend", "split_device_backend", "backend_kwargs"]

def debug_level() -> str:
    """The debug level's name: ``"OFF"``, ``"INFO"`` or ``"DETAIL"`` (see gpucoll._debug).

    Raises:
        ValueError: ``GPUCOLL_DEBUG`` (or ``TORCH_DISTRIBUTED_DEBUG``) holds another value.
    """
    return get_debug_level().name


BackendFactory = Callable[..., Backend]


def _make_cpu(store: Store, rank: int, size: int, *, timeout: float, group_name: str,
              device_id: int | None, transport: str | None = None) -> Backend:
    from .._backends.cpu.backend import CPUBackend

    backend: Backend = CPUBackend(store, rank, size, timeout=timeout, group_name=group_name, transport=transport)
    return backend


def _make_nccl(store: Store, rank: int, size: int, *, timeout: float, group_name: str,
               device_id: int | None, **options: Any) -> Backend:
    from .._backends.nccl.backend import NCCLBackend, nccl_unavailable_reason

    reason = nccl_unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(f"group {group_name!r} needs the NCCL backend, which cannot run here: {reason}")
    backend: Backend = NCCLBackend(store, rank, size, timeout=timeout, group_name=group_name,
                                   device_id=device_id, **options)
    return backend


def _make_fake(store: Store, rank: int, size: int, *, timeout: float, group_name: str,
               device_id: int | None, error_on_collective: bool = False) -> Backend:
    from .._backends.fake import FakeBackend

    return FakeBackend(store, rank, size, timeout=timeout, group_name=group_name,
                       error_on_collective=error_on_collective)


BACKENDS: dict[str, BackendFactory] = {"cpu": _make_cpu, "nccl": _make_nccl, "fake": _make_fake}
"""Backend constructors by name, called as ``factory(store, rank, size, *, timeout,
group_name, device_id, **backend_kwargs(pg_options))`` (no options: no extra keywords). ``cpu`` serves host arrays, objects and barriers in every
group; ``nccl`` serves device arrays in groups created with backend "nccl"; ``fake``
serves everything in groups created with backend "fake" (no communication)."""

_BACKEND_GRACE_S = 0.5
"""Backends get the group's timeout plus this, so that a stuck op is normally caught by
the group's own wait or watchdog, whose error names the op, its sequence number and
the flight-recorder dump. (An op the backend runs on the caller's thread can only
time out inside the backend; its error is then reworded the same way.) A dead peer
is still reported by the backend at once."""

_ALIASES = {"cpu": "cpu", "gloo": "cpu", "nccl": "nccl", "cuda": "nccl", "cpu:gloo,cuda:nccl": "nccl",
            "fake": "fake"}


def nccl_usable() -> bool:
    """True when the NCCL backend can run here (CuPy, NCCL and a GPU); may import CuPy."""
    try:
        from .._backends.nccl.backend import nccl_unavailable_reason
    except ImportError:
        return False
    return nccl_unavailable_reason() is None


def default_backend() -> str:
    """``"nccl"`` when a GPU and NCCL are usable, ``"cpu"`` otherwise."""
    return "nccl" if nccl_usable() else "cpu"


def normalize_backend(backend: str | None) -> str:
    """Map a backend spelling to ``"cpu"`` or ``"nccl"`` (``None`` picks :func:`default_backend`).

    ``"gloo"`` and torch's ``"cpu:gloo,cuda:nccl"`` are accepted so scripts port unchanged.

    Raises:
        ValueError: an unknown backend name.
    """
    if backend is None:
        return default_backend()
    if isinstance(backend, str):
        name = _ALIASES.get(backend.strip().lower())
        if name is not None:
            return name
    raise ValueError(f"backend must be one of 'cpu', 'nccl', 'fake' (or 'gloo', None); got {backend!r}")



def backend_kwargs(pg_options: PGOptions | None, kind: str) -> dict[str, Any]:
    """The keywords a ``kind`` ("cpu"/"nccl") backend takes from ``pg_options``: ``config``
    and ``high_priority`` (NCCLOptions), ``transport`` (CPUOptions); only those set."""
    out: dict[str, Any] = {}
    if kind == "nccl" and isinstance(pg_options, NCCLOptions):
        if pg_options.config:
            out["config"] = pg_options.config
        if pg_options.is_high_priority_stream:
            out["high_priority"] = True
    elif kind == "cpu" and isinstance(pg_options, CPUOptions) and pg_options.transport is not None:
        out["transport"] = pg_options.transport
    elif kind == "cpu" and isinstance(pg_options, FakeOptions) and pg_options.error_on_collective:
        out["error_on_collective"] = True  # only "fake" groups accept FakeOptions (coerce_options)
    return out


def make_device_backend(store: Store, rank: int, size: int, *, timeout: float, group_name: str,
                        device_id: int, pg_options: PGOptions | None = None) -> Backend:
    """A group's device backend on ``device_id``, in its own store namespace."""
    return BACKENDS["nccl"](PrefixStore("nccl", store), rank, size, timeout=timeout + _BACKEND_GRACE_S,
                            group_name=group_name, device_id=device_id, **backend_kwargs(pg_options, "nccl"))


def split_device_backend(parent: Backend | None, members: Sequence[int] | None, color: int, *,
                         store: Store, group_name: str, timeout: float,
                         pg_options: PGOptions | None = None) -> Backend | None:
    """The device backend of a new group carved out of ``parent``'s communicator with
    ``ncclCommSplit`` (``dispatch.split_device_backend_of`` calls it for groups bound
    to a device at creation).

    Every rank of the parent group must call it for each new group, in the same order,
    members or not, whenever the parent's device backend can split (see
    ``NCCLBackend.can_split``): NCCL's split is a collective of the parent
    communicator.

    Args:
        members: the new group's members as ranks of the parent, in its rank order;
            None on a rank that joins no new group in this call.
        color: tells apart the disjoint groups one call makes (split_group).
        store: the new group's store (the one its ProcessGroup gets).
        group_name, timeout, pg_options: the new group's.

    Returns:
        The new group's device backend on members; None on non-members, and
        wherever no split is possible (a cpu group, an NCCL without ncclCommSplit):
        the new group then makes its own communicator.
    """
    if not isinstance(parent, SplitsCommunicator) or not parent.can_split:
        return None
    return parent.split(members, color=color, store=PrefixStore("nccl", store), group_name=group_name,
                        timeout=timeout + _BACKEND_GRACE_S, **backend_kwargs(pg_options, "nccl"))
