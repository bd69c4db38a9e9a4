"""The compiled handler of small collectives inside jax.jit (gpucoll/_jax/native.c) and
each group's jit channel: every reduction bit for bit against the NumPy reference, which
ops it runs (counted), its errors (mismatch, timeout, a destroyed group), and when the
Python handler serves instead (turned off on some rank, DETAIL, a failed build).

Peer death and a SIGSTOPped peer inside jit are cases of tests/faults/test_peer_death.py.
"""

from __future__ import annotations

import shutil
from typing import Any

import numpy as np
import pytest

from gpucoll.testing import run_spmd

from _fake_arrays import skip_without_jax

NATIVE_DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                 "float16", "bfloat16", "float32", "float64"]
ENV = {"JAX_PLATFORMS": "cpu", "JAX_ENABLE_X64": "1"}


def _skip() -> None:
    skip_without_jax()
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the compiled handler cannot be built here")


def inputs(rank: int, name: str, count: int) -> np.ndarray:
    """Rank ``rank``'s input: random over the type's range (integers wrap when summed),
    with NaN, infinities, signed zeros, overflow and subnormals among the floats."""
    from _reference import np_dtype

    dt = np_dtype(name)
    rng = np.random.default_rng([rank, count, len(name), sum(map(ord, name))])
    if name == "bool":
        return rng.random(count) < 0.5
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=count, endpoint=True, dtype=dt)
    v = (rng.standard_normal(count) * 3).astype(np.float32)
    if count >= 8:
        big = 65000.0 if name == "float16" else 3e38
        v[:8] = [np.nan if rank == 1 else 1.0, np.inf if rank == 0 else 2.0, -0.0, 0.0 if rank else -0.0,
                 big, 1e-7, -np.inf if rank == 2 else 5.0, 2.0 ** -24]
    return v.astype(dt)


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal element for element, bit for bit (signed zeros too); NaN where NaN is."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.dtype.kind == "f" or got.dtype.name == "bfloat16":
        nan_g, nan_w = np.isnan(got.astype(np.float64)), np.isnan(want.astype(np.float64))
        if not (nan_g == nan_w).all():
            return False
        u = np.dtype(f"u{got.dtype.itemsize}")
        return bool((got.view(u)[~nan_g] == want.view(u)[~nan_w]).all())
    return bool(np.array_equal(got, want))


