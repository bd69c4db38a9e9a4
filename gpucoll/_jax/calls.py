"""gpucoll.functional's ops on JAX tracers: each is one ordered gpucoll primitive call.

Each rank traces its own program, so the rank is a static value here: ops whose result
exists on one rank only (``reduce``, ``gather``) return None elsewhere, as outside jit.
Arguments are checked at trace time, on every rank alike, with the errors outside jit
gives. The layout work around an op (the axis of a gather, the chunks of a scatter) is
JAX code around the call, so XLA fuses it into the program.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .._group import ProcessGroup
from .._reduce_op import PremulSum, ReduceOp, as_reduce_op
from .handler import OPS, group_handle
from .primitive import bind


def _op_index(op: Any, name: str) -> int:
    rop = as_reduce_op(op)
    # A PremulSum is an instance of ReduceOp too (as in torch): refuse it by its own type.
    if isinstance(rop, PremulSum) or not isinstance(rop, ReduceOp) or rop is ReduceOp.PREMUL_SUM:
        raise TypeError(f"gpucoll.functional.{name} inside jax.jit: op={op!r} is not supported; "
                        "use a plain ReduceOp and scale outside the collective")
    return OPS.index(rop)


def _axis(axis: int, ndim: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis!r} is out of range for an array of {ndim} dimension(s)")
    return axis % ndim


def _one(kind: str, x: Any, pg: ProcessGroup, shape: tuple[int, ...] | None = None, *, alias: bool = False,
         **attrs: int | list[int]) -> Any:
    out = bind(kind, [x], {"group": group_handle(pg), **attrs},
               [(x.shape if shape is None else shape, x.dtype)], alias)
    return out[0]


def _all_reduce_call(x: Any, op_index: int, handle: int) -> Any:
    return bind("all_reduce", [x], {"group": handle, "op": op_index}, [(x.shape, x.dtype)], alias=True)[0]


_SUM_WITH_GRAD: list[Any] = []  # the custom_vjp function, built on first use


def _sum_with_grad() -> Any:
    """all_reduce(SUM) with its gradient rule: the cotangent of a sum all_reduce is the
    sum all_reduce of the cotangent (each rank's loss depends on every rank's input)."""
    if not _SUM_WITH_GRAD:
        import jax

        total = OPS.index(ReduceOp.SUM)

        def f(x: Any, handle: int) -> Any:
            return _all_reduce_call(x, total, handle)

        def fwd(x: Any, handle: int) -> tuple[Any, None]:
            return _all_reduce_call(x, total, handle), None

        def bwd(handle: int, _: None, cotangent: Any) -> tuple[Any]:
            return (_all_reduce_call(cotangent, total, handle),)

        g = jax.custom_vjp(f, nondiff_argnums=(1,))
        g.defvjp(fwd, bwd)
        _SUM_WITH_GRAD.append(g)
    return _SUM_WITH_GRAD[0]


def all_reduce(x: Any, op: Any, pg: ProcessGroup) -> Any:
    index = _op_index(op, "all_reduce")
    if OPS[index] is ReduceOp.SUM:
        return _sum_with_grad()(x, group_handle(pg))
    return _all_reduce_call(x, index, group_handle(pg))


def broadcast(x: Any, root: int, pg: ProcessGroup) -> Any:
    return _one("broadcast", x, pg, alias=True, root=root)


def reduce(x: Any, root: int, op: Any, pg: ProcessGroup) -> Any:
    out = _one("reduce", x, pg, alias=True, root=root, op=_op_index(op, "reduce"))
    return out if pg.rank() == root else None


def _joined(stacked: Any, n: int, shape: tuple[int, ...], axis: int) -> Any:
    """A ``(n, *shape)`` stack as one array concatenated along ``axis``."""
    import jax.numpy as jnp

    if not shape:
        return stacked
    k = _axis(axis, len(shape))
    return jnp.concatenate([stacked[i] for i in range(n)], axis=k)


def _stack(x: Any, handle: int, n: int) -> Any:
    """Every rank's ``x`` stacked in rank order: (n, *x.shape)."""
    return bind("all_gather", [x], {"group": handle}, [((n, *x.shape), x.dtype)])[0]


def _sum_chunk(stacked: Any, handle: int) -> Any:
    """This rank's chunk of the sum over ranks of ``stacked`` (n, *chunk): (chunk)."""
    total = OPS.index(ReduceOp.SUM)
    return bind("reduce_scatter", [stacked], {"group": handle, "op": total},
                [(stacked.shape[1:], stacked.dtype)])[0]


_LINEAR: dict[str, Any] = {}  # the custom_vjp functions, built on first use


