"""Out-of-place collectives: each returns a new array of the caller's own type.

For arrays that cannot be written in place (JAX arrays are immutable), or when the
input must stay untouched. A NumPy array in gives a NumPy array out; a JAX array
gives a JAX array (through DLPack, zero-copy where JAX accepts the memory); a
PyTorch tensor gives a tensor; a CuPy array a CuPy array (device arrays of other
frameworks are allocated with CuPy and handed over through DLPack).

Inputs need not be contiguous: a non-contiguous input is copied to a contiguous
one first (the in-place API raises instead). Every function is a collective: all
ranks of the group call it with matching arrays.

Inside ``jax.jit`` on the CPU backend, every single-array function here (and
:func:`barrier`) lowers to an XLA FFI custom call (``gpucoll._jax``) that runs the
group's op on XLA's own buffers, ordered with the program's other gpucoll calls. The
list functions (:func:`all_reduce_coalesced`, :func:`all_to_all`) raise a TypeError on
a JAX tracer: call them on concrete arrays between jitted functions (docs/arrays.md,
"inside jit").

Example:
    >>> import jax.numpy as jnp, gpucoll.functional as F
    >>> y = F.all_reduce(jnp.ones(4) * gpucoll.get_rank())   # a jax.Array
"""

from __future__ import annotations

import dataclasses
import array as _pyarray
from typing import Any, Sequence, TypeVar, Union, overload

import numpy as np

from . import array as _array
from ._buffer import Buffer, DType
from ._collectives import _group_rank, _pg
from ._group import ProcessGroup
from ._reduce_op import ReduceOp, ReduceOpLike
from .array import ArrayLike

#: Host memory through the buffer protocol: its result comes back as a NumPy array.
HostBytes = Union[bytes, bytearray, memoryview, "_pyarray.array[Any]"]
#: An array of the caller's framework: the result is an array of the same type.
ArrayT = TypeVar("ArrayT", bound=ArrayLike)
_T = TypeVar("_T")

__all__ = ["all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "reduce_scatter",
           "all_to_all_single", "all_to_all", "gather", "scatter", "send", "recv", "barrier"]


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


def _traced(x: Any) -> bool:
    return type(x).__module__.split(".", 1)[0] == "jax" and "Tracer" in type(x).__name__


def _not_traced(x: Any, name: str) -> None:
    if _traced(x):
        import inspect

        op = next((f.function for f in inspect.stack()[1:] if f.function in __all__ and f.filename == __file__),
                  "collective")
        raise TypeError(
            f"gpucoll.functional.{op}: {name} is a JAX tracer ({type(x).__name__}), i.e. the call is "
            "inside jax.jit, vmap or grad, where arrays have no memory yet. gpucoll collectives run "
            "on concrete arrays: call them between jitted functions, e.g. "
            "y = F.all_reduce(step1(x)); z = step2(y) with step1/step2 jitted (docs/arrays.md)")


def _input(x: Any, name: str) -> tuple[Any, Buffer]:
    _not_traced(x, name)
    try:
        return x, _array.as_buffer(x, name=name)
    except _array.NotContiguousError:
        y = _contiguous(x)  # documented: the functional API copies non-contiguous input
        return y, _array.as_buffer(y, name=name)


def _axis(axis: int, ndim: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis!r} is out of range for an array of {ndim} dimension(s)")
    return axis % ndim


@overload
def all_reduce(x: HostBytes, op: ReduceOpLike = ReduceOp.SUM, group: ProcessGroup | None = None) -> np.ndarray[Any, Any]: ...


@overload
def all_reduce(x: ArrayT, op: ReduceOpLike = ReduceOp.SUM, group: ProcessGroup | None = None) -> ArrayT: ...


def all_reduce(x: ArrayLike, op: ReduceOpLike = ReduceOp.SUM, group: ProcessGroup | None = None) -> object:
    """Return the reduction of ``x`` over the group (``x`` is not modified).

    Example:
        >>> y = F.all_reduce(jnp.arange(4.0), op=gpucoll.ReduceOp.MAX)
    """
    pg = _pg(group)
    if _traced(x):
        from ._jax import calls

        return calls.all_reduce(x, op, pg)
    _, src = _input(x, "x")
    out, dst = _array.new_output(x, src.shape, src.dtype)
    pg._all_reduce_into(dst, src, op)  # out of place where the backend can (NCCL): no copy
    return _array.to_caller_type(out, x, src.dtype)


