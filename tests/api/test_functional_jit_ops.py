"""Every gpucoll.functional op inside jax.jit (ordered FFI calls) on the CPU backend, against
NumPy as the reference, at world sizes 1-4: one started world per size, many checks in it.
Also vmap and grad through the ops that have rules, and the errors of those that do not."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpucoll.testing import run_spmd

from _fake_arrays import skip_without_jax


def data(rank: int, shape: tuple[int, ...], dtype: str = "float32") -> np.ndarray:
    size = int(np.prod(shape))
    return ((np.arange(size) * 7 + 3 * rank) % 11 - 3).astype(dtype).reshape(shape)


def ops_body() -> str:
    import jax
    import jax.numpy as jnp

    import gpucoll
    import gpucoll.functional as F

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    every = lambda shape, dtype="float32": [data(k, shape, dtype) for k in range(n)]  # noqa: E731
    eq = np.testing.assert_array_equal
    R = gpucoll.ReduceOp

    for dtype in ("float32", "int32"):
        xs = every((2 * n, 3), dtype)
        x = jnp.asarray(xs[r])
        for root in range(n):
            # broadcast, reduce, gather, scatter from/to every root, all in one program
            @jax.jit
            def rooted(v: Any) -> Any:
                return (F.broadcast(v, src=root), F.reduce(v, dst=root), F.reduce(v, dst=root, op=R.MAX),
                        F.gather(v, dst=root), F.gather(v, dst=root, axis=1), F.scatter(v, src=root),
                        F.scatter(v, src=root, axis=1) if 3 % n == 0 else None)

            b, s, m, g0, g1, sc0, sc1 = rooted(x)
            eq(np.asarray(b), xs[root])
            if r == root:
                eq(np.asarray(s), sum(xs))
                eq(np.asarray(m), np.maximum.reduce(xs))
                eq(np.asarray(g0), np.concatenate(xs, axis=0))
                eq(np.asarray(g1), np.concatenate(xs, axis=1))
            else:
                assert s is None and m is None and g0 is None and g1 is None
            eq(np.asarray(sc0), np.split(xs[root], n, axis=0)[r])
            if sc1 is not None:
                eq(np.asarray(sc1), np.split(xs[root], n, axis=1)[r])

        @jax.jit
        def everyone(v: Any) -> Any:
            return (F.reduce_scatter(v), F.reduce_scatter(v, op=R.MIN), F.all_gather(v, axis=1),
                    F.all_to_all_single(v), F.all_gather(v[0, 0]))

        rs, rmin, ag, a2a, ag0 = (np.asarray(o) for o in everyone(x))
        eq(rs, np.split(sum(xs), n)[r])
        eq(rmin, np.split(np.minimum.reduce(xs), n)[r])
        eq(ag, np.concatenate(xs, axis=1))
        eq(a2a, np.concatenate([np.split(xs[k], n)[r] for k in range(n)]))
        eq(ag0, np.array([xs[k][0, 0] for k in range(n)]))

    # reduce_scatter along axis 1 (a chunk per rank of every row)
    xs = every((2, 2 * n))
    eq(np.asarray(jax.jit(lambda v: F.reduce_scatter(v, axis=1))(jnp.asarray(xs[r]))),
       np.split(sum(xs), n, axis=1)[r])
    # all_to_all_single with uneven splits: rank k sends j + 1 rows to rank j
    mine = np.concatenate([data(r, (j + 1, 2)) + 100 * j for j in range(n)])
    out = jax.jit(lambda v: F.all_to_all_single(v, output_split_sizes=[r + 1] * n,
                                                input_split_sizes=list(range(1, n + 1))))(jnp.asarray(mine))
    eq(np.asarray(out), np.concatenate([data(k, (r + 1, 2)) + 100 * r for k in range(n)]))

    # send / recv: a ring (every rank sends to the next), two tags, inside one program
    if n > 1:
        nxt, prv = (r + 1) % n, (r - 1) % n

        @jax.jit
        def ring(v: Any) -> Any:
            F.send(v, dst=nxt, tag=1)
            F.send(v * 2, dst=nxt, tag=2)
            a = F.recv(jnp.zeros_like(v), src=prv, tag=1)
            b = F.recv(jnp.zeros_like(v), src=prv, tag=2)
            return a, b

        for i in range(5):
            a, b = ring(jnp.asarray(data(r, (4,)) + i))
            eq(np.asarray(a), data(prv, (4,)) + i)
            eq(np.asarray(b), 2 * (data(prv, (4,)) + i))

        # inside a fori_loop: the token goes around the loop, each turn's calls in order
        def turn(i: Any, v: Any) -> Any:
            F.send(v, dst=nxt)
            return F.recv(jnp.zeros_like(v), src=prv) + F.all_reduce(jnp.ones_like(v))
        got = jax.jit(lambda v: jax.lax.fori_loop(0, n, turn, v))(jnp.asarray(data(r, (4,))))
        eq(np.asarray(got), data(r, (4,)) + n * n)  # n turns around the ring, each adds n

    # an in-place op's output aliases its input, yet an input used afterwards is kept
    v0 = jnp.asarray(data(r, (5,)))
    y, same = jax.jit(lambda v: (F.all_reduce(v), v * 1))(v0)
    eq(np.asarray(same), data(r, (5,)))
    eq(np.asarray(y), sum(data(k, (5,)) for k in range(n)))
    eq(np.asarray(v0), data(r, (5,)))

    # barrier carries its value; and orders what follows it
    eq(np.asarray(jax.jit(lambda v: F.barrier(v) + 1)(jnp.ones(3))), np.full(3, 2.0))

    # vmap: batched calls equal the call on each batch row
    batch = jnp.asarray(np.stack([data(r, (n, 2)), 3 * data(r, (n, 2))]))
    rows_k = [np.stack([data(k, (n, 2)), 3 * data(k, (n, 2))]) for k in range(n)]
    eq(np.asarray(jax.jit(jax.vmap(lambda v: F.broadcast(v, src=n - 1)))(batch)), rows_k[n - 1])
    eq(np.asarray(jax.jit(jax.vmap(F.all_gather))(batch)), np.concatenate(rows_k, axis=1))
    eq(np.asarray(jax.jit(jax.vmap(F.reduce_scatter))(batch)), np.split(sum(rows_k), n, axis=1)[r])
    eq(np.asarray(jax.jit(jax.vmap(F.all_to_all_single))(batch)),
       np.concatenate([np.split(rows_k[k], n, axis=1)[r] for k in range(n)], axis=1))

    g = jax.jit(jax.vmap(lambda v: F.gather(v, dst=0)))(batch)
    if r == 0:
        eq(np.asarray(g), np.concatenate(rows_k, axis=1))
    else:
        assert g is None
    eq(np.asarray(jax.jit(jax.vmap(lambda v: F.scatter(v, src=n - 1)))(batch)),
       np.split(rows_k[n - 1], n, axis=1)[r])
    red = jax.jit(jax.vmap(lambda v: F.reduce(v, dst=0, op=R.MIN)))(batch)
    if r == 0:
        eq(np.asarray(red), np.minimum.reduce(rows_k))
    else:
        assert red is None
    # bfloat16 and float16 travel as they are
    import ml_dtypes

    for dt in (jnp.bfloat16, jnp.float16):
        h = jnp.asarray(data(r, (2, 3)), dt)
        got = jax.jit(lambda v: (F.all_gather(v), F.broadcast(v, src=n - 1)))(h)
        ref = [data(k, (2, 3)).astype(ml_dtypes.bfloat16 if dt == jnp.bfloat16 else np.float16) for k in range(n)]
        assert got[0].dtype == dt
        eq(np.asarray(got[0]), np.concatenate(ref))
        eq(np.asarray(got[1]), ref[n - 1])

    # grad: a send passes no gradient; a received value does not depend on the template
    if n > 1:
        def loss(v: Any) -> Any:
            F.send(v, dst=(r + 1) % n)
            got = F.recv(v, src=(r - 1) % n)
            return jnp.sum(v * v) + jnp.sum(got * v)

        v = data(r, (3,))
        grad = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(v)))
        eq(grad, 2 * v + data((r - 1) % n, (3,)))
    # grad through all_gather and reduce_scatter(SUM): each is the other's transpose. With
    # rank k's loss sum(out * c_k), d(sum of losses)/dx_r is the sum over k of c_k's chunk r
    # (all_gather), and every rank's c_k concatenated along the scattered axis (reduce_scatter)
    c = [data(k, (2 * n, 2)) + 1 for k in range(n)]
    xg = jnp.asarray(data(r, (2, 2)))
    grad = jax.jit(jax.grad(lambda v: jnp.sum(F.all_gather(v) * c[r])))(xg)
    eq(np.asarray(grad), sum(np.split(ck, n)[r] for ck in c))
    cs = [data(k, (2, 2)) * 2 + 1 for k in range(n)]
    grad = jax.jit(jax.grad(lambda v: jnp.sum(F.reduce_scatter(v, axis=1) * cs[r])))(
        jnp.asarray(data(r, (2, 2 * n))))
    eq(np.asarray(grad), np.concatenate(cs, axis=1))

    # grad and vmap without jit: the primitive runs as a one-op program
    eq(np.asarray(jax.grad(lambda v: jnp.sum(F.all_reduce(v) * (r + 1)))(jnp.ones(3))),
       np.full(3, n * (n + 1) / 2))
    eq(np.asarray(jax.vmap(lambda v: F.broadcast(v, src=n - 1))(batch)), rows_k[n - 1])
    with pytest.raises(NotImplementedError, match=r"gpucoll.functional.broadcast inside jax.grad"):
        jax.jit(jax.grad(lambda v: jnp.sum(F.broadcast(v, src=0))))(jnp.ones(3))
    # bad arguments fail at trace time, on every rank alike, before anything is issued
    if n > 1:
        with pytest.raises(ValueError, match=r"x.shape\[0\]=5 is not divisible by the group size"):
            jax.jit(lambda v: F.reduce_scatter(v))(jnp.ones(5 if n != 5 else 6))
    with pytest.raises(ValueError, match=r"axis=5 is out of range"):
        jax.jit(lambda v: F.gather(v, dst=0, axis=5))(jnp.ones(3))
    # a subgroup (even ranks) beside the default group in one program; group ranks for p2p
    evens = gpucoll.new_group(list(range(0, n, 2)))
    if r % 2 == 0:
        m = len(range(0, n, 2))

        @jax.jit
        def sub(v: Any) -> Any:
            s = F.all_reduce(v, group=evens)
            w = F.all_reduce(v)
            if m > 1:
                F.send(v, group=evens, group_dst=(r // 2 + 1) % m)
                return s, w, F.recv(v, group=evens, group_src=(r // 2 - 1) % m)
            return s, w, v

        s, w, got = sub(jnp.asarray(data(r, (3,))))
        eq(np.asarray(s), sum(data(k, (3,)) for k in range(0, n, 2)))
        eq(np.asarray(w), sum(data(k, (3,)) for k in range(n)))
        eq(np.asarray(got), data(2 * ((r // 2 - 1) % m), (3,)))
    else:
        eq(np.asarray(jax.jit(F.all_reduce)(jnp.asarray(data(r, (3,))))), sum(data(k, (3,)) for k in range(n)))

    # the next collective outside jit still pairs up: no call was dropped or left behind
    eq(np.asarray(F.all_reduce(np.full(3, r, np.int64))), np.full(3, n * (n - 1) // 2))
    return "ok"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_op_inside_jit_matches_numpy(world_size: int) -> None:
    skip_without_jax()
    assert run_spmd(ops_body, world_size, timeout=600,
                    env={"JAX_PLATFORMS": "cpu"}) == ["ok"] * world_size


def mismatch_body() -> str:
    import jax
    import jax.numpy as jnp

    import gpucoll
    import gpucoll.functional as F

    r = gpucoll.get_rank()

    @jax.jit
    def step(v: Any) -> Any:  # rank 1 compiled a different sequence of collectives
        if r == 1:
            return F.broadcast(v, src=0) + F.all_reduce(v)
        return F.all_reduce(v) + F.broadcast(v, src=0)

    # the cross-rank signature check runs inside the compiled program too: an error on
    # every rank naming what differs, not a hang and not a wrong result
    first = "broadcast" if r == 1 else "all_reduce"
    with pytest.raises(Exception, match=rf"gpucoll.functional.{first} inside jax.jit failed: DistBackendError: "
                                        r".*issued a different collective.*differ in op"):
        step(jnp.ones(3)).block_until_ready()
    return "ok"


def test_ranks_that_compiled_different_sequences_get_an_error() -> None:
    skip_without_jax()
    assert run_spmd(mismatch_body, 3, timeout=120, env={"JAX_PLATFORMS": "cpu"}) == ["ok"] * 3


def test_a_plan_number_from_another_process_is_refused() -> None:
    import ctypes as C

    from gpucoll._jax import ffi_api as A
    from gpucoll._jax import handler

    def attrs(value: int) -> Any:
        v = C.c_int64(value)
        scalar = A.Scalar(dtype=5, value=C.cast(C.pointer(v), C.c_void_p))
        types = (C.c_int * 1)(A.ATTR_SCALAR)
        ptrs = (C.c_void_p * 1)(C.addressof(scalar))
        a = A.Attrs(size=1, types=types, attrs=ptrs)
        a._keep = (v, scalar, types, ptrs)
        return a

    other = ((handler._TAG ^ 0x5A5A) << handler._INDEX_BITS) | 0
    with pytest.raises(RuntimeError, match="compiled by another process"):
        handler._plan_of(attrs(other))
    with pytest.raises(IndexError):  # this process's tag, a plan number it never made
        handler._plan_of(attrs((handler._TAG << handler._INDEX_BITS) | (1 << handler._INDEX_BITS) - 1))
