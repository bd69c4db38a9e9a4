"""gpucoll.functional's point-to-point, gather, scatter and all_to_all on JAX (CPU) and
NumPy arrays, against NumPy as the reference; and the jax.jit tracer error."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpucoll.testing import run_spmd

from _fake_arrays import skip_without_jax


def data(rank: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 100 * rank


def body(framework: str) -> str:
    import gpucoll
    import gpucoll.functional as F

    if framework == "jax":
        import jax
        import jax.numpy as jnp

        wrap: Any = jnp.asarray
        kind: Any = jax.Array
    else:
        wrap, kind = np.asarray, np.ndarray
    r, n = gpucoll.get_rank(), gpucoll.get_world_size()

    def same(got: Any, want: np.ndarray) -> None:
        assert isinstance(got, kind), type(got)
        np.testing.assert_array_equal(np.asarray(got), want)

    # send / recv: a ring, every rank sends its data to the next
    x = wrap(data(r, (3, 2)))
    if n > 1:
        if r % 2 == 0:
            F.send(x, dst=(r + 1) % n)
            got = F.recv(wrap(np.zeros((3, 2), np.float32)), src=(r - 1) % n)
        else:
            got = F.recv(wrap(np.zeros((3, 2), np.float32)), src=(r - 1) % n)
            F.send(x, dst=(r + 1) % n)
        same(got, data((r - 1) % n, (3, 2)))
        np.testing.assert_array_equal(np.asarray(x), data(r, (3, 2)))  # input untouched

    # gather, on every root in turn, along axis 0 and 1
    every = [data(q, (2, 3)) for q in range(n)]
    for root in range(n):
        g = F.gather(wrap(every[r]), dst=root)
        if r == root:
            same(g, np.concatenate(every, axis=0))
        else:
            assert g is None
    g1 = F.gather(wrap(every[r]), dst=n - 1, axis=1)
    if r == n - 1:
        same(g1, np.concatenate(every, axis=1))
    scalar = F.gather(wrap(np.float32(r)), dst=0)
    if r == 0:
        same(scalar, np.arange(n, dtype=np.float32))

    # scatter: every rank passes the full shape; only the root's values count
    full = data(7, (2 * n, 3))
    mine = full if r == n // 2 else np.zeros_like(full)
    same(F.scatter(wrap(mine), src=n // 2), full[2 * r:2 * r + 2])
    wide = data(5, (2, 3 * n))
    same(F.scatter(wrap(wide if r == 0 else np.zeros_like(wide)), src=0, axis=1), wide[:, 3 * r:3 * r + 3])
    if n > 1:
        with pytest.raises(ValueError, match="not divisible by the group size"):
            F.scatter(wrap(np.zeros((n + 1,), np.float32)), src=0)

    # all_to_all_single with uneven splits: rank r sends j+1 rows to rank j
    send_rows = [j + 1 for j in range(n)]
    recv_rows = [r + 1] * n
    src = data(r, (sum(send_rows), 2))
    got = F.all_to_all_single(wrap(src), output_split_sizes=recv_rows, input_split_sizes=send_rows)
    offsets = np.cumsum([0] + send_rows)
    want = np.concatenate([data(q, (sum(send_rows), 2))[offsets[r]:offsets[r + 1]] for q in range(n)])
    same(got, want)
    return "ok"


def symmetric_a2a(framework: str) -> str:
    import gpucoll
    import gpucoll.functional as F

    wrap: Any = np.asarray
    if framework == "jax":
        import jax.numpy as jnp

        wrap = jnp.asarray
    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    outs = F.all_to_all([wrap(data(r * 10 + j, (2, 2))) for j in range(n)])
    for i, o in enumerate(outs):
        np.testing.assert_array_equal(np.asarray(o), data(i * 10 + r, (2, 2)))
    with pytest.raises(ValueError, match=f"xs must have {n} arrays"):
        F.all_to_all([wrap(data(0, (2,)))] * (n + 1))
    return "ok"


def jit_body() -> str:
    import jax
    import jax.numpy as jnp

    import gpucoll
    import gpucoll.functional as F

    @jax.jit
    def inside(v: Any) -> Any:
        return F.all_reduce_coalesced([v])  # the single-array ops run inside jit (test_functional_jit*.py)

    with pytest.raises(TypeError, match=r"all_reduce_coalesced: xs\[0\] is a JAX tracer .* between jitted functions"):
        inside(jnp.ones(3))
    with pytest.raises(TypeError, match=r"all_to_all: xs\[0\] is a JAX tracer"):
        jax.jit(lambda v: F.all_to_all([v] * gpucoll.get_world_size()))(jnp.ones(3))
    # the in-place API names the tracer too
    with pytest.raises(TypeError, match="JAX tracer"):
        jax.jit(lambda v: gpucoll.all_reduce(v))(jnp.ones(3))
    # what the message recommends: jitted steps around a concrete collective
    step = jax.jit(lambda v: v * 2)
    y = step(F.all_reduce(step(jnp.ones(3))))
    np.testing.assert_array_equal(np.asarray(y), 4.0 * gpucoll.get_world_size() * np.ones(3))
    # the in-place recv into an immutable JAX array points at the functional recv
    with pytest.raises(ValueError, match=r"use gpucoll\.functional \(.*recv.*\), which returns a new array"):
        gpucoll.recv(jnp.zeros(3), src=1 - gpucoll.get_rank())
    return "ok"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_functional_p2p_gather_scatter_jax(world_size: int) -> None:
    skip_without_jax()
    out = run_spmd(body, world_size, args=("jax",), timeout=180, env={"JAX_PLATFORMS": "cpu"})
    assert out == ["ok"] * world_size


@pytest.mark.parametrize("world_size", [1, 3])
def test_functional_p2p_gather_scatter_numpy(world_size: int) -> None:
    assert run_spmd(body, world_size, args=("numpy",), timeout=120) == ["ok"] * world_size


@pytest.mark.parametrize("framework", ["numpy", "jax"])
def test_functional_all_to_all_list(framework: str) -> None:
    if framework == "jax":
        skip_without_jax()
    assert run_spmd(symmetric_a2a, 3, args=(framework,), timeout=120,
                    env={"JAX_PLATFORMS": "cpu"}) == ["ok"] * 3


def test_jit_tracer_error_says_what_to_do() -> None:
    skip_without_jax()
    assert run_spmd(jit_body, 2, timeout=120, env={"JAX_PLATFORMS": "cpu"}) == ["ok"] * 2
