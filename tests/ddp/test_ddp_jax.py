"""The Reducer on a JAX pytree, and bucketed_all_reduce inside and outside jax.jit, on
the CPU backend, against NumPy."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpucoll.testing import run_spmd

from _fake_arrays import skip_without_jax

SHAPES = {"dense": {"w": (16, 8), "b": (8,)}, "out": {"w": (8, 3), "b": (3,)}, "scale": ()}


def tree_of(rank: int, it: int) -> dict[str, Any]:
    rng = np.random.default_rng(100 * it + rank)
    return {"dense": {"w": rng.standard_normal((16, 8)).astype(np.float32), "b": rng.standard_normal(8).astype(np.float32)},
            "out": {"w": rng.standard_normal((8, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)},
            "scale": np.float32(rng.standard_normal())}


def jax_body() -> str:
    import jax
    import jax.numpy as jnp

    import gpucoll

    r, w = gpucoll.get_rank(), gpucoll.get_world_size()

    def mean(it: int) -> Any:
        trees = [tree_of(k, it) for k in range(w)]
        return jax.tree.map(lambda *xs: np.mean([np.float64(x) for x in xs], axis=0), *trees)

    def same(got: Any, want: Any, rtol: float) -> None:
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert isinstance(g, jax.Array), type(g)
            np.testing.assert_allclose(np.asarray(g, np.float64), x, rtol=rtol, atol=1e-6)

    params = jax.tree.map(lambda x: jnp.zeros_like(jnp.asarray(x)), tree_of(0, 0))
    red = gpucoll.Reducer(params, bucket_cap_mb=0.0002, first_bucket_cap_mb=0.0001)
    assert len(red.bucket_indices) >= 2, red.bucket_indices
    for it in range(3):
        same(red.reduce(jax.tree.map(jnp.asarray, tree_of(r, it))), mean(it), 1e-6)
    # mark_ready by leaf index, in the leaves' order (jax.tree.leaves)
    leaves = jax.tree.leaves(jax.tree.map(jnp.asarray, tree_of(r, 3)))
    for i in range(len(leaves)):
        red.mark_ready(i, leaves[i])
    held = red.wait()
    same(held, mean(3), 1e-6)
    # JAX results are new arrays: the next iteration does not change them
    red.reduce(jax.tree.map(jnp.asarray, tree_of(r, 4)))
    same(held, mean(3), 1e-6)

    # a missing leaf is named by its path
    for i in range(1, len(leaves)):
        red.mark_ready(i, leaves[i])
    if r == 0:
        red.mark_ready(0, leaves[0])
    if w > 1:
        with pytest.raises(gpucoll.ParameterMismatchError, match=r"\['dense'\]\['b'\] \(8,\) float32 \(missing on rank"):
            red.wait()
    else:
        red.wait()

    # bucketed_all_reduce: concrete, and inside jit
    tree = jax.tree.map(jnp.asarray, tree_of(r, 5))
    same(gpucoll.bucketed_all_reduce(tree, bucket_cap_mb=0.0002), mean(5), 1e-6)

    @jax.jit
    def step(t: Any) -> Any:
        return gpucoll.bucketed_all_reduce(jax.tree.map(lambda x: x * 2, t), bucket_cap_mb=0.0002)
    same(step(tree), jax.tree.map(lambda x: 2 * x, mean(5)), 1e-6)
    same(step(jax.tree.map(jnp.asarray, tree_of(r, 6))), jax.tree.map(lambda x: 2 * x, mean(6)), 1e-6)
    summed = gpucoll.bucketed_all_reduce(tree, average=False)
    same(summed, jax.tree.map(lambda x: w * x, mean(5)), 1e-6)
    return "ok"


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_reducer_and_bucketed_all_reduce_on_jax(world_size: int) -> None:
    skip_without_jax()
    out = run_spmd(jax_body, world_size, timeout=240, env={"JAX_PLATFORMS": "cpu"})
    assert out == ["ok"] * world_size