def _linear_pair() -> tuple[Any, Any]:
    """all_gather and reduce_scatter(SUM) with their gradient rules: each is the other's
    transpose (the global loss is the sum of the ranks' losses, as for all_reduce)."""
    if not _LINEAR:
        import jax

        def gather_fwd(x: Any, handle: int, n: int) -> tuple[Any, None]:
            return _stack(x, handle, n), None

        def gather_bwd(handle: int, n: int, _: None, cotangent: Any) -> tuple[Any]:
            return (_sum_chunk(cotangent, handle),)

        def scatter_fwd(stacked: Any, handle: int, n: int) -> tuple[Any, None]:
            return _sum_chunk(stacked, handle), None

        def scatter_bwd(handle: int, n: int, _: None, cotangent: Any) -> tuple[Any]:
            return (_stack(cotangent, handle, n),)

        stack = jax.custom_vjp(_stack, nondiff_argnums=(1, 2))
        stack.defvjp(gather_fwd, gather_bwd)
        chunk = jax.custom_vjp(lambda v, handle, n: _sum_chunk(v, handle), nondiff_argnums=(1, 2))
        chunk.defvjp(scatter_fwd, scatter_bwd)
        _LINEAR.update(stack=stack, chunk=chunk)
    return _LINEAR["stack"], _LINEAR["chunk"]


def all_gather(x: Any, pg: ProcessGroup, axis: int) -> Any:
    """Every rank's ``x`` stacked in rank order, then joined along ``axis`` as outside jit."""
    n = pg.size()
    if x.shape:
        _axis(axis, len(x.shape))
    return _joined(_linear_pair()[0](x, group_handle(pg), n), n, x.shape, axis)


def _chunked(x: Any, n: int, axis: int, name: str) -> tuple[Any, tuple[int, ...]]:
    """``x`` split into ``n`` chunks along ``axis``, the chunks stacked first: (n, *chunk)."""
    import jax.numpy as jnp

    if not x.shape:
        raise ValueError(f"{name} needs an array with at least one dimension; got a 0-d array")
    k = _axis(axis, len(x.shape))
    if x.shape[k] % n:
        raise ValueError(f"x.shape[{k}]={x.shape[k]} is not divisible by the group size {n}")
    m = x.shape[k] // n
    chunk = x.shape[:k] + (m,) + x.shape[k + 1:]
    parts = jnp.reshape(x, x.shape[:k] + (n, m) + x.shape[k + 1:])
    return jnp.moveaxis(parts, k, 0), chunk


def reduce_scatter(x: Any, op: Any, pg: ProcessGroup, axis: int) -> Any:
    index = _op_index(op, "reduce_scatter")
    staged, chunk = _chunked(x, pg.size(), axis, "reduce_scatter")
    if OPS[index] is ReduceOp.SUM:
        return _linear_pair()[1](staged, group_handle(pg), pg.size())
    return _one("reduce_scatter", staged, pg, chunk, op=index)


def scatter(x: Any, root: int, pg: ProcessGroup, axis: int) -> Any:
    staged, chunk = _chunked(x, pg.size(), axis, "scatter")
    return _one("scatter", staged, pg, chunk, root=root)


def gather(x: Any, root: int, pg: ProcessGroup, axis: int) -> Any:
    n = pg.size()
    if x.shape:
        _axis(axis, len(x.shape))  # a bad axis fails on every rank
    mine = pg.rank() == root
    outs = bind("gather", [x], {"group": group_handle(pg), "root": root},
                [((n, *x.shape), x.dtype)] if mine else [])
    return _joined(outs[0], n, x.shape, axis) if mine else None


def _splits(sizes: Sequence[int] | None, name: str) -> list[int]:
    if sizes is None:
        return []
    out = [int(s) for s in sizes]
    if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in sizes):
        raise ValueError(f"{name} must be non-negative ints; got {sizes!r}")
    return out


def all_to_all_single(x: Any, output_split_sizes: Sequence[int] | None, input_split_sizes: Sequence[int] | None,
                      pg: ProcessGroup) -> Any:
    n = pg.size()
    if not x.shape:
        raise ValueError("all_to_all_single needs an array with at least one dimension; got a 0-d array")
    outs, ins = _splits(output_split_sizes, "output_split_sizes"), _splits(input_split_sizes, "input_split_sizes")
    for name, sizes in (("output_split_sizes", outs), ("input_split_sizes", ins)):
        if sizes and len(sizes) != n:
            raise ValueError(f"{name} must have {n} entries (one per rank); got {len(sizes)}")
    if ins and sum(ins) != x.shape[0]:
        raise ValueError(f"input_split_sizes sum to {sum(ins)}, but x has {x.shape[0]} rows")
    if not ins and x.shape[0] % n:
        raise ValueError(f"x.shape[0]={x.shape[0]} is not divisible by the group size {n}")
    rows = sum(outs) if outs else x.shape[0]
    attrs: dict[str, Any] = {"group": group_handle(pg)}
    attrs.update((k, v) for k, v in (("out_splits", outs), ("in_splits", ins)) if v)  # none: equal splits
    return bind("all_to_all_single", [x], attrs, [((rows, *x.shape[1:]), x.dtype)])[0]


def send(x: Any, peer: int, tag: int, pg: ProcessGroup) -> None:
    bind("send", [x], {"group": group_handle(pg), "peer": peer, "tag": tag}, [])


def recv(x: Any, peer: int | None, tag: int, pg: ProcessGroup) -> Any:
    return _one("recv", x, pg, peer=-1 if peer is None else peer, tag=tag)


def barrier(x: Any, pg: ProcessGroup) -> Any:
    return _one("barrier", x, pg, alias=True)
