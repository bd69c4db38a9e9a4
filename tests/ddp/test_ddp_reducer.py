"""Reducer and the built-in hooks on the CPU backend, world sizes 1-4, against NumPy.

One world per size runs every check (starting a world costs more than the checks);
the ports of torch's tests keep their names and assertions:

* test_c10d_gloo.py: test_ddp_comm_hook_future_passing_cpu, test_ddp_comm_hook_register_just_once,
  test_ddp_invalid_comm_hook_init, the allreduce-then-divide hook (_test_ddp_comm_hook_allreduce_hook);
* algorithms/ddp_comm_hooks/test_ddp_hooks.py: test_ddp_comm_hook_{allreduce_hook,
  fp16compress_hook, powerSGD_hook} (the hook's gradients equal the no-hook ones within
  torch's tolerances), test_is_last_hook.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

from gpucoll.testing import run_spmd

SHAPES = [(32, 24), (24,), (24, 16), (16,), (16, 8), (8,), (3, 5, 4)]


def grads_of(rank: int, it: int, shapes: list[tuple[int, ...]] = SHAPES, dtype: Any = np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 * it + rank)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def mean_of(it: int, world: int, shapes: list[tuple[int, ...]] = SHAPES) -> list[np.ndarray]:
    """The reference: NumPy's mean over every rank's gradients, in float64."""
    per_rank = [grads_of(r, it, shapes) for r in range(world)]
    return [np.mean([g[i].astype(np.float64) for g in per_rank], axis=0) for i in range(len(shapes))]


def close(got: list[Any], want: list[np.ndarray], rtol: float, atol: float, what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=rtol, atol=atol, err_msg=f"{what}: parameter {i}")


def params() -> list[np.ndarray]:
    return [np.zeros(s, np.float32) for s in SHAPES]


# ----- the rank bodies -----

def check_default_average(gpucoll: Any, r: int, w: int) -> None:
    red = gpucoll.Reducer(params(), bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
    assert len(red.bucket_indices) > 2, red.bucket_indices
    for it in range(3):
        out = red.reduce(grads_of(r, it))
        close(out, mean_of(it, w), 1e-6, 1e-7, f"default average, iteration {it}")
        assert all(isinstance(g, np.ndarray) and g.shape == s for g, s in zip(out, SHAPES))


def check_mixed_dtypes(gpucoll: Any, r: int, w: int) -> None:
    """float64 and float32 parameters: a bucket each kind, each reduced in its own dtype."""
    from gpucoll import compute_bucket_assignment_by_size

    ps = [np.zeros((8, 8), np.float64), np.zeros(8, np.float32), np.zeros((4, 8), np.float64), np.zeros(4, np.float32)]
    red = gpucoll.Reducer(ps, bucket_cap_mb=1, first_bucket_cap_mb=1)
    assert sorted(map(sorted, red.bucket_indices)) == [[0, 2], [1, 3]], red.bucket_indices
    want, _ = compute_bucket_assignment_by_size(ps[::-1], [2**20, 2**20], tensor_indices=[3, 2, 1, 0])
    assert red.bucket_indices == want
    rng = [np.random.default_rng(k) for k in range(w)]
    per_rank = [[g.standard_normal(p.shape).astype(p.dtype) for p in ps] for g in rng]
    out = red.reduce(per_rank[r])
    for i, p in enumerate(ps):
        assert out[i].dtype == p.dtype
        np.testing.assert_allclose(out[i], np.mean([g[i].astype(np.float64) for g in per_rank], axis=0),
                                   rtol=1e-12 if p.dtype == np.float64 else 1e-6, atol=1e-7)


def check_arrival_order_and_rebuild(gpucoll: Any, r: int, w: int) -> None:
    from gpucoll import compute_bucket_assignment_by_size

    red = gpucoll.Reducer(params(), bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
    # each rank produces its gradients in its own order; rank 0's decides the rebuild
    orders = [[2, 0, 6, 1, 5, 3, 4], [6, 5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5, 6], [3, 1, 4, 0, 5, 2, 6]]
    order = orders[r % len(orders)]
    for it in range(3):
        g = grads_of(r, it)
        for i in order:
            red.mark_ready(i, g[i])
        close(red.wait(), mean_of(it, w), 1e-6, 1e-7, f"arrival order, iteration {it}")
        if it == 0:
            want, _ = compute_bucket_assignment_by_size([params()[i] for i in orders[0]], [524, 1048],
                                                        tensor_indices=orders[0])
            assert red.bucket_indices == want, (red.bucket_indices, want)


def check_overlap(gpucoll: Any, r: int, w: int) -> None:
    from gpucoll.ddp_comm_hooks import allreduce_hook

    issued: list[int] = []

    def recording_hook(state: Any, bucket: Any) -> Any:
        issued.append(bucket.index())
        return allreduce_hook(state, bucket)

    red = gpucoll.Reducer(params(), bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
    red.register_comm_hook(None, recording_hook)
    first = red.bucket_indices[0]
    g = grads_of(r, 0)
    for i in first:
        red.mark_ready(i, g[i])
    assert issued == [0], f"bucket 0 is issued as soon as it is full; issued {issued}"
    for i in reversed(range(len(SHAPES))):
        if i not in first:
            red.mark_ready(i, g[i])
    assert issued == list(range(len(red.bucket_indices))), issued
    close(red.wait(), mean_of(0, w), 1e-6, 1e-7, "recording hook")
    # the gradient view saves the copy
    g = grads_of(r, 1)
    for i in reversed(range(len(SHAPES))):
        view = red.gradient_view(i)
        view[...] = g[i]
        red.mark_ready(i, view)
    close(red.wait(), mean_of(1, w), 1e-6, 1e-7, "gradient views")


BIG = [(300, 1000), (7,), (0,), (513, 1024), (3,), (200_000,), (1,)]  # buckets over 1 MiB staging blocks


def folded_mean(it: int, world: int, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """The default average as documented, independently: every rank's float32 gradients
    summed in rank order (in float32), then divided by the world size once."""
    per_rank = [grads_of(k, it, shapes) for k in range(world)]
    out = []
    for i in range(len(shapes)):
        acc = per_rank[0][i].copy()
        for g in per_rank[1:]:
            acc += g[i]
        out.append(np.divide(acc, np.float32(world)))
    return out


def divided_sum(it: int, world: int, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """allreduce_hook's result (torch's): each rank's gradient divided, then summed in rank order."""
    per_rank = [grads_of(k, it, shapes) for k in range(world)]
    out = []
    for i in range(len(shapes)):
        acc = np.divide(per_rank[0][i], np.float32(world))
        for g in per_rank[1:]:
            acc += np.divide(g[i], np.float32(world))
        out.append(acc)
    return out


