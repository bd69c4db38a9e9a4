"""The agent's timer (gpucoll/rpc/_timer.py) on its own, against a stand-in agent: every
call's timeout fires, none early, whichever threads send and whatever the timeouts
(queues per timeout value appended without a lock, the heap past them), with calls
answered before their deadline mixed in, and a queue past its length bound."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from gpucoll.futures import Future
from gpucoll.rpc._conn import _Call
from gpucoll.rpc._timer import _QUEUE_MAX, _QUEUES_MAX, Timer


class _Agent:
    """What the timer reads of an agent, recording each call's failure time."""

    def __init__(self) -> None:
        self.closed = False
        self._pending: dict[int, _Call] = {}
        self._out: dict[int, Any] = {}
        self.by_id: dict[int, Any] = {}
        self.fired: dict[int, float] = {}
        self.timer = Timer(self)
        self.loop: threading.Thread | None = None

    def _pop(self, mid: int) -> _Call | None:
        return self._pending.pop(mid, None)

    def _finish(self, fut: Future[Any], value: Any, error: BaseException | None) -> None:
        self.fired[id(fut)] = time.monotonic()
        fut._try_complete(value, error)

    def submit(self, job: Any) -> None:
        threading.Thread(target=job, daemon=True).start()


def _started() -> _Agent:
    """A stand-in agent with its timer's thread running (``agent.loop``)."""
    agent = _Agent()
    agent.loop = threading.Thread(target=agent.timer.loop, daemon=True)
    agent.loop.start()
    return agent


def _stop(agent: _Agent) -> None:
    agent.closed = True
    with agent.timer.cv:
        agent.timer.cv.notify()


def _send(agent: _Agent, mid: int, timeout: float) -> tuple[float, Future[Any]]:
    fut: Future[Any] = Future()
    agent._pending[mid] = _Call(fut, 1, f"call {mid}", timeout)
    sent = time.monotonic()
    agent.timer.deadline(timeout, mid)
    return sent, fut


def test_every_timeout_fires_on_time_from_many_threads() -> None:
    agent = _started()
    timeouts = [0.02, 0.05, 0.1] + [0.03 + 0.001 * i for i in range(_QUEUES_MAX + 4)]  # past the queues: the heap
    sent: dict[int, tuple[float, float, Future[Any]]] = {}
    answered: set[int] = set()
    lock = threading.Lock()

    def sender(first: int) -> None:
        rng = random.Random(first)
        for mid in range(first, first + 1500):
            timeout = rng.choice(timeouts)
            at, fut = _send(agent, mid, timeout)
            with lock:
                sent[mid] = (at, timeout, fut)
            if rng.random() < 0.5:  # answered at once: its entry stays, stale, until trimmed or due
                if agent._pop(mid) is not None:
                    fut._try_complete(None, None)
                    with lock:
                        answered.add(mid)
            if rng.random() < 0.05:
                time.sleep(rng.random() * 0.01)

    threads = [threading.Thread(target=sender, args=(1 + 10000 * i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.monotonic() + 30
    while any(not f.done() for _, _, f in sent.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    _stop(agent)
    late = [mid for mid, (_, _, f) in sent.items() if not f.done()]
    assert not late, f"{len(late)} calls never timed out, e.g. {late[:5]}"
    early = [mid for mid, (at, timeout, f) in sent.items()
             if mid not in answered and agent.fired[id(f)] < at + timeout - 1e-3]
    assert not early, f"{len(early)} calls timed out early"
    assert all(id(sent[m][2]) not in agent.fired for m in answered)  # an answered call is never failed
    slow = sorted(agent.fired[id(f)] - at - timeout for mid, (at, timeout, f) in sent.items() if mid not in answered)
    assert slow[len(slow) // 2] < 0.05, f"median lateness {slow[len(slow) // 2]:.3f} s"


def test_a_queue_past_its_bound_with_a_running_call_at_its_head_goes_on() -> None:
    agent = _started()
    _send(agent, 1, 30.0)  # a long call, still running: its queue cannot be trimmed past it
    for mid in range(2, _QUEUE_MAX + 2):
        _send(agent, mid, 30.0)
        agent._pop(mid)  # answered
    at, fut = _send(agent, _QUEUE_MAX + 2, 30.0)  # the queue is full: this one trims it or takes the heap
    short_at, short = _send(agent, _QUEUE_MAX + 3, 0.05)
    assert short._block(5.0) and agent.fired[id(short)] >= short_at + 0.05 - 1e-3
    assert len(agent.timer.queues[30.0]) <= _QUEUE_MAX
    assert not fut.done()
    _stop(agent)


def test_a_deadline_earlier_than_the_one_the_timer_sleeps_on_wakes_it() -> None:
    agent = _started()
    _send(agent, 1, 30.0)  # the timer sleeps until this one
    for mid in (2, 3, 4):  # the first makes the 0.05 s queue (under the lock); the others find it empty
        at, fut = _send(agent, mid, 0.05)
        assert fut._block(5.0), f"call {mid} did not time out in 5 s"
        assert at + 0.05 - 1e-3 <= agent.fired[id(fut)] < at + 2.0
        time.sleep(0.05)  # the timer sleeps on the 30 s call again
    _stop(agent)


def test_a_failing_flush_neither_stops_the_timer_nor_strands_the_sweep() -> None:
    agent = _started()
    flushed = threading.Event()

    class _Breaks:
        def flush(self) -> None:
            raise RuntimeError("a flush that fails in a way nobody foresaw")

    class _Works:
        def flush(self) -> None:
            flushed.set()

    agent.timer.flush_soon(_Breaks())
    agent.timer.lazy.append((time.monotonic(), _Works()))  # behind it, in the same sweep
    assert flushed.wait(5.0), "what the failed sweep left was never flushed"
    at, fut = _send(agent, 1, 0.05)
    assert fut._block(5.0), "a timeout after the failed flush never fired"
    assert agent.fired[id(fut)] >= at + 0.05 - 1e-3
    assert agent.loop is not None and agent.loop.is_alive()
    _stop(agent)
