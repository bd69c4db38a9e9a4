"""Out-of-place collectives: each returns a new array of the caller's own type.

For arrays that cannot be written in place (JAX arrays are immutable), or when the
input must stay untouched. A NumPy array in gives a NumPy array out; a JAX array
gives a JAX array (through DLPack, zero-copy where JAX accepts the memory); a
PyTorch tensor gives a tensor; a CuPy array a CuPy array (device arrays of other
frameworks are allocated with CuPy and handed over through DLPack).

Inputs need not be contiguous: a non-contiguous input is copied to a contiguous
one first (the in-place API raises instead). Every function is a collective: all
ranks of the group call it with matching arrays.

Example:
    >>> import jax.numpy as jnp, gpucoll.functional as F
    >>> y = F.all_reduce(jnp.ones(4) * gpucoll.get_rank())   # a jax.Array
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from . import array as _array
from ._buffer import Buffer, DType
from ._collectives import _group_rank, _pg
from ._group import ProcessGroup
from ._reduce_op import ReduceOp

__all__ = ["all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "reduce_scatter",
           "all_to_all_single"]


def _contiguous(x: Any) -> Any:
    module = type(x).__module__.split(".", 1)[0]
    if isinstance(x, np.ndarray) or isinstance(x, memoryview):
        return np.ascontiguousarray(x)
    if module == "torch":
        return x.contiguous()
    if module == "cupy":
        import cupy

        return cupy.ascontiguousarray(x)
    if module in ("jax", "jaxlib"):
        return np.ascontiguousarray(np.asarray(x))
    raise TypeError(f"cannot make a contiguous copy of a non-contiguous {type(x).__name__}")


def _input(x: Any, name: str) -> tuple[Any, Buffer]:
    try:
        return x, _array.as_buffer(x, name=name)
    except _array.NotContiguousError:
        y = _contiguous(x)  # documented: the functional API copies non-contiguous input
        return y, _array.as_buffer(y, name=name)


def _axis(axis: int, ndim: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis!r} is out of range for an array of {ndim} dimension(s)")
    return axis % ndim


def all_reduce(x: Any, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None) -> Any:
    """Return the reduction of ``x`` over the group (``x`` is not modified).

    Example:
        >>> y = F.all_reduce(jnp.arange(4.0), op=gpucoll.ReduceOp.MAX)
    """
    pg = _pg(group)
    _, src = _input(x, "x")
    out, dst = _array.new_output(x, src.shape, src.dtype)
    pg._all_reduce_into(dst, src, op)  # out of place where the backend can (NCCL): no copy
    return _array.to_caller_type(out, x, src.dtype)


def all_reduce_coalesced(xs: Sequence[Any], op: Any = ReduceOp.SUM, group: ProcessGroup | None = None) -> list[Any]:
    """Return the reductions of every array of ``xs``, as one op."""
    pg = _pg(group)
    outs, dsts, dtypes = [], [], []
    for i, x in enumerate(xs):
        _, src = _input(x, f"xs[{i}]")
        out, dst = _array.new_output(x, src.shape, src.dtype)
        _array.copy_buffer(dst, src)
        outs.append(out)
        dsts.append(dst)
        dtypes.append(src.dtype)
    pg.all_reduce_coalesced(dsts, op)
    return [_array.to_caller_type(o, x, d) for o, x, d in zip(outs, xs, dtypes)]


def broadcast(x: Any, src: int | None = None, group: ProcessGroup | None = None,
              group_src: int | None = None) -> Any:
    """Return rank ``src``'s ``x`` on every rank (``x`` gives the shape and dtype elsewhere)."""
    pg = _pg(group)
    root = _group_rank(pg, src, group_src, "src")
    _, inp = _input(x, "x")
    out, dst = _array.new_output(x, inp.shape, inp.dtype)
    if pg.rank() == root:
        _array.copy_buffer(dst, inp)
    pg.broadcast(dst, root)
    return _array.to_caller_type(out, x, inp.dtype)