def check_every_path_is_one_collective(gpucoll: Any, r: int, w: int) -> None:
    """reduce() (each bucket one all_reduce AVG that reads the gradients where they are),
    mark_ready with copies, and with the buckets' own views give the same bits, the sum
    in rank order divided once, and a rank may take any of them while its peers take
    another: each bucket is one all_reduce (AVG), whichever way it is issued. The
    allreduce_hook (divide, then a plain all_reduce) gives torch's bits, the same as the
    default where the world size is a power of two. Then a peer missing a gradient under
    reduce() on the others is still a named error."""
    from gpucoll.ddp_comm_hooks import allreduce_hook

    ps = [np.zeros(s, np.float32) for s in BIG]
    hooked = gpucoll.Reducer(ps, bucket_cap_mb=3, first_bucket_cap_mb=1)
    hooked.register_comm_hook(None, allreduce_hook)
    plain = gpucoll.Reducer(ps, bucket_cap_mb=3, first_bucket_cap_mb=1)
    assert len(plain.bucket_indices) >= 2, plain.bucket_indices
    for it in range(3):  # the first iteration rebuilds the buckets
        g = grads_of(r, it, BIG)
        want = folded_mean(it, w, BIG)
        close(want, mean_of(it, w, BIG), 1e-6, 1e-6, f"the reference, iteration {it}")
        for i, (a, b) in enumerate(zip(hooked.reduce(g), divided_sum(it, w, BIG))):
            assert a.tobytes() == b.tobytes(), f"allreduce_hook, iteration {it}: parameter {i} differs"
        if w & (w - 1) == 0:  # dividing by a power of two is exact: the same bits either way
            assert all(a.tobytes() == b.tobytes() for a, b in zip(hooked.reduce(g), want)), "allreduce_hook"
        way = (r + it) % 3  # every rank takes each way in turn, its peers others
        if way == 0:
            got = plain.reduce(g)
        elif way == 1:
            for i in reversed(range(len(BIG))):
                plain.mark_ready(i, g[i])
            got = plain.wait()
        else:
            for i in reversed(range(len(BIG))):
                view = plain.gradient_view(i)
                view[...] = g[i]
                plain.mark_ready(i, view)
            got = plain.wait()
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.tobytes() == b.tobytes(), f"iteration {it}, way {way}: parameter {i} differs"
        assert all(x.tobytes() == y.tobytes() for x, y in zip(g, grads_of(r, it, BIG))), "reduce() wrote a gradient"
    g = grads_of(r, 5, BIG)
    if r == w - 1:  # the last rank forgets parameter 3; the others hand over everything at once
        for i in reversed(range(len(BIG))):
            if i != 3:
                plain.mark_ready(i, g[i])
        with pytest.raises(gpucoll.ParameterMismatchError, match=rf"parameter 3 \(513, 1024\) float32 \(missing on rank\(s\) {w - 1}\)"):
            plain.wait()
    else:
        with pytest.raises(gpucoll.ParameterMismatchError, match=rf"parameter 3 .*missing on rank\(s\) {w - 1}"):
            plain.reduce(g)
    close(plain.reduce(grads_of(r, 6, BIG)), mean_of(6, w, BIG), 1e-6, 1e-6, "after the mismatch")


