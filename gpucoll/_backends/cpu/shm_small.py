"""The small all_reduce of a shared-memory group, bound to one kind (the hot path of
small ops): :meth:`ShmCollectives.all_reduce`'s small case with every per-op look-up made
once (the slot views by parity, the peer's words, the post), issued as
:func:`.issue.bound` issues an op (with one peer, in the same function)."""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from ..._work import Work
from .issue import bound, now
from .reduce import Array, Reducer
from .shm import futex_wake
from .tcp_algos import Ctx, Deferred

__all__ = ["small_all_reduce", "BoundRun"]

BoundRun = Callable[..., "bool | Work"]
"""``run(x, red, async_op=False)``: True when the op ran on this thread, else its Work."""

# Looks at the peer's counter before the full wait (ShmSegment.wait: clock, CPU check,
# adaptive spin, sleep): about 2 µs of plain reads, under any spin budget that wait keeps.
QUICK_CHECKS = 40


def small_all_reduce(b: Any, coll: Any, nb: int, dtype_name: str, red: Reducer, sig: int) -> BoundRun | None:
    """:meth:`ShmCollectives.all_reduce` bound to one kind that fits a slot and folds with
    a plain ufunc, issued as :func:`.issue.bound` issues an op of backend ``b`` with
    signature ``sig``: ``run(x, red, async_op=False)`` for 1-D arrays of ``nb`` bytes of
    ``dtype_name`` reduced with ``red``; None for any other kind, or when ``coll`` (the
    backend's transport) is not shared memory. The same protocol, waits and checks as
    that method, with the slot views, the peer's words and the post made once per kind
    instead of per op (one peer: no loops, and the issuing in the same frame)."""
    from .shm_algos import ShmCollectives  # (imported with the shared-memory transport)

    ufunc = red.plain
    if not isinstance(coll, ShmCollectives) or nb > coll.seg.small_bytes or ufunc is None or coll.size < 2:
        return None
    try:
        dtype = np.dtype(dtype_name)
    except TypeError:  # a name NumPy does not know by itself (such dtypes do not fold plainly anyway)
        return None
    seg, me, peers, words = coll.seg, coll.rank, coll._peers, coll._words
    ctl = seg.ctl
    slots = (coll._slots(0, nb, dtype), coll._slots(1, nb, dtype))  # (kept: not the cache's lists)
    mine = (slots[0][me], slots[1][me])
    my_hdr = coll._my_hdr
    my_ctr, my_addr, mark, sleep_words = seg._my_ctr, seg._my_addr, seg._mark, seg._sleep_words
    wait, wake, every_peer = seg.wait, futex_wake, coll._every_peer
    quick = range(QUICK_CHECKS)

    def mismatch(ctx: Ctx, j: int, u: int, p: int) -> None:
        coll._base, coll._parity, coll._sig, coll._checked = coll._floor - 1, p, ctx.sig, set()
        coll._wait(ctx, j, 1)  # raises the mismatch, worded once

    if len(peers) == 1:
        return _one_peer(b, sig, coll, slots, ufunc, mismatch, quick)

    def run_n(ctx: Ctx, x: Array, red: Reducer) -> None:
        floor = coll._floor
        for j, ci, _ in words:
            if ctl[ci] < floor:
                wait(j, floor, ctx.deadline, lambda: coll._alive(ctx, j), ctx.what)
        u = coll._u = coll._u + 1
        coll._base = floor = seg.count
        target = coll._floor = count = seg.count = floor + 1
        p = coll._parity = u & 1
        sig = coll._sig = ctx.sig
        coll._checked = every_peer
        i = my_hdr[p]
        ctl[i] = u
        ctl[i + 1] = sig
        parts = slots[p]
        mine[p][...] = x
        ctl[my_ctr] = count  # post
        for w in sleep_words:
            if ctl[w] == mark:
                wake(my_addr)
                break
        for j, ci, hdr in words:
            if ctl[ci] < target:
                if ctx.patience and not coll._arrived(ctx.patience):
                    raise Deferred(lambda c: coll._fold_slots(c, x, red, parts), True)
                wait(j, target, ctx.deadline, lambda: coll._alive(ctx, j), ctx.what)
            h = hdr[p]
            if ctl[h] != u or ctl[h + 1] != sig:
                mismatch(ctx, j, u, p)
        ufunc(parts[0], parts[1], x)
        for part in parts[2:]:
            ufunc(x, part, x)
    return bound(b, "all_reduce", run_n, sig)