def reductions_body() -> str:
    import functools

    import jax
    import jax.numpy as jnp

    import gpucoll
    import gpucoll.functional as F
    from _reference import defined, reference
    from gpucoll._jax import native
    from gpucoll._reduce_op import ReduceOp

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    assert native.library() is not None, native.why_not()

    @functools.partial(jax.jit, static_argnames="op")
    def step(x: Any, op: str) -> Any:
        return F.all_reduce(x, op=ReduceOp[op])

    runs = 0
    before = native.native_ops()
    for name in NATIVE_DTYPES:
        for op in (ReduceOp[o] for o in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")):
            if not defined(name, op):
                continue
            for count in (1, 37):
                ins = [inputs(k, name, count) for k in range(n)]
                got = np.asarray(step(jnp.asarray(ins[r]), op.name))
                want = reference(ins, name, op)
                assert same_bits(got, want), (name, op, count, got, want)
                runs += 1
    assert native.native_ops() - before == runs, (native.native_ops() - before, runs)

    # the largest op it runs, and one element more (the Python handler runs that one)
    for count, ran in ((native.SLOT_BYTES // 4, 1), (native.SLOT_BYTES // 4 + 1, 0)):
        ins = [inputs(k, "float32", count) for k in range(n)]
        before = native.native_ops()
        got = np.asarray(step(jnp.asarray(ins[r]), "SUM"))
        assert same_bits(got, reference(ins, "float32", ReduceOp.SUM)), count
        assert native.native_ops() - before == ran, (count, native.native_ops() - before)

    # the other kinds it runs, each against NumPy, each counted: reduce, reduce_scatter,
    # all_gather, gather, scatter (rows of n * 3 elements: divisible by the group size)
    @functools.partial(jax.jit, static_argnames=("op", "root"))
    def others(x: Any, op: str, root: int) -> Any:
        red = ReduceOp[op]
        return (F.reduce(x, dst=root, op=red), F.reduce_scatter(x, op=red), F.all_gather(x),
                F.gather(x, dst=root), F.scatter(x, src=root))

    for name, op in (("float32", "SUM"), ("bfloat16", "MAX"), ("int64", "PRODUCT"), ("uint8", "BXOR")):
        ins = [inputs(k, name, 3 * n) for k in range(n)]
        full = reference(ins, name, ReduceOp[op])
        for root in range(n):
            before = native.native_ops()
            red, rs, ag, ga, sc = others(jnp.asarray(ins[r]), op, root)
            if r == root:
                assert same_bits(np.asarray(red), full), (name, op, "reduce")
                assert same_bits(np.asarray(ga), np.concatenate(ins)), (name, "gather")
            else:
                assert ga is None
            assert same_bits(np.asarray(rs), full[3 * r:3 * r + 3]), (name, op, "reduce_scatter")
            assert same_bits(np.asarray(ag), np.concatenate(ins)), (name, "all_gather")
            assert same_bits(np.asarray(sc), ins[root][3 * r:3 * r + 3]), (name, "scatter")
            assert native.native_ops() - before == 5, native.native_ops() - before
    # a reduce_scatter whose input is the largest the handler runs, and one row more
    for rows, ran in ((native.SLOT_BYTES // 4 // n, 1), (native.SLOT_BYTES // 4 // n + 1, 0)):
        ins = [inputs(k, "float32", rows * n) for k in range(n)]
        before = native.native_ops()
        got = np.asarray(jax.jit(lambda v: F.reduce_scatter(v, op=ReduceOp.MIN))(jnp.asarray(ins[r])))
        want = reference(ins, "float32", ReduceOp.MIN)[rows * r:rows * (r + 1)]
        assert same_bits(got, want) and native.native_ops() - before == ran, (rows, native.native_ops() - before)

    # broadcast from every root (any dtype: bytes move) and barrier, in one program
    @functools.partial(jax.jit, static_argnames="src")
    def bcast(x: Any, y: Any, src: int) -> Any:
        return F.broadcast(x, src=src), F.barrier(y), F.broadcast(y, src=src)

    for src in range(n):
        before = native.native_ops()
        x = (np.arange(5) + 10 * r).astype(np.complex64) * (1 + 1j)
        y = inputs(r, "bfloat16", 9)
        a, b, c = bcast(jnp.asarray(x), jnp.asarray(y), src)
        assert same_bits(np.asarray(a), ((np.arange(5) + 10 * src).astype(np.complex64) * (1 + 1j)))
        assert same_bits(np.asarray(b), y) and same_bits(np.asarray(c), inputs(src, "bfloat16", 9))
        assert native.native_ops() - before == 3
    # an empty array, a 0-d one
    assert np.asarray(jax.jit(F.all_reduce)(jnp.zeros((0, 3), jnp.float32))).shape == (0, 3)
    assert float(jax.jit(F.all_reduce)(jnp.float32(r + 1))) == n * (n + 1) / 2
    # the jitted result equals the same call outside jit (the Python path), bit for bit
    x = inputs(r, "float32", 37)
    y = x.copy()
    gpucoll.all_reduce(y)
    assert same_bits(np.asarray(jax.jit(F.all_reduce)(jnp.asarray(x))), y)
    return "ok"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_native_reduction_matches_the_reference_bit_for_bit(world_size: int) -> None:
    _skip()
    assert run_spmd(reductions_body, world_size, timeout=600, env=ENV) == ["ok"] * world_size


def errors_body() -> str:
    import re
    import time

    import jax
    import jax.numpy as jnp

    import gpucoll
    import gpucoll.functional as F
    from gpucoll._jax import native

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    assert native.library() is not None, native.why_not()

    # 1. ranks that issue different ops: an error on every rank saying what differs; the
    # group's later in-jit ops fail at once; its ops outside jit go on
    g = gpucoll.new_group()
    step = jax.jit(lambda v: F.all_reduce(v, group=g))
    np.testing.assert_array_equal(np.asarray(step(jnp.ones(3))), np.full(3, n))
    with pytest.raises(Exception, match=r"all_reduce inside jax.jit failed: DistBackendError: rank \d issued a "
                                        r"different collective.*they differ in shape"):
        step(jnp.ones(4 if r == 1 else 3)).block_until_ready()
    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"an earlier op of this group inside jit failed: .*differ in shape"):
        step(jnp.ones(3)).block_until_ready()
    assert time.monotonic() - t0 < 1.0
    x = np.ones(3)
    gpucoll.all_reduce(x, group=g)
    np.testing.assert_array_equal(x, np.full(3, n))

    # 2. a rank that never comes: the others time out within the group's timeout,
    # naming it. When it comes late, every peer's data is there (they posted before
    # giving up): it may complete with the right sum, or fail; its next op fails at
    # once, naming who gave up on whom
    g2 = gpucoll.new_group(timeout=2.0)
    step2 = jax.jit(lambda v: F.all_reduce(v, group=g2))
    np.testing.assert_array_equal(np.asarray(step2(jnp.ones(3))), np.full(3, n))
    late = n - 1
    gave_up = rf"rank \d timed out waiting for rank {late}, which ends the group's in-jit ops"
    t0 = time.monotonic()
    if r == late:
        time.sleep(3.5)
        try:
            np.testing.assert_array_equal(np.asarray(step2(jnp.ones(3))), np.full(3, n))
        except Exception as exc:  # noqa: BLE001 - checked below
            assert re.search(gave_up, str(exc)), exc
        t0 = time.monotonic()
        with pytest.raises(Exception, match=gave_up):
            step2(jnp.ones(3)).block_until_ready()
        assert time.monotonic() - t0 < 1.0
    else:
        with pytest.raises(Exception, match=rf"DistBackendError: .*(timed out after 2 s waiting for rank {late}|"
                                            rf"timed out waiting for rank {late})") as caught:
            step2(jnp.ones(3)).block_until_ready()
        elapsed = time.monotonic() - t0
        assert elapsed < 4.5, elapsed
        if "timed out after 2 s" in str(caught.value):  # its own wait ran out, not a peer's
            assert elapsed > 1.9, elapsed
    gpucoll.barrier()

    # 3. a destroyed group's in-jit op fails at once, saying so
    g3 = gpucoll.new_group()
    step3 = jax.jit(lambda v: F.all_reduce(v, group=g3))
    np.testing.assert_array_equal(np.asarray(step3(jnp.ones(3))), np.full(3, n))
    gpucoll.destroy_process_group(g3)
    with pytest.raises(Exception, match=r"DistBackendError: .*the group was aborted or destroyed"):
        step3(jnp.ones(3)).block_until_ready()

    # the default group was never touched
    np.testing.assert_array_equal(np.asarray(jax.jit(F.all_reduce)(jnp.ones(2))), np.full(2, n))
    return "ok"


def test_mismatch_timeout_and_destroyed_group_inside_jit_are_named_errors() -> None:
    _skip()
    assert run_spmd(errors_body, 3, timeout=300, env=ENV) == ["ok"] * 3


def python_path_body(off_on: list[int], expect_native: bool) -> str:
    import os
    import warnings

    if os.environ.get("GPUCOLL_RANK_OFF") and int(os.environ["RANK"]) in off_on:
        os.environ["GPUCOLL_JAX_NATIVE"] = "0"  # before anything is compiled
    import jax
    import jax.numpy as jnp

    import gpucoll
    import gpucoll.functional as F
    from gpucoll._jax import native

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")

        @jax.jit
        def step(v: Any, w: Any) -> Any:
            return F.all_reduce(v, op=gpucoll.ReduceOp.MAX), F.broadcast(w, src=n - 1), F.all_gather(v)

        for i in range(5):
            a, b, c = step(jnp.full(3, r + i), jnp.full(2, r * 10.0))
            np.testing.assert_array_equal(np.asarray(a), np.full(3, n - 1 + i))
            np.testing.assert_array_equal(np.asarray(b), np.full(2, (n - 1) * 10.0))
            np.testing.assert_array_equal(np.asarray(c), np.concatenate([np.full(3, k + i) for k in range(n)]))
    assert (native.native_ops() > 0) == expect_native, native.native_ops()
    assert not [w for w in seen if "could not be built" in str(w.message)]
    from gpucoll._world import default_group

    return native.channel_for(default_group()).why


def test_a_rank_with_the_handler_off_makes_every_rank_use_the_python_handler() -> None:
    _skip()
    why = run_spmd(python_path_body, 3, args=([1], False), timeout=300, env=dict(ENV, GPUCOLL_RANK_OFF="1"))
    assert why[1] == "the compiled handler is not loaded (GPUCOLL_JAX_NATIVE=0)", why
    assert why[0] == why[2] == "rank 1: the compiled handler is not loaded (GPUCOLL_JAX_NATIVE=0)", why
    # and on every rank: no channel at all; the same results
    run_spmd(python_path_body, 2, args=([], False), timeout=300, env=dict(ENV, GPUCOLL_JAX_NATIVE="0"))
    # DETAIL: every op takes the Python path and its checks
    why = run_spmd(python_path_body, 2, args=([], False), timeout=300, env=dict(ENV, GPUCOLL_DEBUG="DETAIL"))
    assert all("DETAIL" in w for w in why), why
    # ranks that talk over TCP (as on several hosts): the same
    why = run_spmd(python_path_body, 2, args=([], False), timeout=300, env=dict(ENV, GPUCOLL_CPU_TRANSPORT="tcp"))
    assert all("the group's CPU transport is tcp, not shared memory" in w for w in why), why
    # the handler on: the same program runs there
    assert run_spmd(python_path_body, 2, args=([], True), timeout=300, env=ENV) == ["", ""]


def build_body(required: bool) -> str:
    import jax
    import jax.numpy as jnp

    import gpucoll.functional as F
    from gpucoll._jax import native

    if required:
        with pytest.raises(Exception, match=r"GPUCOLL_JAX_NATIVE=1 but gpucoll's compiled jit handler could not "
                                            r"be built: OSError: .* failed on .*native.c"):
            jax.jit(F.all_reduce)(jnp.ones(2)).block_until_ready()
        return "ok"
    with pytest.warns(RuntimeWarning, match=r"run through Python \(slower\): the compiled handler could not be built"):
        out = jax.jit(F.all_reduce)(jnp.ones(2))
    np.testing.assert_array_equal(np.asarray(out), np.ones(2))
    assert native.native_ops() == 0 and native.library() is None
    return "ok"


def test_a_failed_build_warns_and_falls_back_unless_the_handler_is_required(tmp_path: Any) -> None:
    _skip()
    env = dict(ENV, CC="false", GPUCOLL_CACHE_DIR=str(tmp_path / "cache"))
    assert run_spmd(build_body, 1, args=(False,), timeout=300, env=env) == ["ok"]
    assert run_spmd(build_body, 1, args=(True,), timeout=300, env=dict(env, GPUCOLL_JAX_NATIVE="1")) == ["ok"]
    assert not list((tmp_path / "cache").iterdir())  # no half-built library left behind
