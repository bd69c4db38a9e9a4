"""The NCCL backend's semantics on the fake GPU: data movement, point-to-point, streams
and events, lifetimes of arrays and Works, failures (abort, asynchronous errors,
shutdown), communicator splits, the event pool."""

from __future__ import annotations

import threading
import time
import weakref

import numpy as np
import pytest

from gpucoll._buffer import DTYPES, Buffer, Device
from gpucoll._backends.nccl.lib import Features
from gpucoll._backends.nccl.backend import NCCLBackend
from gpucoll.errors import DistBackendError
from gpucoll._reduce_op import ReduceOp, make_premul_sum
from gpucoll.store import HashStore, PrefixStore

from _nccl_fake import FakeRuntime, device_array, read, read_on_stream
from _reference import make_input, np_dtype
from _fake_gpu_world import DEFAULT_FEATURES, OLD_FEATURES, dev, run_world


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
    from gpucoll._backends.nccl.hot import PRUNE_AT as _PRUNE_AT

    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        owners = []
        for _ in range(3 * _PRUNE_AT):
            buf = dev(rt, np.ones(2, np.float32))
            owners.append(weakref.ref(buf.owner))
            be.all_reduce(buf, ReduceOp.SUM).wait()
            del buf
        be.all_reduce(dev(rt, np.ones(2, np.float32)), ReduceOp.SUM).synchronize()  # everything before is done
        be.all_reduce(dev(rt, np.ones(2, np.float32)), ReduceOp.SUM)  # issuing completes them
        assert len(be.outstanding) <= 2
        assert all(o() is None for o in owners)  # and their arrays were let go
    run_world(2, body)


def test_graph_capture_joins_the_streams_and_completes_at_once() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        buf = dev(rt, np.full(4, 1.0, np.float32))
        be.all_reduce(dev(rt, np.ones(1, np.float32)), ReduceOp.SUM).synchronize()  # connected before capture
        rt.begin_capture()
        work = be.all_reduce(buf, ReduceOp.SUM)
        assert work.is_completed() and rt.unpooled_events == 2 and all(w is not work for w in be.outstanding)
        graph = rt.end_capture()  # raises if the communication stream was not joined back
        assert read(rt, buf, np.float32).tolist() == [1.0] * 4  # captured work ran nowhere yet
        for expect in (2.0, 4.0):  # each launch runs the captured all_reduce once more
            graph.launch(rt.current_stream())
            assert read_on_stream(rt, buf, np.float32).get(timeout=10).tolist() == [expect] * 4
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
        # Connected first: a first collective that a rank never joins blocks the host
        # inside NCCL (test_first_collective_without_a_peer_times_out covers that).
        be.all_reduce(dev(rt, np.ones(1, np.float32)), ReduceOp.SUM).synchronize()
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


def test_event_pool_reuses_events_once_dropped() -> None:
    from gpucoll._backends.nccl.runtime import _EventPool

    made: list[int] = []

    def create(flags: int) -> int:
        made.append(flags)
        return 100 + len(made)
    pool = _EventPool(create)
    a = pool.acquire()
    b = pool.acquire()
    assert (a.ptr, b.ptr) == (101, 102) and made == [2, 2]  # cudaEventDisableTiming by default
    first = a.ptr
    del a
    c = pool.acquire()
    assert c.ptr == first and len(made) == 2
    del b, c