def all_reduce_coalesced(xs: Sequence[ArrayLike], op: ReduceOpLike = ReduceOp.SUM, group: ProcessGroup | None = None) -> list[Any]:
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


@overload
def broadcast(x: HostBytes, src: int | None = None, group: ProcessGroup | None = None,
              group_src: int | None = None) -> np.ndarray[Any, Any]: ...


@overload
def broadcast(x: ArrayT, src: int | None = None, group: ProcessGroup | None = None,
              group_src: int | None = None) -> ArrayT: ...


def broadcast(x: ArrayLike, src: int | None = None, group: ProcessGroup | None = None,
              group_src: int | None = None) -> object:
    """Return rank ``src``'s ``x`` on every rank (``x`` gives the shape and dtype elsewhere)."""
    pg = _pg(group)
    root = _group_rank(pg, src, group_src, "src")
    if _traced(x):
        from ._jax import calls

        return calls.broadcast(x, root, pg)
    _, inp = _input(x, "x")
    out, dst = _array.new_output(x, inp.shape, inp.dtype)
    if pg.rank() == root:
        _array.copy_buffer(dst, inp)
    pg.broadcast(dst, root)
    return _array.to_caller_type(out, x, inp.dtype)


@overload
def reduce(x: HostBytes, dst: int | None = None, op: ReduceOpLike = ReduceOp.SUM, group: ProcessGroup | None = None,
           group_dst: int | None = None) -> np.ndarray[Any, Any] | None: ...


@overload
def reduce(x: ArrayT, dst: int | None = None, op: ReduceOpLike = ReduceOp.SUM, group: ProcessGroup | None = None,
           group_dst: int | None = None) -> ArrayT | None: ...


def reduce(x: ArrayLike, dst: int | None = None, op: ReduceOpLike = ReduceOp.SUM, group: ProcessGroup | None = None,
           group_dst: int | None = None) -> object:
    """Return the reduction of ``x`` over the group on rank ``dst``; None on other ranks."""
    pg = _pg(group)
    root = _group_rank(pg, dst, group_dst, "dst")
    if _traced(x):
        from ._jax import calls

        return calls.reduce(x, root, op, pg)
    _, src = _input(x, "x")
    out, buf = _array.new_output(x, src.shape, src.dtype)
    _array.copy_buffer(buf, src)
    pg.reduce(buf, root, op)
    return _array.to_caller_type(out, x, src.dtype) if pg.rank() == root else None


@overload
def all_gather(x: HostBytes, group: ProcessGroup | None = None, axis: int = 0) -> np.ndarray[Any, Any]: ...


@overload
def all_gather(x: ArrayT, group: ProcessGroup | None = None, axis: int = 0) -> ArrayT: ...


def all_gather(x: ArrayLike, group: ProcessGroup | None = None, axis: int = 0) -> object:
    """Return every rank's ``x`` concatenated along ``axis``, in rank order.

    A 0-d ``x`` gives a 1-d result of group-size elements.
    """
    pg = _pg(group)
    if _traced(x):
        from ._jax import calls

        return calls.all_gather(x, pg, axis)
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


@overload
def reduce_scatter(x: HostBytes, op: ReduceOpLike = ReduceOp.SUM, group: ProcessGroup | None = None, axis: int = 0) -> np.ndarray[Any, Any]: ...


@overload
def reduce_scatter(x: ArrayT, op: ReduceOpLike = ReduceOp.SUM, group: ProcessGroup | None = None, axis: int = 0) -> ArrayT: ...


def reduce_scatter(x: ArrayLike, op: ReduceOpLike = ReduceOp.SUM, group: ProcessGroup | None = None, axis: int = 0) -> object:
    """Reduce ``x`` over the group and return this rank's chunk of the result along ``axis``.

    Raises:
        ValueError: ``x.shape[axis]`` is not divisible by the group size.
    """
    pg = _pg(group)
    if _traced(x):
        from ._jax import calls

        return calls.reduce_scatter(x, op, pg, axis)
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


@overload
def all_to_all_single(x: HostBytes, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None,
                      group: ProcessGroup | None = None) -> np.ndarray[Any, Any]: ...


@overload
def all_to_all_single(x: ArrayT, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None,
                      group: ProcessGroup | None = None) -> ArrayT: ...


