"""The NCCL backend without a GPU.

* Library loading, version, the ctypes shim and unique ids against the real CuPy and
  libnccl (they work without a GPU), and the unique-id rendezvous through a real
  TCPStore across processes.
* The whole backend (plans, streams, events, Works, abort, coalescing, splits)
  driven through an in-process fake of CUDA and NCCL (tests/_nccl_fake.py): every
  collective x op x dtype at world sizes 1-4, checked against NumPy.
* The CUDA kernels compiled as host C++ and checked against NumPy, and compiled to
  PTX by nvcc where one is installed.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
import weakref
from typing import Any, Callable

import numpy as np
import pytest

from gpucoll._buffer import DTYPES, Buffer, Device
from gpucoll._backends.nccl import lib as _nccl_lib
from gpucoll._backends.nccl.lib import Features, features_of, version_tuple
from gpucoll._backends.nccl.plan import KTYPES, Planner, kernel_name, resolve_reduction
from gpucoll._backends.nccl.backend import NCCLBackend, nccl_unavailable_reason, rendezvous
from gpucoll.errors import BackendUnavailableError, DistBackendError
from gpucoll._reduce_op import ReduceOp, make_premul_sum
from gpucoll.store import HashStore, PrefixStore

sys.path.insert(0, os.path.dirname(__file__))
from _nccl_fake import FakeFabric, FakeRuntime, device_array, np_dtype, read, read_on_stream  # noqa: E402
from _nccl_reference import DTYPE_NAMES, OPS, close, defined, make_input, reference  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has_gpu() -> bool:
    return nccl_unavailable_reason() is None


# ============================================================ import hygiene and availability

def test_import_gpucoll_and_the_nccl_module_import_no_cupy() -> None:
    code = ("import sys, gpucoll, gpucoll._backends.nccl.backend, gpucoll._backends.nccl.kernels\n"
            "print('cupy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(_has_gpu(), reason="a usable GPU is present")
def test_without_a_gpu_the_backend_is_unavailable_and_says_why() -> None:
    reason = nccl_unavailable_reason()
    assert reason is not None and "CUDA device" in reason
    with pytest.raises(BackendUnavailableError, match="CUDA device") as info:
        NCCLBackend(HashStore(), 0, 1, timeout=5.0, group_name="g", device_id=None)
    assert "NCCL backend cannot run here" in str(info.value)


def _run_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_without_cupy_the_reason_names_cupy_and_the_install_command() -> None:
    out = _run_python(
        "import sys\nsys.modules['cupy'] = None\n"
        "from gpucoll._backends.nccl.backend import nccl_unavailable_reason\n"
        "print(nccl_unavailable_reason())\n")
    assert "needs CuPy, which is not installed" in out
    assert 'pip install "gpucoll[cuda12]"' in out and "gpucoll[cuda13]" in out


def test_without_nccl_the_reason_names_the_nccl_library() -> None:
    out = _run_python(
        "import sys, types, cupy\n"
        "sys.modules['cupy.cuda.nccl'] = types.SimpleNamespace(available=False)\n"
        "from gpucoll._backends.nccl.backend import nccl_unavailable_reason\n"
        "print(nccl_unavailable_reason())\n")
    assert "found no NCCL library (libnccl.so.2)" in out and "nvidia-nccl-cu12" in out


# ============================================================ the loaded library

def test_version_and_shim_are_those_of_the_library_cupy_loaded() -> None:
    from cupy.cuda import nccl

    lib = _nccl_lib.load()
    assert lib.version == version_tuple(nccl.get_version())
    assert lib.version >= (2, 18, 0)
    assert lib.shim is not None, lib.shim_error
    assert lib.library_path == _nccl_lib.loaded_library_path()
    assert os.path.basename(lib.library_path or "").startswith("libnccl.so")
    assert lib.shim.version() == nccl.get_version()
    assert lib.shim.error_string(6) and lib.shim.async_error(0) == 0
    f = lib.features
    assert f.avg and f.premul_sum and f.comm_split and f.async_error
    assert f.fp8 == (lib.version >= (2, 24, 0))
    assert f.all_to_all == f.gather == f.scatter == (lib.version >= (2, 28, 0))


def test_version_codes_and_features_by_version() -> None:
    assert version_tuple(2708) == (2, 7, 8)
    assert version_tuple(21805) == (2, 18, 5)
    assert version_tuple(23203) == (2, 32, 3)
    lib = _nccl_lib.load()
    old = features_of(20905, lib.shim, lib.nccl)
    assert not old.avg and not old.premul_sum and not old.comm_split and not old.all_to_all
    mid = features_of(21805, lib.shim, lib.nccl)
    assert mid.avg and mid.premul_sum and mid.comm_split and not mid.fp8 and not mid.gather
    assert not features_of(23203, None, lib.nccl).premul_sum  # no shim, no PreMulSum


def test_unique_ids_from_the_real_library() -> None:
    from cupy.cuda import nccl

    a = _nccl_lib.normalise_unique_id(nccl.get_unique_id())
    b = _nccl_lib.normalise_unique_id(nccl.get_unique_id())
    assert len(a) == 128 and a != b
    signed = tuple(x - 256 if x > 127 else x for x in a)  # CuPy < 14's form
    assert _nccl_lib.normalise_unique_id(signed) == a
    assert _nccl_lib.comm_id_arg(a, "14.2.0") == a
    assert _nccl_lib.comm_id_arg(a, "13.6.0") == signed
    assert all(-128 <= c <= 127 for c in signed)
    with pytest.raises(ValueError, match="128 bytes"):
        _nccl_lib.normalise_unique_id(b"x" * 12)


def test_premul_factors_encode_like_numpy() -> None:
    import ml_dtypes

    for value in (0.5, -3.25, 1 / 3, 1e-3, 250.0):
        for name, np_type in (("float64", np.float64), ("float32", np.float32), ("float16", np.float16),
                              ("bfloat16", ml_dtypes.bfloat16), ("float8_e4m3fn", ml_dtypes.float8_e4m3fn)):
            got = _nccl_lib.encode_scalar(value, DTYPES[name])
            assert got == np.asarray(value, np.float64).astype(np_type).tobytes(), (name, value)
    with pytest.raises(ValueError, match="out of range for float16"):
        _nccl_lib.encode_scalar(1e6, DTYPES["float16"])


# ============================================================ unique-id rendezvous through a real store

def _rendezvous_body() -> list[int]:
    from gpucoll.clusters.base import STORE_TOKEN_ENV
    from gpucoll.store import PrefixStore, TCPStore
    from cupy.cuda import nccl

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=20.0, token=os.environ[STORE_TOKEN_ENV])
    uid = rendezvous(PrefixStore("pg/g", store), rank, size, timeout=20.0, group_name="g",
                     make_uid=nccl.get_unique_id)
    return list(uid)


def test_unique_id_rendezvous_through_a_tcp_store_across_processes() -> None:
    from gpucoll.testing import run_spmd

    results = run_spmd(_rendezvous_body, world_size=3, init=False, timeout=90.0)
    assert len(results[0]) == 128
    assert results[0] == results[1] == results[2]


def test_rendezvous_times_out_naming_the_group_and_the_arrivals() -> None:
    store = HashStore()
    with pytest.raises(DistBackendError, match=r"group 'g': rank 1 did not get the NCCL unique id"):
        rendezvous(store, 1, 2, timeout=0.2, group_name="g", make_uid=lambda: b"\0" * 128)
    with pytest.raises(DistBackendError, match=r"group 'g': only 1 of 3 ranks reached"):
        rendezvous(store, 0, 3, timeout=0.2, group_name="g", make_uid=lambda: b"\1" * 128)


# ============================================================ the fake-GPU harness

DEFAULT_FEATURES = Features(version=(2, 32, 3), all_to_all=True, gather=True, scatter=True)
OLD_FEATURES = Features(version=(2, 19, 3), avg=True, premul_sum=False, fp8=False, comm_split=True)


def run_rank_threads(size: int, main: Callable[[int], Any], fabric: FakeFabric) -> list[Any]:
    """Run ``main(rank)`` on ``size`` threads named ``rank<N>``; fail with every rank's
    traceback if any raised, or if one is still running after 120 s (a hang)."""
    results: list[Any] = [None] * size
    errors: list[str | None] = [None] * size

    def wrapped(rank: int) -> None:
        try:
            results[rank] = main(rank)
        except BaseException:
            errors[rank] = traceback.format_exc()

    threads = [threading.Thread(target=wrapped, args=(r,), name=f"rank{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    fabric.close()
    assert not any(t.is_alive() for t in threads), "a rank hung"
    failed = [f"--- rank {r} ---\n{e}" for r, e in enumerate(errors) if e]
    assert not failed, "\n".join(failed)
    return results


def run_world(size: int, body: Callable[[NCCLBackend, FakeRuntime, int], Any], *,
              features: Features = DEFAULT_FEATURES, cc: tuple[int, int] = (9, 0), timeout: float = 10.0,
              eager: bool = True, hang: float = 20.0, op_delay: float = 0.0,
              shutdown: bool = True) -> list[Any]:
    """Run ``body(backend, runtime, rank)`` on ``size`` rank threads sharing one fake GPU."""
    fabric = FakeFabric(hang_limit=hang)
    store = HashStore(timeout=timeout)

    def main(rank: int) -> Any:
        rt = FakeRuntime(fabric, features=features, cc=cc, op_delay=op_delay)
        be = NCCLBackend(PrefixStore("pg/g", store), rank, size, timeout=timeout, group_name="g",
                         device_id=0 if eager else None, _runtime=rt)
        try:
            return body(be, rt, rank)
        finally:
            if shutdown:
                be.shutdown()

    results = run_rank_threads(size, main, fabric)
    assert not fabric.errors, fabric.errors
    return results


def dev(rt: FakeRuntime, values: np.ndarray, name: str | None = None) -> Buffer:
    return device_array(rt, values, DTYPES[name or values.dtype.name])


# ============================================================ reductions against NumPy

def _reduction_sweep(be: NCCLBackend, rt: FakeRuntime, rank: int, *, fp8: bool = True,
                     names: list[str] = DTYPE_NAMES, ops: list[Any] = OPS, n: int = 7) -> list[str]:
    size = be.size
    bad: list[str] = []
    for name in names:
        dt = np_dtype(name)
        for op in ops:
            ins = [make_input(name, n, r) for r in range(size)]
            ok = defined(name, op, fp8)
            want = reference(ins, name, op, size) if ok else None
            for coll in ("all_reduce", "all_reduce_into", "reduce", "reduce_scatter_single", "reduce_scatter",
                         "coalesced"):
                what = f"{coll} {name} {op}"
                try:
                    if coll == "all_reduce":
                        buf = dev(rt, ins[rank], name)
                        be.all_reduce(buf, op).synchronize()
                        got, expect = read(rt, buf, dt), want
                    elif coll == "all_reduce_into":
                        inp = dev(rt, ins[rank], name)
                        out = dev(rt, np.zeros(n, dt), name)
                        be.all_reduce_into(out, inp, op).synchronize()
                        got, expect = read(rt, out, dt), want
                        if not np.array_equal(read(rt, inp, dt).view(np.uint8), ins[rank].view(np.uint8)):
                            bad.append(f"{what}: the input was modified")
                    elif coll == "reduce":
                        buf = dev(rt, ins[rank], name)
                        dst = size - 1
                        be.reduce(buf, dst, op).synchronize()
                        got = read(rt, buf, dt)
                        expect = want if rank == dst else ins[rank]  # non-roots unchanged
                    elif coll == "coalesced":
                        a, b = dev(rt, ins[rank], name), dev(rt, ins[rank][::-1].copy(), name)
                        want_b = reference([x[::-1].copy() for x in ins], name, op, size) if ok else None
                        be.all_reduce_coalesced([a, b], op).synchronize()
                        got = np.concatenate([read(rt, a, dt), read(rt, b, dt)])
                        expect = np.concatenate([want, want_b]) if ok else None
                    else:
                        chunks = [make_input(name, n, r, salt=j) for j in range(size) for r in [rank]]
                        all_chunks = [[make_input(name, n, r, salt=j) for j in range(size)] for r in range(size)]
                        out = dev(rt, np.zeros(n, dt), name)
                        if coll == "reduce_scatter_single":
                            inp = dev(rt, np.concatenate(chunks), name)
                            be.reduce_scatter_single(out, inp, op).synchronize()
                        else:
                            inputs = [dev(rt, c, name) for c in chunks]  # separate allocations
                            be.reduce_scatter(out, inputs, op).synchronize()
                        got = read(rt, out, dt)
                        expect = reference([all_chunks[r][rank] for r in range(size)], name, op, size) if ok else None
                except TypeError as exc:
                    if ok:
                        bad.append(f"{what}: unexpected TypeError {exc}")
                    continue
                if not ok:
                    bad.append(f"{what}: no TypeError for an undefined reduction")
                elif expect is None or not close(got, expect, name):
                    bad.append(f"{what}: got {got!r}, want {expect!r}")
    return bad


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_reduction_op_and_dtype_matches_numpy(size: int) -> None:
    results = run_world(size, lambda be, rt, rank: _reduction_sweep(be, rt, rank))
    bad = [b for r in results for b in r]
    assert not bad, "\n".join(bad[:30])


def test_reductions_on_an_older_nccl_use_the_fallbacks() -> None:
    # No PreMulSum (scale kernels), no float8 types, no ncclAlltoAll/Gather/Scatter.
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> list[str]:
        bad = _reduction_sweep(be, rt, rank, fp8=False, names=[n for n in DTYPE_NAMES if "float8" not in n],
                               ops=[ReduceOp.SUM, ReduceOp.AVG, ReduceOp.BXOR, make_premul_sum(0.5),
                                    make_premul_sum(-2.0)])
        assert any(k.startswith("gpucoll_scale_f") for k in rt.kernels_launched)
        return bad
    results = run_world(3, body, features=OLD_FEATURES)
    bad = [b for r in results for b in r]
    assert not bad, "\n".join(bad[:30])


def test_kernel_path_with_arrays_that_divide_evenly_and_not() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> list[str]:
        bad = []
        for n in (0, 1, 3, 12, 13):
            bad += _reduction_sweep(be, rt, rank, names=["int16", "uint64", "bool"],
                                    ops=[ReduceOp.BXOR, ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX], n=n)
        return bad
    for features in (DEFAULT_FEATURES, OLD_FEATURES):
        bad = [b for r in run_world(3, body, features=features) for b in r]
        assert not bad, "\n".join(bad[:30])


def test_float8_reductions_need_sm90() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> str:
        buf = dev(rt, np.zeros(4, np.uint8), "float8_e4m3fn")
        with pytest.raises(TypeError, match="compute capability >= 9.0") as info:
            be.all_reduce(buf, ReduceOp.SUM)
        be.broadcast(buf, 0).synchronize()  # data movement works everywhere
        return str(info.value)
    msg = run_world(2, body, cc=(8, 0))[0]
    assert "float8_e4m3fn" in msg


def test_integer_premul_needs_an_integral_factor() -> None:
    planner = Planner(0, 2, DEFAULT_FEATURES, True, lambda n: 0)
    with pytest.raises(TypeError, match="integral factor"):
        planner.reduction(DTYPES["int32"], make_premul_sum(0.5))


# ============================================================ data movement against NumPy

def _movement_sweep(be: NCCLBackend, rt: FakeRuntime, rank: int) -> list[str]:
    size, bad = be.size, []
    for name in ("bfloat16", "float8_e5m2", "int16", "complex128", "bool", "float32"):
        dt = np_dtype(name)
        for n in (0, 5):
            mine = make_input(name, n, rank)
            alls = [make_input(name, n, r) for r in range(size)]
            # broadcast from the last rank
            b = dev(rt, mine, name)
            be.broadcast(b, size - 1).synchronize()
            if not np.array_equal(read(rt, b, dt).view(np.uint8), alls[-1].view(np.uint8)):
                bad.append(f"broadcast {name} n={n}")
            # all_gather into separate arrays and into one
            outs = [dev(rt, np.zeros(n, dt), name) for _ in range(size)]
            be.all_gather(outs, dev(rt, mine, name)).synchronize()
            if not all(np.array_equal(read(rt, o, dt).view(np.uint8), alls[r].view(np.uint8)) for r, o in enumerate(outs)):
                bad.append(f"all_gather {name} n={n}")
            flat = dev(rt, np.zeros(n * size, dt), name)
            be.all_gather_single(flat, dev(rt, mine, name)).synchronize()
            if not np.array_equal(read(rt, flat, dt).view(np.uint8), np.concatenate(alls).view(np.uint8)):
                bad.append(f"all_gather_single {name} n={n}")
            # gather and scatter to/from rank 0
            g_outs = [dev(rt, np.zeros(n, dt), name) for _ in range(size)] if rank == 0 else None
            be.gather(g_outs, dev(rt, mine, name), 0).synchronize()
            if rank == 0 and not all(np.array_equal(read(rt, o, dt).view(np.uint8), alls[r].view(np.uint8))
                                     for r, o in enumerate(g_outs or [])):
                bad.append(f"gather {name} n={n}")
            s_out = dev(rt, np.zeros(n, dt), name)
            s_in = [dev(rt, make_input(name, n, r, salt=9), name) for r in range(size)] if rank == 0 else None
            be.scatter(s_out, s_in, 0).synchronize()
            if not np.array_equal(read(rt, s_out, dt).view(np.uint8), make_input(name, n, rank, salt=9).view(np.uint8)):
                bad.append(f"scatter {name} n={n}")
            # all_to_all: chunk j of rank r is make_input(n, r, salt=j)
            a_in = [dev(rt, make_input(name, n, rank, salt=j), name) for j in range(size)]
            a_out = [dev(rt, np.zeros(n, dt), name) for _ in range(size)]
            be.all_to_all(a_out, a_in).synchronize()
            if not all(np.array_equal(read(rt, o, dt).view(np.uint8), make_input(name, n, r, salt=rank).view(np.uint8))
                       for r, o in enumerate(a_out)):
                bad.append(f"all_to_all {name} n={n}")
        # all_to_all_single with uneven splits: rank r sends (r + j) % 3 elements to rank j
        in_counts = [(rank + j) % 3 for j in range(size)]
        out_counts = [(j + rank) % 3 for j in range(size)]
        payload = np.concatenate([make_input(name, in_counts[j], rank, salt=j) for j in range(size)])
        out = dev(rt, np.zeros(sum(out_counts), dt), name)
        be.all_to_all_single(out, dev(rt, payload, name), out_counts, in_counts).synchronize()
        want = np.concatenate([make_input(name, out_counts[j], j, salt=rank) for j in range(size)])
        if not np.array_equal(read(rt, out, dt).view(np.uint8), want.view(np.uint8)):
            bad.append(f"all_to_all_single {name}")
    return bad


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_data_movement_matches_numpy(size: int) -> None:
    bad = [b for r in run_world(size, _movement_sweep) for b in r]
    assert not bad, bad


def test_data_movement_without_ncclgather_scatter_alltoall() -> None:
    bad = [b for r in run_world(3, _movement_sweep, features=OLD_FEATURES) for b in r]
    assert not bad, bad


def test_point_to_point_and_batches() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        size = be.size
        nxt, prv = (rank + 1) % size, (rank - 1) % size
        out = dev(rt, np.zeros(6, np.float32))
        w = be.batch_p2p([("send", dev(rt, np.full(6, rank, np.float32)), nxt, 0),
                          ("recv", out, prv, 0)])
        w.synchronize()
        assert read(rt, out, np.float32).tolist() == [prv] * 6
        if rank == 0:
            be.send(dev(rt, np.arange(3, dtype=np.int64)), 1, tag=7).synchronize()
        elif rank == 1:
            got = dev(rt, np.zeros(3, np.int64))
            be.recv(got, 0, tag=7).synchronize()
            assert read(rt, got, np.int64).tolist() == [0, 1, 2]
        with pytest.raises(ValueError, match="any source"):
            be.recv(out, None, 0)
        with pytest.raises(ValueError, match="'send' or 'recv'"):
            be.batch_p2p([("put", out, nxt, 0)])
    run_world(3, body)


# ============================================================ streams, lifetimes, Works

def test_wait_orders_the_callers_stream_without_blocking_the_host() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        buf = dev(rt, np.full(4, rank + 1, np.float32))
        work = be.all_reduce(buf, ReduceOp.SUM)
        t0 = time.perf_counter()
        assert work.wait() is True
        host = time.perf_counter() - t0
        assert host < 0.15, f"wait() blocked the host for {host:.3f} s"
        # A later read queued on the caller's stream sees the result (the stream waits).
        assert read_on_stream(rt, buf, np.float32).get(timeout=10).tolist() == [3.0] * 4
        work.synchronize()
        assert work.is_completed() and work.is_success()
        info = work.info()
        assert info.op_type == "all_reduce" and 0.0 <= info.active_duration < 5.0
    run_world(2, body, op_delay=0.3)


def test_an_explicit_producer_stream_is_linked_both_ways() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        from _nccl_fake import FakeStream
        user = FakeStream(rt.fabric, "user")
        gate = threading.Event()
        user.enqueue(lambda: None if gate.wait(10) else None)  # the producer's kernel is still running
        buf = device_array(rt, np.full(3, 2.0, np.float32), DTYPES["float32"], stream=user.ptr)
        rt.fabric.mem.view(buf.ptr, 12)[:] = np.full(3, 2.0, np.float32).view(np.uint8)
        work = be.all_reduce(buf, ReduceOp.SUM)
        time.sleep(0.1)
        assert not work.is_completed()  # waits for the producer's stream
        user.enqueue(lambda: rt.fabric.mem.view(buf.ptr, 12).__setitem__(slice(None), np.full(3, 5.0, np.float32).view(np.uint8)))
        gate.set()
        work.synchronize()
        assert read(rt, buf, np.float32).tolist() == [10.0] * 3  # the value after the producer's write
    run_world(2, body)


def test_arrays_and_temporaries_live_until_the_gpu_is_done() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        buf = dev(rt, np.arange(5, dtype=np.int16))
        owner = weakref.ref(buf.owner)
        before = rt.allocations
        work = be.all_reduce(buf, ReduceOp.BXOR)  # kernel path: needs a temporary
        assert rt.allocations > before
        del buf
        assert owner() is not None  # the Work holds the array while the op runs
        work.synchronize()
        assert owner() is None  # and lets go once it completed
    run_world(2, body, op_delay=0.2)


def test_in_place_all_reduce_allocates_no_device_memory() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        bufs = [dev(rt, np.ones(16, dt)) for dt in (np.float32, np.float16, np.int64, np.uint8)]
        before = rt.allocations
        for _ in range(3):
            for b in bufs:
                be.all_reduce(b, ReduceOp.SUM)
                be.all_reduce(b, ReduceOp.MAX)
        be.all_reduce(bufs[0], make_premul_sum(0.25)).synchronize()
        be.all_reduce(bufs[0], ReduceOp.AVG).synchronize()
        assert rt.allocations == before
    run_world(2, body)


def test_completed_works_are_released_without_a_watchdog() -> None:
    from gpucoll._backends.nccl.backend import _PRUNE_AT

    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        owners = []
        for _ in range(3 * _PRUNE_AT):
            buf = dev(rt, np.ones(2, np.float32))
            owners.append(weakref.ref(buf.owner))
            be.all_reduce(buf, ReduceOp.SUM).wait()
            del buf
        be.all_reduce(dev(rt, np.ones(2, np.float32)), ReduceOp.SUM).synchronize()  # everything before is done
        be.all_reduce(dev(rt, np.ones(2, np.float32)), ReduceOp.SUM)  # issuing completes them
        assert len(be._pending) <= 2
        assert all(o() is None for o in owners)  # and their arrays were let go
    run_world(2, body)


def test_graph_capture_joins_the_streams_and_completes_at_once() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        rt.capturing.add(rt.current_stream())
        buf = dev(rt, np.full(4, 1.0, np.float32))
        work = be.all_reduce(buf, ReduceOp.SUM)
        assert work.is_completed() and rt.unpooled_events == 2 and not be._pending
        rt.capturing.clear()
        # In the fake the "graph" ran eagerly: the caller's stream still sees the result in order.
        assert read_on_stream(rt, buf, np.float32).get(timeout=10).tolist() == [2.0] * 4
    run_world(2, body)


def test_lazy_creation_on_the_first_ops_device() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        assert be._comm is None
        buf = dev(rt, np.ones(2, np.float64))
        be.all_reduce(buf, ReduceOp.SUM).synchronize()
        assert be._comm is not None and read(rt, buf, np.float64).tolist() == [3.0, 3.0]
        other = Buffer(buf.ptr, buf.nbytes, buf.dtype, buf.shape, Device("cuda", 1), owner=buf.owner)
        with pytest.raises(ValueError, match="must be on cuda:0"):
            be.all_reduce(other, ReduceOp.SUM)
        host = Buffer(buf.ptr, buf.nbytes, buf.dtype, buf.shape, Device("cpu"), owner=buf.owner)
        with pytest.raises(ValueError, match="must be on cuda:0"):
            be.all_reduce(host, ReduceOp.SUM)
        be.barrier().wait()
    run_world(3, body, eager=False)


# ============================================================ failures: abort, async errors, shutdown

def test_abort_fails_the_hung_op_and_every_later_one_naming_op_seq_group() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> str:
        if rank == 1:
            time.sleep(1.0)  # never joins the all_reduce; leaves once rank 0 has aborted
            be.abort("rank 1 left")
            return ""
        buf = dev(rt, np.ones(4, np.float32))
        work = be.all_reduce(buf, ReduceOp.SUM)
        work.seq, work.group_name = 5, "g"
        time.sleep(0.3)
        assert not work.is_completed()
        be.abort("all_reduce (seq 5) on group 'g' did not complete within the group's timeout of 0.3 s")
        assert work.is_completed() and not work.is_success()
        with pytest.raises(DistBackendError, match=r"all_reduce \(seq 5\) on group 'g' failed: .*timeout"):
            work.wait()
        later = be.broadcast(buf, 0)
        later.seq, later.group_name = 6, "g"
        with pytest.raises(DistBackendError, match=r"broadcast \(seq 6\) on group 'g' failed: .*timeout"):
            later.wait()
        barrier = be.barrier()
        barrier.seq = 7
        with pytest.raises(DistBackendError, match=r"barrier \(seq 7\)"):
            barrier.wait()
        return str(work.exception())
    msg = run_world(2, body, hang=5.0)[0]
    assert "did not complete" in msg


def test_an_asynchronous_nccl_error_aborts_the_group() -> None:
    alive: list[Buffer] = []  # the aborted op may still run on the fake stream after body returns

    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        buf = dev(rt, np.ones(4, np.float32))
        alive.append(buf)
        be.all_reduce(buf, ReduceOp.SUM).synchronize()
        assert be._comm is not None
        be._comm.async_code = 6  # type: ignore[attr-defined]  # ncclRemoteError
        work = be.all_reduce(buf, ReduceOp.SUM)
        with pytest.raises(DistBackendError, match="ncclRemoteError"):
            work.synchronize()
        with pytest.raises(DistBackendError, match="asynchronous error"):
            be.all_reduce(buf, ReduceOp.SUM).wait()
    run_world(1, body)


def test_shutdown_destroys_the_communicator_and_later_ops_fail() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        buf = dev(rt, np.ones(4, np.float32))
        work = be.all_reduce(buf, ReduceOp.SUM)
        comm = be._comm
        be.shutdown()
        be.shutdown()  # idempotent
        assert comm is not None and comm.destroyed  # type: ignore[attr-defined]
        assert work.is_completed() and work.is_success()  # drained before destroying
        with pytest.raises(DistBackendError, match="was shut down"):
            be.all_reduce(buf, ReduceOp.SUM).wait()
    run_world(2, body, shutdown=False)


def test_an_nccl_error_while_issuing_raises_and_aborts() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        buf = dev(rt, np.ones(4, np.float32))
        be._comm.destroyed = True  # type: ignore[union-attr]  # every NCCL call now fails
        with pytest.raises(DistBackendError, match=r"all_reduce on group 'g' failed: FakeError"):
            be.all_reduce(buf, ReduceOp.SUM)
        with pytest.raises(DistBackendError, match="failed while being issued"):
            be.broadcast(buf, 0).wait()
    run_world(1, body)


# ============================================================ new groups

def test_split_with_ncclcommsplit_and_with_a_fresh_unique_id() -> None:
    for features in (DEFAULT_FEATURES, Features(version=(2, 17, 1), comm_split=False)):
        def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> tuple[int, float] | None:
            store = HashStore()
            evens = [r for r in range(be.size) if r % 2 == 0][::-1]  # new rank order: reversed
            odd_or_even = [r for r in range(be.size) if r % 2 == rank % 2]
            sub = be.split(odd_or_even, color=rank % 2, store=PrefixStore(f"pg/s{rank % 2}", SHARED),
                           group_name=f"s{rank % 2}", timeout=5.0)
            assert sub is not None and sub.size == len(odd_or_even)
            buf = dev(rt, np.full(2, rank, np.float32))
            sub.all_reduce(buf, ReduceOp.SUM).synchronize()
            mine = read(rt, buf, np.float32)[0]
            assert mine == sum(odd_or_even)
            only = be.split(evens, store=PrefixStore("pg/evens", SHARED), group_name="evens", timeout=5.0)
            if rank % 2:
                assert only is None
            else:
                assert only is not None and only.rank == evens.index(rank)
                only.shutdown()
            sub.shutdown()
            del store
            return sub.rank, float(mine)
        SHARED = HashStore()
        results = run_world(4, body, features=features)
        assert [r[0] for r in results] == [0, 0, 1, 1]


# ============================================================ plans: every rank issues the same collectives

def _collective_signature(plan: list[Any]) -> list[tuple[Any, ...]]:
    sig = []
    for _, calls, _ in plan:
        group = []
        for step in calls:
            if step[0] in ("send", "recv"):
                continue
            shared = tuple(x for i, x in enumerate(step[3:], 3) if not (step[0] in ("all_reduce", "reduce", "reduce_scatter") and i == 5))
            group.append((step[0],) + shared)
        sig.append(tuple(group))
    return sig


def test_plans_issue_the_same_collectives_on_every_rank_whatever_the_memory_layout() -> None:
    rng = np.random.default_rng(0)
    for features in (DEFAULT_FEATURES, OLD_FEATURES):
        for size in (1, 2, 3, 5):
            for name in ("int16", "float32", "bool", "uint8"):
                isz = DTYPES[name].itemsize
                n = int(rng.integers(0, 20))
                sigs: dict[str, set[Any]] = {}
                for rank in range(size):
                    planner = Planner(rank, size, features, True, lambda nbytes: 1 << 40)

                    def b(numel: int, ptr: int | None = None) -> Buffer:
                        return Buffer(int(rng.integers(1, 1 << 30)) * 64 if ptr is None else ptr,
                                      numel * isz, DTYPES[name], (numel,), Device("cuda", 0))
                    base = 1 << 20
                    lists = {  # adjacent on even ranks, scattered on odd ones
                        "adjacent": [b(n, base + j * n * isz) for j in range(size)],
                        "scattered": [b(n) for _ in range(size)],
                    }["adjacent" if rank % 2 == 0 else "scattered"]
                    plans = {
                        "all_gather": planner.all_gather(lists, b(n)),
                        "reduce_scatter": planner.reduce_scatter(b(n), lists, ReduceOp.MAX),
                        "gather": planner.gather(lists if rank == 0 else None, b(n), 0),
                        "scatter": planner.scatter(b(n), lists if rank == 0 else None, 0),
                        "bxor": planner.all_reduce(b(n), ReduceOp.BXOR) if name != "float32" else [],
                        "reduce": planner.reduce(b(n), size - 1, ReduceOp.MIN),
                    }
                    for key, plan in plans.items():
                        sigs.setdefault(key, set()).add(repr(_collective_signature(plan)))
                assert all(len(v) == 1 for v in sigs.values()), {k: v for k, v in sigs.items() if len(v) > 1}


def test_every_kernel_a_plan_can_name_is_in_the_kernel_source() -> None:
    names = set()
    for dtype in DTYPES.values():
        for op in OPS:
            for features in (DEFAULT_FEATURES, OLD_FEATURES):
                try:
                    red = resolve_reduction(dtype, op, 3, features, True)
                except TypeError:
                    continue
                if red.op is None:
                    names.add(kernel_name("reduce", red.ktype, red.kop))
                if red.divide:
                    names.add(kernel_name("avg_trunc", red.ktype))
                if red.scale is not None:
                    names.add(kernel_name("scale", red.ktype))
    lib = _host_kernels()
    missing = [n for n in sorted(names) if not hasattr(lib, n)]
    assert not missing
    from gpucoll._backends.nccl import kernels as _kernels
    for n in names:
        assert _kernels.signature(n)


# ============================================================ the CUDA kernels, as host C++

_PRELUDE = """struct gc_dim3 { unsigned int x, y, z; };
extern "C" { gc_dim3 threadIdx, blockIdx, blockDim, gridDim; }
#define __global__
#define __device__
#define __forceinline__ inline
"""


def _host_kernels() -> ctypes.CDLL:
    cache = getattr(_host_kernels, "lib", None)
    if cache is not None:
        return cache  # type: ignore[no-any-return]
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the kernels as host code")
    import tempfile

    from gpucoll._backends.nccl import kernels as _kernels

    tmp = tempfile.mkdtemp(prefix="gpucoll-kernels-")
    prelude = os.path.join(tmp, "prelude.h")
    with open(prelude, "w") as f:
        f.write(_PRELUDE)
    out = os.path.join(tmp, "libreduce.so")
    src = str(_kernels.KERNEL_DIR / "reduce.cu")
    proc = subprocess.run([cxx, "-O1", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror", "-x", "c++",
                           "-include", prelude, src, "-o", out], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lib = ctypes.CDLL(out)
    _host_kernels.lib = lib  # type: ignore[attr-defined]
    return lib


def _launch_host(lib: ctypes.CDLL, name: str, n: int, args: tuple[Any, ...], grid: int = 2, block: int = 3) -> None:
    """Run kernel ``name`` as grid x block sequential 'threads' (the loops are grid-stride)."""
    from gpucoll._backends.nccl import kernels as _kernels

    ctypes_of = {"p": ctypes.c_void_p, "q": ctypes.c_longlong, "i": ctypes.c_int, "d": ctypes.c_double}
    sig = _kernels.signature(name)
    fn = getattr(lib, name)
    fn.restype = None
    fn.argtypes = [ctypes_of[t] for t in sig]
    dim = type(ctypes.c_uint * 3)
    for var in ("threadIdx", "blockIdx", "blockDim", "gridDim"):
        assert (ctypes.c_uint * 3).in_dll(lib, var) is not None
    block_dim = (ctypes.c_uint * 3).in_dll(lib, "blockDim")
    grid_dim = (ctypes.c_uint * 3).in_dll(lib, "gridDim")
    tid = (ctypes.c_uint * 3).in_dll(lib, "threadIdx")
    bid = (ctypes.c_uint * 3).in_dll(lib, "blockIdx")
    block_dim[0], grid_dim[0] = block, grid
    del dim
    for b in range(grid):
        for t in range(block):
            bid[0], tid[0] = b, t
            fn(*args)


@pytest.mark.parametrize("ktype", ["i8", "u8", "i16", "u16", "i32", "u32", "i64", "u64"])
def test_integer_kernels_match_numpy(ktype: str) -> None:
    lib = _host_kernels()
    name = {v: k for k, v in KTYPES.items() if k != "bool"}[ktype]
    dt = np.dtype(name)
    info = np.iinfo(dt)
    rng = np.random.default_rng(1)
    nrows, n, stride = 3, 11, 13
    rows = rng.integers(info.min, info.max, size=(nrows, stride), dtype=dt, endpoint=True)
    rows[:, :3] = np.array([info.min, info.max, -1 if info.min < 0 else 7], dtype=dt)  # edges: wrap around
    for op, fn in (("sum", np.add), ("prod", np.multiply), ("min", np.minimum), ("max", np.maximum),
                   ("band", np.bitwise_and), ("bor", np.bitwise_or), ("bxor", np.bitwise_xor)):
        r = rows.copy()
        out = np.zeros(n, dt)
        _launch_host(lib, f"gpucoll_reduce_{op}_{ktype}", n, (r.ctypes.data, out.ctypes.data, n, nrows, stride))
        assert np.array_equal(out, fn.reduce(rows[:, :n], axis=0, dtype=dt)), op
        # in place: out is one of the rows
        _launch_host(lib, f"gpucoll_reduce_{op}_{ktype}", n, (r.ctypes.data, r[1].ctypes.data, n, nrows, stride))
        assert np.array_equal(r[1, :n], fn.reduce(rows[:, :n], axis=0, dtype=dt)), op
    x = rows[0].copy()
    _launch_host(lib, f"gpucoll_avg_trunc_{ktype}", stride, (x.ctypes.data, stride, 3))
    want = [(abs(int(v)) // 3) * (1 if v >= 0 else -1) for v in rows[0]]
    assert x.tolist() == want
    x = rows[0].copy()
    _launch_host(lib, f"gpucoll_scale_{ktype}", stride, (x.ctypes.data, stride, -3))
    assert np.array_equal(x, np.multiply(rows[0], np.asarray(-3).astype(dt), dtype=dt))


def test_half_and_bfloat16_scale_kernels_round_like_numpy() -> None:
    import ml_dtypes

    lib = _host_kernels()
    every = np.arange(1 << 16, dtype=np.uint16)
    for ktype, np_type in (("f16", np.float16), ("bf16", ml_dtypes.bfloat16)):
        for factor in (1.0, 3.0, 0.1, -1e-3, 1e5):
            x = every.copy()
            _launch_host(lib, f"gpucoll_scale_{ktype}", x.size, (x.ctypes.data, x.size, factor), grid=1, block=1)
            with np.errstate(all="ignore"):  # inf and nan inputs, overflow to inf: expected here
                want = (every.view(np_type).astype(np.float32) * np.float32(factor)).astype(np_type)
            got = x.view(np_type)
            nan = np.isnan(want.astype(np.float32))
            assert np.array_equal(np.isnan(got.astype(np.float32)), nan), (ktype, factor)
            assert np.array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan]), (ktype, factor)
    for ktype, dt in (("f32", np.float32), ("f64", np.float64)):
        x = np.linspace(-3, 3, 17).astype(dt)
        want = x * dt(0.3)
        _launch_host(lib, f"gpucoll_scale_{ktype}", x.size, (x.ctypes.data, x.size, 0.3))
        assert np.array_equal(x, want)


def test_kernels_compile_to_ptx_with_nvcc() -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here")
    import tempfile

    from gpucoll._backends.nccl import kernels as _kernels

    out = os.path.join(tempfile.mkdtemp(prefix="gpucoll-ptx-"), "reduce.ptx")
    proc = subprocess.run([nvcc, "-ptx", "-arch=compute_80", "-o", out, str(_kernels.KERNEL_DIR / "reduce.cu")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    with open(out) as f:
        entries = [line.split()[2].split("(")[0] for line in f if line.startswith(".visible .entry")]
    assert len(entries) == 8 * 9 + 4 and "gpucoll_reduce_bxor_u64" in entries


def test_kernels_compile_with_nvrtc_as_cupy_compiles_them() -> None:
    # CuPy compiles kernels/reduce.cu with NVRTC on the GPU; NVRTC itself needs no
    # GPU, so CI (which installs the extra's NVRTC wheel) compiles the same source.
    try:
        from cupy_backends.cuda.libs import nvrtc

        version = nvrtc.getVersion()
    except Exception as exc:
        pytest.skip(f"no NVRTC here ({type(exc).__name__}: {exc}); the cuda12/cuda13 extras install it")
    from gpucoll._backends.nccl import kernels as _kernels

    prog = nvrtc.createProgram(_kernels.source("reduce"), "reduce.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, ["-arch=compute_90"])
        except Exception as exc:
            log = nvrtc.getProgramLog(prog)
            pytest.fail(f"NVRTC {version} rejected kernels/reduce.cu: {exc}\n{log!r}")
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    text = ptx.decode() if isinstance(ptx, bytes) else ptx
    entries = {line.split()[2].split("(")[0] for line in text.splitlines() if line.startswith(".visible .entry")}
    assert len(entries) == 8 * 9 + 4 and "gpucoll_reduce_bxor_u64" in entries
    for name in entries:
        _kernels.signature(name)  # every compiled kernel has a launch signature


@pytest.mark.skipif(_has_gpu(), reason="a usable GPU is present")
def test_compiling_kernels_without_a_gpu_is_a_clear_backend_error() -> None:
    from gpucoll._backends.nccl import kernels as _kernels

    with pytest.raises(BackendUnavailableError, match="NVRTC"):
        _kernels.get_kernel("gpucoll_reduce_bxor_u8", 0)


# ============================================================ the CuPy adapter, as far as it runs without a GPU

def test_cupy_adapter_binds_only_names_that_exist() -> None:
    from cupy.cuda import nccl

    from gpucoll._backends.nccl.runtime import CudaRuntime, CupyComm

    lib = _nccl_lib.load()
    rt = CudaRuntime(lib)  # binds every CuPy function it will call
    assert rt.features == lib.features
    assert rt.group_start.__self__ is lib.shim  # type: ignore[attr-defined]  # GIL-free ctypes calls
    placeholder = nccl.NcclCommunicator.__new__(nccl.NcclCommunicator)  # as initAll makes them
    comm = CupyComm(lib, placeholder, 0, 1)
    assert comm.handle == 0 and comm.async_error() == 0
    for name in ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "send", "recv"):
        assert callable(getattr(comm, name))


def test_kernel_launch_passes_the_declared_c_types(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpucoll._backends.nccl import kernels as _kernels

    seen: list[Any] = []

    class Kernel:
        def __call__(self, grid: tuple[int], block: tuple[int], args: tuple[Any, ...]) -> None:
            seen.append((grid, block, args))

    class Stream:
        entered = 0

        def __enter__(self) -> None:
            Stream.entered += 1

        def __exit__(self, *exc: Any) -> None:
            pass

    monkeypatch.setattr(_kernels, "get_kernel", lambda name, device: Kernel())
    _kernels.launch("gpucoll_reduce_bxor_u16", 1000, (1 << 40, 2 << 40, 1000, 3, 1001), Stream(), 0)
    _kernels.launch("gpucoll_scale_bf16", 5, (1 << 40, 5, 0.5), Stream(), 0)
    _kernels.launch("gpucoll_scale_i64", 5, (1 << 40, 5, -3.0), Stream(), 0)
    _kernels.launch("gpucoll_avg_trunc_i8", 0, (1 << 40, 0, 3), Stream(), 0)  # nothing to do: no launch
    assert Stream.entered == 3 and len(seen) == 3
    (grid, block, args), (_, _, scale), (_, _, iscale) = seen
    assert grid == (4,) and block == (_kernels.BLOCK,)
    assert [type(a) for a in args] == [np.uint64, np.uint64, np.int64, np.int32, np.int64]
    assert [type(a) for a in scale] == [np.uint64, np.int64, np.float64] and scale[2] == 0.5
    assert type(iscale[2]) is np.int64 and iscale[2] == -3
    with pytest.raises(ValueError, match="takes 3 arguments"):
        _kernels.launch("gpucoll_scale_f32", 5, (1, 2), Stream(), 0)


def test_event_pool_reuses_events_once_dropped() -> None:
    from gpucoll._backends.nccl.runtime import _EventPool

    made: list[int] = []

    def create(flags: int) -> int:
        made.append(flags)
        return 100 + len(made)
    pool = _EventPool(create)
    a = pool.acquire()
    b = pool.acquire()
    assert (a.ptr, b.ptr) == (101, 102) and made == [0, 0]  # timing enabled
    first = a.ptr
    del a
    c = pool.acquire()
    assert c.ptr == first and len(made) == 2
    del b, c


# ============================================================ with the real ProcessGroup (its watchdog, seq, hooks)

class FakeDeviceArray:
    """A device array in fake memory, published through __cuda_array_interface__."""

    class _Device:
        id = 0

    def __init__(self, rt: FakeRuntime, host: np.ndarray) -> None:
        self.buf = device_array(rt, host, DTYPES[host.dtype.name])
        self.dtype = host.dtype
        self.device = self._Device()

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self.buf.shape, "typestr": self.dtype.str, "data": (self.buf.ptr, False),
                "version": 3, "strides": None, "stream": None}


def run_groups(size: int, body: Callable[[Any, FakeRuntime, int], Any], monkeypatch: pytest.MonkeyPatch,
               *, timeout: float = 10.0) -> list[Any]:
    """Run ``body(process_group, runtime, rank)`` on rank threads; the group's NCCL backend
    runs on the fake GPU."""
    from gpucoll._group import registry as group_mod
    from gpucoll._group import ProcessGroup

    fabric = FakeFabric(hang_limit=30.0)
    store = HashStore(timeout=30.0)
    runtimes: dict[int, FakeRuntime] = {}

    def make_nccl(store: Any, rank: int, size: int, *, timeout: float, group_name: str,
                  device_id: int | None) -> NCCLBackend:
        return NCCLBackend(store, rank, size, timeout=timeout, group_name=group_name, device_id=device_id,
                           _runtime=runtimes[rank])
    monkeypatch.setitem(group_mod.BACKENDS, "nccl", make_nccl)

    def main(rank: int) -> Any:
        runtimes[rank] = FakeRuntime(fabric)
        pg = ProcessGroup(PrefixStore("pg/g", store), rank, size, group_name="g",
                          global_ranks=range(size), timeout=timeout, backend="nccl", device_id=0)
        try:
            return body(pg, runtimes[rank], rank)
        finally:
            pg._destroy()

    return run_rank_threads(size, main, fabric)


def test_process_group_sync_async_hooks_and_coalescing(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpucoll._collectives import coalescing

    def body(pg: Any, rt: FakeRuntime, rank: int) -> None:
        infos: list[Any] = []
        pg.register_on_completion_hook(infos.append)
        x = FakeDeviceArray(rt, np.full(4, rank + 1, np.float32))
        assert pg.all_reduce(x) is None  # async_op=False: the caller's stream waits
        assert read_on_stream(rt, x.buf, np.float32).get(timeout=10).tolist() == [3.0] * 4
        w = pg.all_reduce(x, op=ReduceOp.MAX, async_op=True)
        assert w.result() == [x]
        w.wait(timeout=10)
        assert w.is_success() and read(rt, x.buf, np.float32).tolist() == [3.0] * 4
        a = FakeDeviceArray(rt, np.full(3, rank, np.int16))
        b = FakeDeviceArray(rt, np.full(2, rank + 5, np.int16))
        with coalescing(pg):
            pg.all_reduce(a, op=ReduceOp.BXOR)
            pg.all_reduce(b, op=ReduceOp.BXOR)
        assert read_on_stream(rt, a.buf, np.int16).get(timeout=10).tolist() == [0 ^ 1] * 3
        assert read_on_stream(rt, b.buf, np.int16).get(timeout=10).tolist() == [5 ^ 6] * 2
        deadline = time.monotonic() + 10
        while len(infos) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [i.op_type for i in infos[:3]] == ["all_reduce", "all_reduce", "all_reduce_coalesced"]
        assert [i.seq for i in infos[:3]] == [1, 2, 3]
        assert all(i.success and 0.0 <= i.active_duration < 10.0 and i.group_name == "g" for i in infos[:3])
    run_groups(2, body, monkeypatch)


def test_the_watchdog_completes_device_ops_through_the_backend_not_op_by_op(monkeypatch: pytest.MonkeyPatch) -> None:
    def body(pg: Any, rt: FakeRuntime, rank: int) -> None:
        arrays = [FakeDeviceArray(rt, np.full(2, rank + 1, np.float32)) for _ in range(40)]
        refs = [weakref.ref(a) for a in arrays]
        for a in arrays:
            pg.all_reduce(a)
        assert pg._watchdog.outstanding() == 0  # nothing recorded per device op
        del arrays, a
        deadline = time.monotonic() + 10
        while (pg._nccl._pending or any(r() is not None for r in refs)) and time.monotonic() < deadline:
            time.sleep(0.01)
        # every op completed by the watchdog, in order, and every array released
        assert not pg._nccl._pending and all(r() is None for r in refs)
    run_groups(2, body, monkeypatch)


def test_functional_all_reduce_on_nccl_is_out_of_place_without_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpucoll import array as array_mod

    def no_copy(*args: Any) -> None:
        raise AssertionError("the NCCL path must not copy the input first")
    monkeypatch.setattr(array_mod, "copy_buffer", no_copy)

    def body(pg: Any, rt: FakeRuntime, rank: int) -> None:
        for name, op, values in (("float32", ReduceOp.SUM, [1.5, -2.0, 3.0]), ("int16", ReduceOp.BXOR, [5, 6, 7]),
                                 ("int32", ReduceOp.AVG, [7, -7, 9])):
            dt = np_dtype(name)
            host = np.array(values, dt) * (rank + 1)
            x = FakeDeviceArray(rt, host)
            y = FakeDeviceArray(rt, np.zeros(3, dt))
            pg._all_reduce_into(y, x, op)
            got = read_on_stream(rt, y.buf, dt).get(timeout=10)
            want = reference([np.array(values, dt) * (r + 1) for r in range(2)], name, op, 2)
            assert close(got, want, name), (name, got, want)
            assert read(rt, x.buf, dt).tolist() == host.tolist()  # the input is left alone
        with pytest.raises(ValueError, match="must match input"):
            pg._all_reduce_into(FakeDeviceArray(rt, np.zeros(2, np.float32)), FakeDeviceArray(rt, np.zeros(3, np.float32)))
    run_groups(2, body, monkeypatch)


def test_debug_detail_catches_collectives_that_differ_across_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCOLL_DEBUG", "detail")

    def body(pg: Any, rt: FakeRuntime, rank: int) -> list[str]:
        errors = []
        # Different sizes: NCCL would hang or read past the smaller array.
        x = FakeDeviceArray(rt, np.ones(4 * (rank + 1), np.float32))
        with pytest.raises(DistBackendError) as e1:
            pg.all_reduce(x)
        errors.append(str(e1.value))
        # Different roots, then different reduction ops.
        y = FakeDeviceArray(rt, np.full(3, rank + 1, np.float32))
        with pytest.raises(DistBackendError) as e2:
            pg.broadcast(y, src=rank)
        errors.append(str(e2.value))
        with pytest.raises(DistBackendError) as e3:
            pg.all_reduce(y, op=ReduceOp.SUM if rank == 0 else ReduceOp.MAX)
        errors.append(str(e3.value))
        # Matching ops go through, and per-peer sizes of all_to_all_single may differ.
        pg.all_reduce(y)
        assert read_on_stream(rt, y.buf, np.float32).get(timeout=10).tolist() == [3.0] * 3
        # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 1 to each
        out = FakeDeviceArray(rt, np.zeros(2 + rank, np.float32))
        inp = FakeDeviceArray(rt, np.full(3 - rank, rank + 1, np.float32))
        pg.all_to_all_single(out, inp, output_split_sizes=[[1, 1], [2, 1]][rank],
                             input_split_sizes=[[1, 2], [1, 1]][rank])
        got = read_on_stream(rt, out.buf, np.float32).get(timeout=10).tolist()
        assert got == ([1.0, 2.0] if rank == 0 else [1.0, 1.0, 2.0]), got
        return errors
    results = run_groups(2, body, monkeypatch)
    for errors in results:
        sizes, roots, ops = errors
        assert "rank 0: op=all_reduce seq=1 dtype=float32 shape=(4,) reduce op=SUM" in sizes, sizes
        assert "rank 1: op=all_reduce seq=1 dtype=float32 shape=(8,) reduce op=SUM" in sizes, sizes
        assert "group 'g'" in sizes and "GPUCOLL_DEBUG=DETAIL" in sizes
        assert "root (rank 0: 0, rank 1: 1)" in roots, roots
        assert "SUM" in ops and "MAX" in ops
    monkeypatch.setenv("GPUCOLL_DEBUG", "loud")
    from gpucoll._group.registry import debug_level
    with pytest.raises(ValueError, match="GPUCOLL_DEBUG must be OFF, INFO or DETAIL"):
        debug_level()


def test_process_group_timeout_aborts_and_names_op_seq_group(monkeypatch: pytest.MonkeyPatch) -> None:
    shared = HashStore()

    def body(pg: Any, rt: FakeRuntime, rank: int) -> tuple[str, str]:
        x = FakeDeviceArray(rt, np.ones(4, np.float32))
        pg.all_reduce(x)
        if rank == 1:
            shared.wait(["done"], 30.0)  # never joins the next all_reduce
            pg._nccl.abort("the test is over")
            return "", ""
        pg.all_reduce(x)  # hangs on the GPU; the host goes on
        work = pg.all_reduce(x, async_op=True)
        with pytest.raises(DistBackendError) as hung:
            work.wait(timeout=20)
        with pytest.raises(DistBackendError) as later:
            pg.all_reduce(x)
        shared.set("done", "1")
        return str(hung.value), str(later.value)
    first, later = run_groups(2, body, monkeypatch, timeout=1.0)[0]
    assert "all_reduce (seq 3) on group 'g' failed" in first
    assert "(seq 2)" in first and "did not complete within the group's timeout" in first
    assert "all_reduce (seq 4) on group 'g' failed" in later and "(seq 2)" in later


# ============================================================ new groups through the world API

def run_worlds(size: int, body: Callable[[Any, FakeRuntime, int], Any], monkeypatch: pytest.MonkeyPatch, *,
               features: Features = DEFAULT_FEATURES, eager: bool = True, timeout: float = 10.0) -> list[Any]:
    """Run ``body(world_module, runtime, rank)`` on rank threads, each with its own default
    group (backend "nccl", on the fake GPU), so that new_group and split_group run as in
    a job. The world slot is made per thread for the test."""
    from gpucoll._group import registry as group_mod
    from gpucoll import _world as world_mod
    from gpucoll._group import ProcessGroup

    fabric = FakeFabric(hang_limit=30.0)
    store = HashStore(timeout=30.0)
    runtimes: dict[int, FakeRuntime] = {}
    local = threading.local()

    def make_nccl(store: Any, rank: int, size: int, *, timeout: float, group_name: str,
                  device_id: int | None) -> NCCLBackend:
        return NCCLBackend(store, rank, size, timeout=timeout, group_name=group_name, device_id=device_id,
                           _runtime=runtimes[int(threading.current_thread().name[4:])])
    monkeypatch.setitem(group_mod.BACKENDS, "nccl", make_nccl)
    monkeypatch.setattr(world_mod, "_world", lambda: local.world)
    monkeypatch.setattr(world_mod, "default_group", lambda: local.world.default)

    def main(rank: int) -> Any:
        runtimes[rank] = FakeRuntime(fabric, features=features)
        device = 0 if eager else None
        pg = ProcessGroup(PrefixStore("pg/default", store), rank, size, group_name="default",
                          global_ranks=range(size), timeout=timeout, backend="nccl", device_id=device)
        local.world = world_mod._World(store, False, pg, "nccl", timeout, device)
        try:
            return body(world_mod, runtimes[rank], rank)
        finally:
            for g in [*local.world.groups, pg]:
                g._destroy()

    return run_rank_threads(size, main, fabric)


def _sum_over(pg: Any, rt: FakeRuntime, rank: int) -> float:
    """all_reduce(SUM) of each member's global rank + 1 on ``pg``; the result as seen on the caller's stream."""
    x = FakeDeviceArray(rt, np.full(3, rank + 1, np.float32))
    pg.all_reduce(x)
    values = read_on_stream(rt, x.buf, np.float32).get(timeout=10)
    assert len(set(values.tolist())) == 1
    return float(values[0])


def _split_made(pg: Any) -> bool:
    """True when the group's communicator came from ncclCommSplit (the fake names split worlds so)."""
    return b"/split" in pg._nccl._comm.world.uid