def _one_peer(b: Any, sig: int, coll: Any, slots: Any, ufunc: Any, mismatch: Callable[[Ctx, int, int, int], None],
              quick: range) -> BoundRun:
    """The one-peer form of :func:`small_all_reduce`: :func:`.issue.bound`'s issuing and
    the protocol in one function (a small op's cost is mostly its Python frames).

    ``run(x, red, async_op=False)`` issues the op as :func:`.issue.bound` does: a
    synchronous op with nothing queued runs here under the kind's own Ctx; any other
    case goes through :func:`.issue.now`, which calls ``run`` back with its Ctx
    (``ctx=``), the protocol alone, its errors (Deferred too) raised as they are."""
    seg = coll.seg
    ctl = seg.ctl
    j, ci, (h0, h1) = coll._words[0]
    sleep = seg._sleep_words[0]
    my_ctr, my_addr, mark, wait, wake = seg._my_ctr, seg._my_addr, seg._mark, seg.wait, futex_wake
    s0, s1 = slots[0][0], slots[0][1]
    t0, t1 = slots[1][0], slots[1][1]
    m0, m1 = slots[0][coll.rank], slots[1][coll.rank]
    c0, c1 = _copy_target(m0), _copy_target(m1)
    h0m, h1m = coll._my_hdr
    every_peer = coll._every_peer
    lock, monotonic = b._lock, time.monotonic
    acquire, release = lock.acquire, lock.release
    own = Ctx(0, 0.0, sig, b._check, "all_reduce", b.group_name)  # (one op at a time: _busy)

    def settle(target: int, u: int) -> None:
        """The state :meth:`ShmCollectives._fold_slots` and ``_arrived`` read (a deferred op's)."""
        coll._base, coll._parity, coll._sig, coll._checked = target - 1, u & 1, sig, every_peer

    def issued(c: Ctx, x: Array, red: Reducer) -> None:
        run(x, red, False, c)

    # The kind's own Ctx gets its deadline when the op first waits (0.0 until then): the
    # steps before a wait do not block (microseconds), and most ops never wait that long.
    def due(ctx: Ctx) -> None:
        if not ctx.deadline:
            ctx.deadline = monotonic() + b.timeout

    # The waits' slow forms are functions of their own: a lambda in ``run`` would make its
    # variables cells, built on every call.
    def wait_floor(ctx: Ctx, floor: int) -> None:
        due(ctx)
        wait(j, floor, ctx.deadline, lambda: coll._alive(ctx, j), ctx.what)

    def late(ctx: Ctx, target: int, u: int, x: Array, red: Reducer, a: Array, c: Array) -> None:
        due(ctx)
        settle(target, u)
        if ctx.patience and not coll._arrived(ctx.patience):
            raise Deferred(lambda cx: coll._fold_slots(cx, x, red, [a, c]), True)
        wait(j, target, ctx.deadline, lambda: coll._alive(ctx, j), ctx.what)

    seen = 0  # the peer's counter was seen at least this high (this op's floor check may use it)

    def run(x: Array, red: Reducer, async_op: bool = False, ctx: Ctx | None = None) -> bool | Work:
        nonlocal seen
        if ctx is None:  # (issue.bound, inline)
            mine = True
            if async_op:
                return now(b, "all_reduce", issued, sig, x, red, async_op=True)
            acquire()  # (not ``with lock``: its context-manager calls cost more than the check)
            try:
                free = not (b._busy or b._queue or b._error is not None or b._closed)
                if free:
                    b._busy = True
            finally:
                release()
            if not free:
                return now(b, "all_reduce", issued, sig, x, red)
            ctx = own
            ctx.seq = b._seq = b._seq + 1
            ctx.deadline = 0.0  # (see due)
        else:
            mine = False
        try:
            # The op's state that only a wait's slow forms read (coll._base, _parity, _sig,
            # _checked) is written where one is taken (settle), not per op: every other
            # op of the transport writes it anew when it begins.
            floor = coll._floor
            if seen < floor and ctl[ci] < floor:  # (the peer's counter only rises)
                wait_floor(ctx, floor)
            u = coll._u = coll._u + 1
            target = coll._floor = seg.count = seg.count + 1
            if u & 1:
                ctl[h1m] = u
                ctl[h1m + 1] = sig
                a, c = t0, t1
                try:
                    c1[:] = x
                except ValueError:  # (see _copy_target)
                    m1[...] = x
                h = h1
            else:
                ctl[h0m] = u
                ctl[h0m + 1] = sig
                a, c = s0, s1
                try:
                    c0[:] = x
                except ValueError:
                    m0[...] = x
                h = h0
            ctl[my_ctr] = target  # post: this rank's data and header are written
            if ctl[sleep] == mark:
                wake(my_addr)
            if ctl[ci] < target:
                for _ in quick:  # the peer is usually a moment away: no clock, no syscall
                    if ctl[ci] >= target:
                        break
                else:
                    late(ctx, target, u, x, red, a, c)
            seen = target
            if ctl[h] != u or ctl[h + 1] != sig:
                due(ctx)
                mismatch(ctx, j, u, u & 1)
            ufunc(a, c, x)
        except BaseException as exc:
            if not mine:
                raise  # (issue.now's to handle)
            err = b._failed(exc, ctx.name)
            if not isinstance(exc, Exception):
                raise
            raise err
        finally:
            if mine:
                b._busy = False  # (as in issue.now)
                if b._queue or b._waiters:
                    with lock:
                        b._cv.notify_all()
        return True
    return run


def _copy_target(slot: Any) -> Any:
    """What the one-peer op copies its array into with ``target[:] = x``: ``slot``'s
    memoryview where Python copies through one (a plain memcpy: about 500 instructions
    fewer than NumPy's ``slot[...] = x`` at 4 KiB), else ``slot`` itself (formats a
    memoryview does not take, such as complex). An array whose buffer format is spelled
    otherwise than the slot's for the same dtype (``np.longlong`` for an int64 slot's
    ``'l'``) makes the memoryview raise ValueError, and the op then copies with NumPy."""
    try:
        scratch: Any = np.empty_like(slot)
        memoryview(scratch)[:] = slot  # (a copy into scratch: the dtype's format is what counts)
    except (TypeError, ValueError, NotImplementedError, BufferError):
        return slot
    return memoryview(slot)
