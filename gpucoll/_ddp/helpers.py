"""The two helpers DDP starts with: ``broadcast_coalesced`` (rank 0's parameters to
everyone, in few large broadcasts) and ``verify_params_across_processes`` (every rank
has the same parameter shapes and dtypes)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .. import _collectives, _objects
from .._collectives import _pg
from .._group import ProcessGroup
from ..errors import ParameterMismatchError
from . import kinds
from .buckets import compute_bucket_assignment_by_size

__all__ = ["broadcast_coalesced", "verify_params_across_processes", "describe"]


def describe(a: Any) -> str:
    """``shape dtype`` of an array, as messages print it."""
    return f"{tuple(int(d) for d in a.shape)} {np.dtype(a.dtype).name}"


def verify_params_across_processes(group: ProcessGroup | None, params: Sequence[Any], *,
                                   names: Sequence[str] | None = None) -> None:
    """Check that every rank of ``group`` has the same number of parameters with the same
    shapes and dtypes (torch's ``dist._verify_params_across_processes``).

    One all_gather of the ranks' descriptions (bounded by the group's timeout).

    Args:
        group: the process group (None: the default group).
        params: this rank's parameters (arrays, or anything with shape and dtype).
        names: a name per parameter for the message (default: ``parameter i``).

    Raises:
        ParameterMismatchError: the ranks differ; the message names each differing
            parameter with every rank's shape and dtype.

    Example:
        >>> gpucoll.verify_params_across_processes(None, params)
    """
    pg = _pg(group)
    mine = [describe(p) for p in params]
    everyone: list[Any] = [None] * pg.size()
    _objects.all_gather_object(everyone, mine, group=pg)
    if all(theirs == mine for theirs in everyone):
        return
    label = list(names) if names is not None else [f"parameter {i}" for i in range(len(mine))]
    counts = [len(theirs) for theirs in everyone]
    problems: list[str] = []
    if len(set(counts)) > 1:
        problems.append("parameter counts by rank: " + ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts)))
    for i in range(max(counts)):
        seen = [theirs[i] if i < len(theirs) else "absent" for theirs in everyone]
        if len(set(seen)) > 1:
            name = label[i] if i < len(label) else f"parameter {i}"
            problems.append(f"{name}: " + ", ".join(f"rank {r} {s}" for r, s in enumerate(seen)))
    shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
    raise ParameterMismatchError(
        "DDP expects same model across all ranks, but the ranks' parameters differ "
        f"(verify_params_across_processes on rank {pg.rank()}): " + "; ".join(shown))


def broadcast_coalesced(group: ProcessGroup | None, arrays: Sequence[Any], buffer_size: int,
                        src: int = 0) -> None:
    """Copy rank ``src``'s ``arrays`` into every rank's ``arrays``, in place, packing them
    into flat buffers of about ``buffer_size`` bytes (one broadcast each), as torch's
    ``dist._broadcast_coalesced`` does with DDP's parameters and buffers at start-up.

    Arrays are grouped by dtype and device with the bucket rules
    (:func:`compute_bucket_assignment_by_size`); an array bigger than ``buffer_size``
    goes alone.

    Args:
        group: the process group (None: the default group).
        arrays: writable NumPy or CuPy arrays, the same shapes and dtypes on every rank.
        buffer_size: bytes per broadcast.
        src: the group rank whose arrays everyone gets (torch's default 0).

    Raises:
        ValueError: ``buffer_size`` not positive, ``src`` out of range.
        DistBackendError: a broadcast failed or timed out (e.g. the ranks' arrays differ).

    Example:
        >>> gpucoll.broadcast_coalesced(None, params, 250 * 1024 * 1024)
    """
    pg = _pg(group)
    if isinstance(buffer_size, bool) or int(buffer_size) <= 0:
        raise ValueError(f"broadcast_coalesced: buffer_size must be a positive number of bytes; got {buffer_size!r}")
    if not 0 <= src < pg.size():
        raise ValueError(f"broadcast_coalesced: src={src} is out of range for a group of {pg.size()} ranks")
    arrays = list(arrays)
    if not arrays:
        return
    buckets, _ = compute_bucket_assignment_by_size(arrays, [int(buffer_size)])
    for members in buckets:
        if len(members) == 1:
            a = arrays[members[0]]
            if getattr(a, "flags", None) is not None and a.flags.c_contiguous:
                _collectives.broadcast(a, group=pg, group_src=src)
                continue
        xp = kinds.namespace(arrays[members[0]])
        flat = xp.concatenate([xp.asarray(arrays[i]).reshape(-1) for i in members])
        _collectives.broadcast(flat, group=pg, group_src=src)
        if pg.rank() == src:
            continue
        offset = 0
        for i in members:
            a = arrays[i]
            n = int(np.prod(a.shape, dtype=np.int64))
            a[...] = flat[offset:offset + n].reshape(a.shape)
            offset += n