@pytest.mark.parametrize("size", [3, 4])
def test_new_group_and_split_group_split_the_parent_communicator(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpucoll._group.member import GroupMember

    def body(w: Any, rt: FakeRuntime, rank: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        evens = w.new_group([r for r in range(size) if r % 2 == 0])
        if rank % 2:
            assert evens is GroupMember.NON_GROUP_MEMBER
        else:
            assert _split_made(evens) and evens.size() == (size + 1) // 2
            assert evens._nccl.device == 0 and evens._device_id == 0
            out["evens"] = _sum_over(evens, rt, rank)
        # Two disjoint groups from one call; with 3 ranks, rank 2 is in neither.
        pairs = [[0, 1], [2, 3]] if size == 4 else [[1, 0]]
        mine = w.split_group(split_ranks=pairs)
        if rank < 2 * len(pairs):
            assert mine is not None and _split_made(mine) and mine.rank() == rank % 2
            out["pair"] = _sum_over(mine, rt, rank)
        else:
            assert mine is None
        # A split of a split; then new_subgroups (one new_group per block).
        if mine is not None:
            solo = w.split_group(mine, split_ranks=[[1], [0]])
            assert solo.size() == 1 and _split_made(solo)
            out["solo"] = _sum_over(solo, rt, rank)
        sub, subs = w.new_subgroups(1)
        assert len(subs) == size and sub.global_ranks == (rank,) and _split_made(sub)
        out["sub"] = _sum_over(sub, rt, rank)
        # The default group still works after all the splits.
        out["all"] = _sum_over(w.default_group(), rt, rank)
        return out
    results = run_worlds(size, body, monkeypatch)
    evens = sum(r + 1 for r in range(size) if r % 2 == 0)
    for rank, got in enumerate(results):
        assert got["all"] == size * (size + 1) / 2
        assert got["sub"] == rank + 1 and got.get("solo", rank + 1) == rank + 1
        assert got.get("evens", evens) == evens
        if rank < (4 if size == 4 else 2):
            assert got["pair"] == (3.0 if rank < 2 else 7.0)


def test_new_groups_without_a_split_make_their_own_communicator(monkeypatch: pytest.MonkeyPatch) -> None:
    # NCCL without ncclCommSplit, and a default group created lazily: each new group
    # gets a communicator of its own from a fresh unique id; non-members take no part.
    for features, eager in ((Features(version=(2, 17, 1), comm_split=False), True), (DEFAULT_FEATURES, False)):
        def body(w: Any, rt: FakeRuntime, rank: int) -> float | None:
            _sum_over(w.default_group(), rt, rank)  # creates the default communicator (lazily or not)
            assert w.default_group()._nccl.can_split is not eager  # lazily made: splittable, yet not split
            g = w.new_group([0, 2])
            if rank == 1:
                return None
            if eager:
                assert g._nccl is not None and not _split_made(g)
            else:
                assert g._nccl is None  # created by the first device op
            value = _sum_over(g, rt, rank)
            assert not _split_made(g)
            return value
        assert run_worlds(3, body, monkeypatch, features=features, eager=eager) == [4.0, None, 4.0]


def test_a_rank_that_never_joins_the_split_fails_the_others_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    def body(w: Any, rt: FakeRuntime, rank: int) -> str:
        if rank == 2:
            time.sleep(0.1)
            return ""  # never calls new_group
        t0 = time.monotonic()
        with pytest.raises(DistBackendError) as err:
            w.new_group([0, 1], timeout=1.0)
        assert time.monotonic() - t0 < 8.0
        return str(err.value)
    results = run_worlds(3, body, monkeypatch, timeout=1.0)
    for msg in results[:2]:
        assert "only 2 of 3 ranks of group 'default' reached its split (ncclCommSplit)" in msg
        assert "'group1'" in msg