def all_to_all_single(x: ArrayLike, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None,
                      group: ProcessGroup | None = None) -> object:
    """Split ``x`` along dim 0 (``input_split_sizes`` rows per rank, default equal), exchange,
    and return the concatenation of what arrived (``output_split_sizes`` rows per rank)."""
    pg = _pg(group)
    if _traced(x):
        from ._jax import calls

        return calls.all_to_all_single(x, output_split_sizes, input_split_sizes, pg)
    _, inp = _input(x, "x")
    if not inp.shape:
        raise ValueError("all_to_all_single needs an array with at least one dimension; got a 0-d array")
    rows = sum(output_split_sizes) if output_split_sizes else inp.shape[0]
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"output_split_sizes must be non-negative ints; got {output_split_sizes!r}")
    out, dst = _array.new_output(x, (rows, *inp.shape[1:]), inp.dtype)
    pg.all_to_all_single(dst, inp, output_split_sizes, input_split_sizes)
    return _array.to_caller_type(out, x, inp.dtype)


def _pieces(buf: Buffer, n: int) -> list[Buffer]:
    """``buf`` (a contiguous ``(n, *shape)`` array) as ``n`` Buffers of one ``shape`` each."""
    step = buf.nbytes // n
    return [dataclasses.replace(buf, ptr=buf.ptr + i * step, nbytes=step, shape=buf.shape[1:])
            for i in range(n)]


def _joined(out: Any, n: int, shape: tuple[int, ...], axis: int) -> Any:
    """The ``(n, *shape)`` result of a gather as one array concatenated along ``axis``."""
    if not shape:
        return out
    k = _axis(axis, len(shape))
    if k:
        xp = _namespace(out)
        out = xp.ascontiguousarray(xp.moveaxis(out, 0, k))
    joined = list(shape)
    joined[k] *= n
    return out.reshape(joined)


@overload
def gather(x: HostBytes, dst: int | None = None, group: ProcessGroup | None = None,
           group_dst: int | None = None, axis: int = 0) -> np.ndarray[Any, Any] | None: ...


@overload
def gather(x: ArrayT, dst: int | None = None, group: ProcessGroup | None = None,
           group_dst: int | None = None, axis: int = 0) -> ArrayT | None: ...


def gather(x: ArrayLike, dst: int | None = None, group: ProcessGroup | None = None,
           group_dst: int | None = None, axis: int = 0) -> object:
    """Return every rank's ``x`` concatenated along ``axis`` on rank ``dst``; None elsewhere.

    Example:
        >>> g = F.gather(jnp.full(2, gpucoll.get_rank()), dst=0)   # rank 0 of 3: [0 0 1 1 2 2]
    """
    pg = _pg(group)
    root = _group_rank(pg, dst, group_dst, "dst")
    if _traced(x):
        from ._jax import calls

        return calls.gather(x, root, pg, axis)
    n = pg.size()
    _, inp = _input(x, "x")
    if inp.shape:
        _axis(axis, len(inp.shape))  # a bad axis fails on every rank, before any data moves
    if pg.rank() != root:
        pg.gather(inp, None, root)
        return None
    out, buf = _array.new_output(x, (n, *inp.shape), inp.dtype)
    pg.gather(inp, _pieces(buf, n), root)
    return _array.to_caller_type(_joined(out, n, inp.shape, axis), x, inp.dtype)


@overload
def scatter(x: HostBytes, src: int | None = None, group: ProcessGroup | None = None,
            group_src: int | None = None, axis: int = 0) -> np.ndarray[Any, Any]: ...


@overload
def scatter(x: ArrayT, src: int | None = None, group: ProcessGroup | None = None,
            group_src: int | None = None, axis: int = 0) -> ArrayT: ...


def scatter(x: ArrayLike, src: int | None = None, group: ProcessGroup | None = None,
            group_src: int | None = None, axis: int = 0) -> object:
    """Split rank ``src``'s ``x`` into group-size chunks along ``axis``; return this rank's chunk.

    Every rank passes an ``x`` of the same shape and dtype (only rank ``src``'s values
    are read), as :func:`broadcast`.

    Raises:
        ValueError: ``x`` is 0-d, or ``x.shape[axis]`` is not divisible by the group size.

    Example:
        >>> part = F.scatter(jnp.arange(6.0), src=0)   # rank r of 3 gets [2r, 2r+1]
    """
    pg = _pg(group)
    root = _group_rank(pg, src, group_src, "src")
    if _traced(x):
        from ._jax import calls

        return calls.scatter(x, root, pg, axis)
    n = pg.size()
    _, inp = _input(x, "x")
    if not inp.shape:
        raise ValueError("scatter needs an array with at least one dimension; got a 0-d array")
    k = _axis(axis, len(inp.shape))
    if inp.shape[k] % n:
        raise ValueError(f"x.shape[{k}]={inp.shape[k]} is not divisible by the group size {n}")
    m = inp.shape[k] // n
    chunk = inp.shape[:k] + (m,) + inp.shape[k + 1:]
    out, dst = _array.new_output(x, chunk, inp.dtype)
    parts = None
    if pg.rank() == root:
        staged = inp
        if k:  # bring each rank's chunk of axis k to the front, so that it is contiguous
            view = _array.xp_view(inp)
            xp = _namespace(view)
            moved = xp.ascontiguousarray(xp.moveaxis(view.reshape(inp.shape[:k] + (n, m) + inp.shape[k + 1:]), k, 0))
            staged = _retyped(_array.as_buffer(moved, name="x"), inp.dtype)
        whole = dataclasses.replace(staged, shape=(n, *chunk))
        parts = _pieces(whole, n)
    pg.scatter(dst, parts, root)
    return _array.to_caller_type(out, x, inp.dtype)


