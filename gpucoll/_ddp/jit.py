"""The bucketed gradient reduction as a pure function of a JAX pytree, so that a jitted
train step can call it: inside ``jax.jit`` each bucket's all_reduce lowers through the
functional API's in-jit path (an XLA custom call, ordered with the program's other
gpucoll calls); outside, it runs on the concrete arrays."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, TypeVar

from .. import functional
from .._collectives import _pg
from .._group import ProcessGroup
from .buckets import compute_bucket_assignment_by_size

__all__ = ["bucketed_all_reduce"]

_MB = 1024 * 1024
T = TypeVar("T")


class _Spec(NamedTuple):
    """What bucketing reads of a leaf (a tracer's device is not known yet)."""

    shape: tuple[int, ...]
    dtype: Any


def bucketed_all_reduce(tree: T, bucket_cap_mb: float = 25, group: ProcessGroup | None = None,
                        average: bool = True) -> T:
    """All-reduce every array of a pytree, packed into buckets of about ``bucket_cap_mb``
    MiB (one dtype each): one collective per bucket instead of one per array.

    Usable inside ``jax.jit`` (the CPU backend's in-jit path) and on concrete JAX arrays.

    Args:
        tree: a pytree of JAX arrays (gradients); the same structure, shapes and dtypes
            on every rank.
        bucket_cap_mb: a bucket's size limit in MiB.
        group: the process group (None: the default group).
        average: divide by the group's size (DDP's average); False gives the sum.

    Returns:
        The reduced pytree, same structure.

    Example:
        >>> @jax.jit
        ... def step(params, batch):
        ...     grads = gpucoll.bucketed_all_reduce(jax.grad(loss)(params, batch))
        ...     return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    """
    import jax
    import jax.numpy as jnp

    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be positive; got {bucket_cap_mb!r}")
    pg = _pg(group)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    specs = [_Spec(tuple(jnp.shape(x)), jnp.result_type(x)) for x in leaves]
    buckets, _ = compute_bucket_assignment_by_size(specs, [int(bucket_cap_mb * _MB)])
    out: list[Any] = [None] * len(leaves)
    size = pg.size()
    for members in buckets:
        flat = jnp.concatenate([jnp.ravel(leaves[i]) for i in members])
        flat = functional.all_reduce(flat, group=pg)
        if average:
            flat = flat / jnp.asarray(size, flat.dtype)
        offset = 0
        for i in members:
            n = math.prod(specs[i].shape)
            out[i] = flat[offset:offset + n].reshape(specs[i].shape)
            offset += n
    return jax.tree_util.tree_unflatten(treedef, out)  # type: ignore[no-any-return]
