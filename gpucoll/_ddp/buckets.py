"""Assigning gradients to buckets by size, with the rules of torch's Reducer
(``torch.distributed._compute_bucket_assignment_by_size``, c10d's reducer.cpp):

* a bucket holds arrays of one dtype on one device;
* arrays are taken in order; a bucket is closed as soon as its size reaches its limit;
* the limits are consumed in order, per (dtype, device): the first bucket of each kind
  gets ``bucket_size_limits[0]`` (DDP's small first bucket), the next one the next
  limit, and the last limit is reused from then on;
* an array expected to produce a sparse gradient gets a bucket of its own (limit 0);
* without ``tensor_indices`` the buckets are sorted by the smallest index they hold;
  with them (the order gradients arrived in) the order of closing is kept.

torch walks its open buckets out of a hash map at the end, so the order of the
still-open buckets is unspecified there when ``tensor_indices`` is given and several
(dtype, device) kinds are open; here it is the order in which each kind first appeared.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["compute_bucket_assignment_by_size", "array_key", "array_nbytes"]


def array_key(a: Any) -> tuple[str, str]:
    """(dtype, device) of an array: what a bucket must hold only one of."""
    return (np.dtype(a.dtype).name, _device(a))


def _device(a: Any) -> str:
    if isinstance(a, np.ndarray):
        return "cpu"
    try:
        device = getattr(a, "device", None)
        if callable(device):  # older JAX: .device() is a method
            device = device()
    except Exception:  # a JAX tracer or shape spec has no device yet: its program has one
        return "traced"
    return "cpu" if device is None else str(device)


def array_nbytes(a: Any) -> int:
    """Bytes of an array's data (size x itemsize), from its shape and dtype only."""
    return int(np.prod(a.shape, dtype=np.int64)) * int(np.dtype(a.dtype).itemsize)


def compute_bucket_assignment_by_size(
    arrays: Sequence[Any],
    bucket_size_limits: Sequence[int],
    expect_sparse_gradient: Sequence[bool] | None = None,
    tensor_indices: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """Group ``arrays`` into buckets of at most about ``bucket_size_limits`` bytes each.

    Same rules and result as torch's ``dist._compute_bucket_assignment_by_size`` (see the
    module's docstring). Only ``shape`` and ``dtype`` (and ``device`` where present) are
    read, so NumPy, CuPy and JAX arrays, and ``jax.ShapeDtypeStruct`` all work.

    Args:
        arrays: the parameters (or gradients), in the order to bucket them.
        bucket_size_limits: limits in bytes, used in turn; the last one is reused.
        expect_sparse_gradient: one flag per array (indexed by the array's index): a
            flagged array gets a bucket of its own.
        tensor_indices: the index to record for ``arrays[i]`` (the order gradients
            arrived in, when rebuilding); the buckets are then not sorted.

    Returns:
        ``(bucket_indices, per_bucket_size_limits)``: the array indices of each bucket,
        and each bucket's limit (0 for a sparse array's own bucket).

    Raises:
        ValueError: no arrays, no limits, a non-positive limit, or lists of the wrong length.

    Example:
        >>> compute_bucket_assignment_by_size([np.empty(10, np.float32)] * 4, [40, 80])
        ([[0], [1, 2], [3]], [40, 80, 80])
    """
    if len(arrays) == 0:
        raise ValueError("compute_bucket_assignment_by_size: arrays is empty; expected at least one array")
    limits = [int(x) for x in bucket_size_limits]
    if not limits or any(x <= 0 for x in limits):
        raise ValueError(f"bucket_size_limits must be a non-empty list of positive byte counts; got {limits}")
    if expect_sparse_gradient is not None and len(expect_sparse_gradient) not in (0, len(arrays)):
        raise ValueError(f"expect_sparse_gradient has {len(expect_sparse_gradient)} entries for "
                         f"{len(arrays)} arrays; expected one per array")
    if tensor_indices is not None and len(tensor_indices) not in (0, len(arrays)):
        raise ValueError(f"tensor_indices has {len(tensor_indices)} entries for {len(arrays)} arrays; "
                         "expected one per array")
    sparse = list(expect_sparse_gradient or ())
    indices = list(tensor_indices or ())

    result: list[tuple[list[int], int]] = []
    open_buckets: dict[tuple[str, str], tuple[list[int], int, int]] = {}  # key -> (indices, size, limit)
    next_limit: dict[tuple[str, str], int] = {}  # key -> position in limits
    for i, a in enumerate(arrays):
        index = indices[i] if indices else i
        if sparse and sparse[index]:
            result.append(([index], 0))
            continue
        key = array_key(a)
        members, size, _ = open_buckets.get(key, ([], 0, 0))
        members.append(index)
        size += array_nbytes(a)
        position = next_limit.setdefault(key, 0)
        limit = limits[position]
        if size >= limit:
            result.append((members, limit))
            open_buckets[key] = ([], 0, limit)  # kept in place: the open buckets' order is first appearance
            next_limit[key] = min(position + 1, len(limits) - 1)
        else:
            open_buckets[key] = (members, size, limit)
    result.extend((members, limit) for members, _, limit in open_buckets.values() if members)
    if not indices:
        result.sort(key=lambda bucket: min(bucket[0]))
    return [b for b, _ in result], [limit for _, limit in result]