def all_to_all(xs: Sequence[ArrayLike], group: ProcessGroup | None = None) -> list[Any]:
    """Send ``xs[j]`` to rank j; return the list whose i-th array came from rank i.

    The i-th result has the shape and dtype of ``xs[i]`` (rank i's ``xs[j]`` must match
    rank j's ``xs[i]``). For one array split by rows, with per-rank sizes, see
    :func:`all_to_all_single`.
    """
    pg = _pg(group)
    n = pg.size()
    if len(xs) != n:
        raise ValueError(f"xs must have {n} arrays (one per rank); got {len(xs)}")
    ins, outs, bufs = [], [], []
    for i, x in enumerate(xs):
        _, b = _input(x, f"xs[{i}]")
        out, buf = _array.new_output(x, b.shape, b.dtype)
        ins.append(b)
        outs.append(out)
        bufs.append(buf)
    pg.all_to_all(bufs, ins)
    return [_array.to_caller_type(o, x, b.dtype) for o, x, b in zip(outs, xs, ins)]


def send(x: ArrayLike, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    """Send ``x`` to rank ``dst`` and wait until it is sent (``x`` is not modified)."""
    pg = _pg(group)
    peer = _group_rank(pg, dst, group_dst, "dst")
    if _traced(x):
        from ._jax import calls

        return calls.send(x, peer, tag, pg)
    _, inp = _input(x, "x")
    pg.send(inp, peer, tag, async_op=False)


@overload
def recv(x: HostBytes, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
         group_src: int | None = None) -> np.ndarray[Any, Any]: ...


@overload
def recv(x: ArrayT, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
         group_src: int | None = None) -> ArrayT: ...


def recv(x: ArrayLike, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
         group_src: int | None = None) -> object:
    """Return what rank ``src`` sent, as a new array shaped like ``x`` (``x`` gives the
    shape, dtype and framework; its values are not read). ``src=None`` takes any rank;
    :func:`gpucoll.recv` also tells which.

    Example:
        >>> if gpucoll.get_rank() == 1:
        ...     y = F.recv(jnp.zeros(4), src=0)      # a new jax.Array
    """
    pg = _pg(group)
    peer = None if src is None and group_src is None else _group_rank(pg, src, group_src, "src")
    if _traced(x):
        from ._jax import calls

        return calls.recv(x, peer, tag, pg)
    try:
        like = _array.as_buffer(x, name="x")
    except _array.NotContiguousError:
        like = _array.as_buffer(_contiguous(x), name="x")
    out, dst = _array.new_output(x, like.shape, like.dtype)
    pg.recv(dst, peer, tag, async_op=False)
    return _array.to_caller_type(out, x, like.dtype)


def barrier(x: _T | None = None, group: ProcessGroup | None = None) -> _T | None:
    """Wait until every rank of the group has called barrier, then return ``x``.

    Inside ``jax.jit`` the barrier is one of the program's ordered gpucoll calls and ``x``
    (a value computed before it) comes out of it, so what uses the result runs after it.
    """
    pg = _pg(group)
    if _traced(x):
        from ._jax import calls

        carried: _T | None = calls.barrier(x, pg)
        return carried
    pg.barrier()
    return x


def _namespace(arr: Any) -> Any:
    if isinstance(arr, np.ndarray):
        return np
    import cupy

    return cupy


def _retyped(buf: Buffer, dtype: DType) -> Buffer:
    # A staged CuPy copy of bfloat16/float8 data has an unsigned-integer dtype of the same
    # width; its bytes are the caller's dtype all the same.
    return buf if buf.dtype == dtype else dataclasses.replace(buf, dtype=dtype)
