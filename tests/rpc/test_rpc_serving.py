"""How an owner serves a connection (``_conn._serve``, ``_conn.await_follow``).

- ``await_follow``: after reading a ``remote()`` call, the reading thread waits a bounded
  time, without sleeping, for the caller's next frame (``to_here()``'s fetch), and learns
  to stop waiting when it does not come, as a caller's poll does.
- Served: the connection's idle threads wait in one ``epoll`` and a frame wakes one of
  them, which runs the request itself: no thread is woken to take the reading over. A
  loop of ``rpc_sync`` costs the callee about one blocking wait per call (three before);
  a ``remote()`` whose fetch never comes starts within a millisecond (the wait is bounded
  to microseconds); calls, nested calls and blocking functions are served as before.
"""

from __future__ import annotations

import resource
import statistics
import threading
import time
from typing import Any


import gpucoll.rpc as rpc
from gpucoll._timeouts import SPIN_BACKOFF_MIN
from gpucoll.rpc import _conn, _wire

from _conn_pair import pair  # noqa: F401  (a fixture)
from _workers import init_worker
from gpucoll.rpc._info import MessageType
from gpucoll.testing import run_spmd


def _frame(kind: int) -> bytes:
    data, bufs = _wire.dumps((1, 2))
    return b"".join(bytes(p) for p in _wire.frame_parts(kind, 0, 7, data, bufs))


def test_a_frame_already_sent_is_received_and_waiting_stays_on(pair) -> None:
    conn, peer = pair
    peer.sendall(_frame(MessageType.PYTHON_RREF_FETCH_CALL))
    _conn.await_follow(conn, 5.0)
    assert conn.reader.buffered_kind() == MessageType.PYTHON_RREF_FETCH_CALL
    assert conn.skip_spin == 0 and conn.backoff == SPIN_BACKOFF_MIN
    assert conn.reader.read()[:3] == (MessageType.PYTHON_RREF_FETCH_CALL, 0, 7)


def test_a_frame_sent_during_the_wait_is_received(pair) -> None:
    conn, peer = pair
    threading.Timer(0.05, peer.sendall, (_frame(MessageType.PYTHON_RREF_FETCH_CALL),)).start()
    _conn.await_follow(conn, 5.0)
    assert conn.reader.buffered_kind() == MessageType.PYTHON_RREF_FETCH_CALL and conn.skip_spin == 0


def test_nothing_coming_ends_the_wait_in_its_budget_and_turns_it_off_for_more_calls_each_time(pair) -> None:
    conn, peer = pair
    for skip in (8, 16):
        t0 = time.monotonic()
        _conn.await_follow(conn, 0.01)
        assert time.monotonic() - t0 < 1.0 and not conn.reader.buffered()
        assert conn.skip_spin == skip and conn.backoff == 2 * skip
        conn.skip_spin = 0
    # Turned off: it returns at once, reading nothing, and counts down.
    conn.skip_spin = 2
    peer.sendall(_frame(MessageType.PYTHON_RREF_FETCH_CALL))
    _conn.await_follow(conn, 5.0)
    assert not conn.reader.buffered() and conn.skip_spin == 1


def test_part_of_a_frame_is_not_enough(pair) -> None:
    conn, peer = pair
    whole = _frame(MessageType.PYTHON_RREF_FETCH_CALL)
    peer.sendall(whole[:10])
    _conn.await_follow(conn, 0.01)
    assert conn.reader.buffered() and conn.reader.buffered_kind() is None and conn.skip_spin == SPIN_BACKOFF_MIN
    peer.sendall(whole[10:])
    assert conn.reader.read()[:3] == (MessageType.PYTHON_RREF_FETCH_CALL, 0, 7)


def test_no_budget_no_wait(pair) -> None:
    conn, peer = pair
    peer.sendall(_frame(MessageType.PYTHON_RREF_FETCH_CALL))
    _conn.await_follow(conn, 0.0)
    assert not conn.reader.buffered() and conn.skip_spin == 0


def test_follow_seconds_is_bounded_by_the_callers_poll() -> None:
    assert _conn.follow_seconds(0.0) == 0.0
    assert 0.0 < _conn.follow_seconds(200e-6) <= 100e-6
    assert _conn.follow_seconds(20e-6) == 20e-6


# ----- served, two workers ------------------------------------------------------------------

def noop() -> None:
    return None


def started_at() -> int:
    return time.perf_counter_ns()  # CLOCK_MONOTONIC: one clock for both processes


def blocks_on(ev_name: str) -> str:
    _EVENTS.setdefault(ev_name, threading.Event()).wait(30)
    return ev_name


def release(ev_name: str) -> None:
    _EVENTS.setdefault(ev_name, threading.Event()).set()


_EVENTS: dict[str, threading.Event] = {}


def switches() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw


def serving() -> dict[str, Any]:
    rank = init_worker()
    out: dict[str, Any] = {}
    if rank == 1:
        for _ in range(100):
            rpc.rpc_sync("worker0", noop)
        # Blocking waits on the callee per rpc_sync: the median of three batches.
        per_call = []
        for _ in range(3):
            before = rpc.rpc_sync("worker0", switches)
            for _ in range(300):
                rpc.rpc_sync("worker0", noop)
            per_call.append((rpc.rpc_sync("worker0", switches) - before - 1) / 300)
        out["switches"] = statistics.median(per_call)
        # A remote() nobody fetches starts at once (the smallest of 20 delays).
        delays, rrefs = [], []
        for _ in range(20):
            sent = time.perf_counter_ns()
            rrefs.append(rpc.remote("worker0", started_at))
            time.sleep(0.005)  # no frame follows it for a while
            delays.append(rrefs[-1].to_here() - sent)
        out["start delay"] = min(delays) / 1e9
        # A call that blocks until a later call from the same caller releases it: the
        # connection is read while it runs (on both serving threads, and the pool's).
        rpc.rpc_sync("worker0", noop)
        blocked = [rpc.rpc_async("worker0", blocks_on, args=(f"e{i}",)) for i in range(3)]
        held = rpc.remote("worker0", blocks_on, args=("r",))
        for i in range(3):
            rpc.rpc_sync("worker0", release, args=(f"e{i}",))
        rpc.rpc_sync("worker0", release, args=("r",))
        out["released"] = [f.wait() for f in blocked] + [held.to_here()]
    rpc.shutdown()
    return out


def test_serving_wakes_one_thread_per_frame_and_never_holds_a_call() -> None:
    out = run_spmd(serving, 2, init=False, timeout=120)[1]
    assert out["released"] == ["e0", "e1", "e2", "r"]
    assert out["start delay"] < 0.001, out
    assert out["switches"] < 2.0, out