def reduce(x: Any, dst: int | None = None, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None,
           group_dst: int | None = None) -> Any:
    """Return the reduction of ``x`` over the group on rank ``dst``; None on other ranks."""
    pg = _pg(group)
    root = _group_rank(pg, dst, group_dst, "dst")
    _, src = _input(x, "x")
    out, buf = _array.new_output(x, src.shape, src.dtype)
    _array.copy_buffer(buf, src)
    pg.reduce(buf, root, op)
    return _array.to_caller_type(out, x, src.dtype) if pg.rank() == root else None


def all_gather(x: Any, group: ProcessGroup | None = None, axis: int = 0) -> Any:
    """Return every rank's ``x`` concatenated along ``axis``, in rank order.

    A 0-d ``x`` gives a 1-d result of group-size elements.
    """
    pg = _pg(group)
    n = pg.size()
    _, inp = _input(x, "x")
    out, dst = _array.new_output(x, (n, *inp.shape), inp.dtype)
    pg.all_gather_single(dst, inp)
    if inp.shape:
        k = _axis(axis, len(inp.shape))
        if k:
            xp = _namespace(out)
            out = xp.ascontiguousarray(xp.moveaxis(out, 0, k))
        shape = list(inp.shape)
        shape[k] *= n
        out = out.reshape(shape)
    return _array.to_caller_type(out, x, inp.dtype)


def reduce_scatter(x: Any, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None, axis: int = 0) -> Any:
    """Reduce ``x`` over the group and return this rank's chunk of the result along ``axis``.

    Raises:
        ValueError: ``x.shape[axis]`` is not divisible by the group size.
    """
    pg = _pg(group)
    n = pg.size()
    x_c, inp = _input(x, "x")
    if not inp.shape:
        raise ValueError("reduce_scatter needs an array with at least one dimension; got a 0-d array")
    k = _axis(axis, len(inp.shape))
    if inp.shape[k] % n:
        raise ValueError(f"x.shape[{k}]={inp.shape[k]} is not divisible by the group size {n}")
    m = inp.shape[k] // n
    dtype = inp.dtype
    out_shape = inp.shape[:k] + (m,) + inp.shape[k + 1:]
    if k:
        # Bring the chunks of axis k to the front so that each rank's chunk is contiguous.
        view = _array.xp_view(inp)
        xp = _namespace(view)
        parts = view.reshape(inp.shape[:k] + (n, m) + inp.shape[k + 1:])
        staged = xp.ascontiguousarray(xp.moveaxis(parts, k, 0))
        inp = _retyped(_array.as_buffer(staged, name="x"), dtype)
    out, dst = _array.new_output(x, out_shape, dtype)
    pg.reduce_scatter_single(dst, inp, op)
    return _array.to_caller_type(out, x, dtype)


def all_to_all_single(x: Any, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None,
                      group: ProcessGroup | None = None) -> Any:
    """Split ``x`` along dim 0 (``input_split_sizes`` rows per rank, default equal), exchange,
    and return the concatenation of what arrived (``output_split_sizes`` rows per rank)."""
    pg = _pg(group)
    _, inp = _input(x, "x")
    if not inp.shape:
        raise ValueError("all_to_all_single needs an array with at least one dimension; got a 0-d array")
    rows = sum(output_split_sizes) if output_split_sizes else inp.shape[0]
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"output_split_sizes must be non-negative ints; got {output_split_sizes!r}")
    out, dst = _array.new_output(x, (rows, *inp.shape[1:]), inp.dtype)
    pg.all_to_all_single(dst, inp, output_split_sizes, input_split_sizes)
    return _array.to_caller_type(out, x, inp.dtype)


def _namespace(arr: Any) -> Any:
    if isinstance(arr, np.ndarray):
        return np
    import cupy

    return cupy


def _retyped(buf: Buffer, dtype: DType) -> Buffer:
    # A staged CuPy copy of bfloat16/float8 data has an unsigned-integer dtype of the same
    # width; its bytes are the caller's dtype all the same.
    return buf if buf.dtype == dtype else dataclasses.replace(buf, dtype=dtype)