def check_missing_gradient(gpucoll: Any, r: int, w: int) -> None:
    red = gpucoll.Reducer(params(), bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
    close(red.reduce(grads_of(r, 0)), mean_of(0, w), 1e-6, 1e-7, "before the mismatch")
    g = grads_of(r, 1)
    skip = 4 if r == w - 1 else None  # the last rank forgets parameter 4
    for i in reversed(range(len(SHAPES))):
        if i != skip:
            red.mark_ready(i, g[i])
    with pytest.raises(gpucoll.ParameterMismatchError,
                       match=rf"parameter 4 \(16, 8\) float32 \(missing on rank\(s\) {w - 1}\)"):
        red.wait(timeout=20)
    # the next iteration is whole again
    close(red.reduce(grads_of(r, 2)), mean_of(2, w), 1e-6, 1e-7, "after the mismatch")
    with pytest.raises(ValueError, match="marked ready twice"):
        red.mark_ready(0, g[0])
        red.mark_ready(0, g[0])
    for i in range(1, len(SHAPES)):
        red.mark_ready(i, g[i])
    red.wait()
    with pytest.raises(ValueError, match=r"has shape \(2,\); expected \(32, 24\)"):
        red.mark_ready(0, np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="out of range"):
        red.mark_ready(len(SHAPES), g[0])
    with pytest.raises(ValueError, match="out of range"):
        red.mark_ready(True, g[0])

    class OtherKind:  # an array of another framework (its own namespace)
        shape, dtype = (2,), np.dtype(np.float32)

        def __array_namespace__(self) -> Any:
            return pytest

    with pytest.raises(TypeError, match=r"one array kind .* these differ: parameter 1"):
        gpucoll.Reducer([np.zeros(2, np.float32), OtherKind()], verify=False)


def check_verify(gpucoll: Any, r: int, w: int) -> None:
    gpucoll.verify_params_across_processes(None, params())
    if w == 1:
        return
    mine = params()
    if r == 1:
        mine[2] = np.zeros((24, 15), np.float32)
    with pytest.raises(gpucoll.ParameterMismatchError,
                       match=r"parameter 2: rank 0 \(24, 16\) float32, rank 1 \(24, 15\) float32"):
        gpucoll.verify_params_across_processes(None, mine)
    with pytest.raises(gpucoll.ParameterMismatchError, match="DDP expects same model across all ranks"):
        gpucoll.Reducer(mine)
    fewer = params()[: 7 - (r == 0)]
    with pytest.raises(gpucoll.ParameterMismatchError, match="parameter counts by rank: rank 0: 6, rank 1: 7"):
        gpucoll.verify_params_across_processes(None, fewer)


def check_broadcast_coalesced(gpucoll: Any, r: int, w: int) -> None:
    for src in sorted({0, w - 1}):
        arrays = [np.full(s, 10 * r + i, np.float32) for i, s in enumerate(SHAPES)]
        arrays += [np.full((5,), r, np.int64), np.full((4, 4), r + 0.5, np.float64)]
        want = [np.full(a.shape, a.flat[0] - 10 * r + 10 * src if a.dtype == np.float32 else
                        (src if a.dtype == np.int64 else src + 0.5), a.dtype) for a in arrays]
        gpucoll.broadcast_coalesced(None, arrays, 1000, src=src)
        for got, exp in zip(arrays, want):
            np.testing.assert_array_equal(got, exp)
    with pytest.raises(ValueError, match="buffer_size"):
        gpucoll.broadcast_coalesced(None, arrays, 0)


# --- torch's tests of hooks, ported ---

def task_grads(gpucoll: Any, hook: Callable[..., Any] | None, state: Any) -> list[np.ndarray]:
    """test_ddp_hooks.py's Task (p = ones(2, 2), y = p + x): every rank's gradient is ones."""
    red = gpucoll.Reducer([np.ones((2, 2), np.float32)])
    if hook is not None:
        red.register_comm_hook(state, hook)
    return [np.array(red.reduce([np.ones((2, 2), np.float32)])[0]) for _ in range(3)][-1:]


def check_torch_hook_tests(gpucoll: Any, r: int, w: int) -> None:
    from gpucoll import ddp_comm_hooks as hooks

    reference = task_grads(gpucoll, None, None)
    # test_ddp_comm_hook_allreduce_hook
    got = task_grads(gpucoll, hooks.allreduce_hook, None)
    np.testing.assert_allclose(got[0], reference[0], rtol=1e-5, atol=0)
    # test_ddp_comm_hook_fp16compress_hook
    got = task_grads(gpucoll, hooks.fp16_compress_hook, None)
    np.testing.assert_allclose(got[0], reference[0], rtol=1e-5, atol=1e-4)
    # test_ddp_comm_hook_powerSGD_hook (start_powerSGD_iter=2: the third iteration compresses)
    state = hooks.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    got = task_grads(gpucoll, hooks.powerSGD_hook, state)
    np.testing.assert_allclose(got[0], reference[0], rtol=1e-5, atol=1e-4)

    # test_ddp_comm_hook_future_passing_cpu: a hook that never communicates
    def simple_hook(state: Any, bucket: Any) -> Any:
        fut = hooks.Future()
        fut.set_result(np.ones_like(bucket.buffer()))
        return fut.then(lambda fut: fut.value() + fut.value())
    red = gpucoll.Reducer([np.ones((2, 2), np.float32)])
    red.register_comm_hook(None, simple_hook)
    np.testing.assert_array_equal(red.reduce([np.full((2, 2), 0.25, np.float32)])[0], 2 * np.ones((2, 2)))

    # _test_ddp_comm_hook_allreduce_hook: all_reduce (sum), then divide in the callback;
    # ModuleForDdpCommHook's gradient of mean(p + x + rank) is 0.25 everywhere
    def allreduce_then_divide(state: Any, bucket: Any) -> Any:
        work = gpucoll.all_reduce(bucket.buffer(), async_op=True)
        return hooks.Future.from_work(work).then(lambda fut: fut.wait()[0] / w)
    red = gpucoll.Reducer([np.ones((2, 2), np.float32)])
    red.register_comm_hook(None, allreduce_then_divide)
    np.testing.assert_allclose(red.reduce([np.full((2, 2), 0.25, np.float32)])[0], 0.25 * np.ones((2, 2)))

    # test_ddp_comm_hook_register_just_once
    with pytest.raises(RuntimeError, match="register_comm_hook or register_builtin_comm_hook can only be called once"):
        red.register_comm_hook(None, simple_hook)
    # test_ddp_invalid_comm_hook_init
    with pytest.raises(TypeError, match="hook must be callable"):
        gpucoll.Reducer([np.ones(2, np.float32)]).register_comm_hook(None, 1)
    bad = gpucoll.Reducer([np.ones(2, np.float32)])
    bad.register_comm_hook(None, lambda state, bucket: bucket.buffer())
    for _ in range(2):  # the failed iteration is reset: the same error again, not "marked twice"
        with pytest.raises(TypeError, match="expected a Future"):
            bad.mark_ready(0, np.ones(2, np.float32))

    # test_is_last_hook: only the last bucket says so, once per iteration
    seen: list[tuple[int, bool]] = []

    def last_hook(state: Any, bucket: Any) -> Any:
        seen.append((bucket.index(), bucket.is_last()))
        return hooks.allreduce_hook(state, bucket)
    red = gpucoll.Reducer(params(), bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
    red.register_comm_hook(None, last_hook)
    red.reduce(grads_of(r, 0))
    n = len(red.bucket_indices)
    assert seen == [(b, b == n - 1) for b in range(n)], seen


def check_every_hook(gpucoll: Any, r: int, w: int) -> None:
    """Each built-in hook against NumPy's mean, within its precision."""
    import ml_dtypes
    from gpucoll import ddp_comm_hooks as hooks

    def run(hook: Callable[..., Any] | None, state: Any, it: int) -> list[Any]:
        red = gpucoll.Reducer(params(), bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
        if hook is not None:
            red.register_comm_hook(state, hook)
        return [np.array(g) for g in red.reduce(grads_of(r, it))]

    want = mean_of(5, w)
    default = run(None, None, 5)
    # allreduce_hook is torch's default, bit for bit (divide, then sum); the default divides
    # the sum once: the same bits where the world size is a power of two
    for a, b in zip(run(hooks.allreduce_hook, None, 5), divided_sum(5, w, SHAPES)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(default, folded_mean(5, w, SHAPES)):
        np.testing.assert_array_equal(a, b)
    if w & (w - 1) == 0:
        for a, b in zip(run(hooks.allreduce_hook, None, 5), default):
            np.testing.assert_array_equal(a, b)

    def rounded(dtype: Any) -> list[np.ndarray]:
        """The reference for a compress hook: each rank's gradient / w rounded to dtype,
        summed in float64 (the sum's own rounding is within the tolerance below)."""
        per_rank = [grads_of(k, 5) for k in range(w)]
        return [np.sum([(g[i].astype(dtype) / np.array(w, dtype)).astype(np.float64) for g in per_rank], axis=0)
                for i in range(len(SHAPES))]
    fp16 = run(hooks.fp16_compress_hook, None, 5)
    close(fp16, rounded(np.float16), 2 ** -10 * (w + 1), 2 ** -14 * (w + 1), "fp16_compress_hook")
    assert all(g.dtype == np.float32 for g in fp16)
    bf16 = run(hooks.bf16_compress_hook, None, 5)
    close(bf16, rounded(ml_dtypes.bfloat16), 2 ** -7 * (w + 1), 2 ** -14 * (w + 1), "bf16_compress_hook")
    # not exact in float32: a bfloat16 sum has fewer bits (the compression is real)
    if w > 1:
        assert any(np.abs(a - b).max() > 1e-6 for a, b in zip(bf16, default))
    # the wrappers around allreduce_hook are the compress hooks (torch's docstring)
    for a, b in zip(run(hooks.fp16_compress_wrapper(hooks.allreduce_hook), None, 5), fp16):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(run(hooks.bf16_compress_wrapper(hooks.allreduce_hook), None, 5), bf16):
        np.testing.assert_array_equal(a, b)
    close(default, want, 1e-6, 1e-7, "default")


def check_powersgd(gpucoll: Any, r: int, w: int) -> None:
    from gpucoll import ddp_comm_hooks as hooks

    with pytest.raises(ValueError, match="Expect `start_powerSGD_iter` > 1"):
        hooks.PowerSGDState(None, start_powerSGD_iter=1)
    shapes = [(40, 30), (30,), (30, 20), (3, 5, 4)]
    ps = [np.zeros(s, np.float32) for s in shapes]
    u = np.linspace(1, 2, 40, dtype=np.float32)[:, None]
    v = np.linspace(-1, 1, 30, dtype=np.float32)[None, :]
    x = np.linspace(0.5, 1, 30, dtype=np.float32)[:, None]
    y = np.linspace(1, 3, 20, dtype=np.float32)[None, :]
    vec = np.arange(30, dtype=np.float32) * (r + 1)
    cube = np.full((3, 5, 4), r + 1.0, np.float32)

    def grads(it: int) -> list[np.ndarray]:
        scale = (r + 1) * (it + 1)  # rank-1 matrices, one direction on every rank
        return [u @ v * scale, vec, x @ y * scale, cube]

    def mean_scale(it: int) -> float:
        return sum((k + 1) * (it + 1) for k in range(w)) / w

    for batch in (False, True):
        state = hooks.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                    batch_tensors_with_same_shape=batch)
        red = gpucoll.Reducer(ps)
        red.register_comm_hook(state, hooks.powerSGD_hook)
        for it in range(5):
            out = red.reduce(grads(it))
            # a rank-1 gradient is sent exactly by rank-1 factors (error feedback stays ~0)
            np.testing.assert_allclose(out[0], u @ v * mean_scale(it), rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(out[2], x @ y * mean_scale(it), rtol=1e-4, atol=1e-4)
            # vectors and too-small matrices go as they are
            np.testing.assert_allclose(out[1], np.arange(30) * (w + 1) / 2, rtol=1e-6)
            np.testing.assert_allclose(out[3], np.full((3, 5, 4), (w + 1) / 2), rtol=1e-6)
        assert state.iter == 5
        # torch's accounting: 40x30, 30x20 and the cube as 3x20 go at rank 1; 3 iterations compressed
        rate, before, after = state.compression_stats()
        assert (before, after) == (3 * (1200 + 30 + 600 + 60), 3 * (70 + 30 + 50 + 23)), (before, after)

    # error feedback on a full-rank gradient: what was not sent this time is added next time,
    # so the sum of the outputs plus the final error is the sum of the (averaged) inputs
    state = hooks.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    red = gpucoll.Reducer([np.zeros((40, 30), np.float32)])
    red.register_comm_hook(state, hooks.powerSGD_hook)
    rng = np.random.default_rng(7)  # the same on every rank: the mean is the input itself
    total_in = np.zeros((40, 30))
    total_out = np.zeros((40, 30))
    for it in range(6):
        g = rng.standard_normal((40, 30)).astype(np.float32)
        out = red.reduce([g])[0]
        total_in += g
        total_out += out
        if it >= 2:
            assert np.abs(out - g).max() > 1e-3, "a rank-2 approximation of a random matrix is not exact"
    np.testing.assert_allclose(total_out + state.error_dict[0].reshape(40, 30), total_in, rtol=1e-4, atol=1e-3)
    # warm start: Q persists between iterations
    assert 0 in state.q_memory_dict and state.q_memory_dict[0].size == 30 * 2


def check_grad_bucket_and_future(gpucoll: Any, r: int, w: int) -> None:
    """GradBucket's methods as a hook sees them; a hook's error reaches wait() on every
    rank and the next iteration is whole."""
    from gpucoll import ddp_comm_hooks as hooks

    ps = params()
    seen: list[Any] = []

    def inspecting(state: Any, bucket: Any) -> Any:
        buf = bucket.buffer()
        assert buf.ndim == 1 and buf.dtype == np.float32
        grads, members = bucket.gradients(), bucket.parameters()
        assert all(np.shares_memory(g, buf) for g in grads)
        assert [g.shape for g in grads] == [p.shape for p in members]
        assert all(any(m is p for p in ps) for m in members)
        sizes = [g.size for g in grads]
        assert bucket.offsets() == [int(x) for x in np.cumsum([0, *sizes[:-1]])]
        assert buf.size == sum(sizes)
        copy = buf.copy()
        bucket.set_buffer(copy)
        assert bucket.buffer() is copy and np.shares_memory(bucket.gradients()[0], buf)
        seen.append(bucket.index())
        return hooks.allreduce_hook(state, bucket)  # reduces the copy: the Reducer copies it back

    red = gpucoll.Reducer(ps, bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
    red.register_comm_hook(None, inspecting)
    close(red.reduce(grads_of(r, 0)), mean_of(0, w), 1e-6, 1e-7, "a hook that replaces the buffer")
    assert seen == list(range(len(red.bucket_indices)))

    calls = [0]

    def failing_then(state: Any, bucket: Any) -> Any:
        calls[0] += 1
        fut = hooks.allreduce_hook(state, bucket)
        if calls[0] == 2:  # the second bucket of the first iteration, on every rank
            def boom(f: Any) -> Any:
                raise ValueError("decompression failed")
            return fut.then(boom)
        return fut
    red = gpucoll.Reducer(params(), bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
    red.register_comm_hook(None, failing_then)
    with pytest.raises(ValueError, match="decompression failed"):
        red.reduce(grads_of(r, 0))
    close(red.reduce(grads_of(r, 1)), mean_of(1, w), 1e-6, 1e-7, "after a hook's error")

    empty = hooks.Future()
    with pytest.raises(RuntimeError, match="empty Future"):
        empty.wait()
    done = hooks.Future()
    done.set_exception(KeyError("x"))
    with pytest.raises(KeyError):
        done.then(lambda f: f.value()).wait()
    assert done.done()


def numpy_world(name: str) -> str:
    import gpucoll

    r, w = gpucoll.get_rank(), gpucoll.get_world_size()
    CHECKS[name](gpucoll, r, w)
    return "ok"


CHECKS: dict[str, Callable[[Any, int, int], None]] = {
    "default_average": check_default_average,
    "mixed_dtypes": check_mixed_dtypes,
    "arrival_order_and_rebuild": check_arrival_order_and_rebuild,
    "overlap": check_overlap,
    "missing_gradient": check_missing_gradient,
    "every_path_is_one_collective": check_every_path_is_one_collective,
    "verify": check_verify,
    "broadcast_coalesced": check_broadcast_coalesced,
    "torch_hook_tests": check_torch_hook_tests,
    "every_hook": check_every_hook,
    "powersgd": check_powersgd,
    "grad_bucket_and_future": check_grad_bucket_and_future,
}


def all_checks() -> list[str]:
    import gpucoll

    r, w = gpucoll.get_rank(), gpucoll.get_world_size()
    done = []
    for name, check in CHECKS.items():
        check(gpucoll, r, w)
        done.append(name)
    return done


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_reducer_and_hooks_numpy(world_size: int) -> None:
    assert run_spmd(all_checks, world_size, timeout=240, pg_timeout=30) == [list(CHECKS)] * world_size


def one_rank_skips_an_iteration() -> str:
    """Rank 1 never reduces (and stays alive): rank 0's wait() ends with a DistBackendError
    within its timeout, naming the op, instead of hanging."""
    import gpucoll

    red = gpucoll.Reducer(params(), bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
    if gpucoll.get_rank() == 0:
        # a bucket whose peer is late goes to the CPU backend's worker, and the timeout
        # given to wait() bounds it (one that runs on the caller's thread: the group's)
        with pytest.raises(gpucoll.DistBackendError,
                           match=r"all_reduce.*(timed out waiting for rank 1|did not complete within 2 s)"):
            red.reduce(grads_of(0, 0), timeout=2)
    else:
        import time

        time.sleep(8)  # alive, elsewhere: not a shut-down peer
    return "ok"


def test_a_rank_that_skips_an_iteration_is_a_timeout_not_a_hang() -> None:
    assert run_spmd(one_rank_skips_an_iteration, 2, timeout=120, pg_timeout=3) == ["ok", "ok"]


def a_hook_beside_the_default() -> str:
    """Rank 1 registers allreduce_hook (a SUM of divided gradients), rank 0 keeps the
    default (the bucket's AVG): the CPU backend names the mismatch on both, never a
    wrong average."""
    import gpucoll
    from gpucoll.ddp_comm_hooks import allreduce_hook

    red = gpucoll.Reducer(params(), bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
    if gpucoll.get_rank() == 1:
        red.register_comm_hook(None, allreduce_hook)
    with pytest.raises(gpucoll.DistBackendError, match=r"all_reduce.*reduce op \(rank 0: AVG, rank 1: SUM\)"):
        red.reduce(grads_of(gpucoll.get_rank(), 0))
    return "ok"


def test_a_hook_on_one_rank_beside_the_default_is_a_named_mismatch() -> None:
    assert run_spmd(a_hook_beside_the_default, 2, timeout=120, pg_timeout=10) == ["ok", "ok"]
