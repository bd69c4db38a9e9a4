"""Collectives through the shared-memory segment (every rank of the group on one host).

Protocol. Ops are numbered per group (``u``); op ``u`` uses slot/header parity
``u % 2``. Every rank raises its counter the same number of times in an op, so the
counter value ``base`` at the start of an op is the same on every rank and "rank j
reached step k of this op" is ``counter[j] >= base + k``. Before it writes anything,
a rank waits until every peer has *started* the previous op (so every peer has
finished the op before it, the last user of this parity's slots), then writes its
header ``(u, signature)``. The first time a rank sees a peer's progress in an op it
compares that peer's header with its own: a different op, dtype, size or root raises
DistBackendError before any foreign byte is read. Every rank waits for step 1 of every
peer in every op (a broadcast root and a gather's senders too), so every rank compares
every peer's header: no rank finishes an op its peers did not all issue.

Algorithms:

- small (fits a ``SMALL_BYTES`` slot): one step. Each rank copies its data into its
  slot and posts; readers copy or fold straight from the peers' slots. all_reduce
  folds every rank's slot in rank order on every rank (bit-identical everywhere).
- large: an entry step (every rank is inside the op, so the bulk buffers are free; an
  all_reduce skips it where the op before left them free), then blocks through two
  alternating ``BULK_BYTES`` buffers per rank. all_reduce is a reduce-scatter (rank j
  folds slice j of every block from the others' staged copies) and an all-gather of the
  folded slices. Rooted ops pipeline: the root writes block k+1 while the others copy k.
- an all_reduce of at least ``cma.MIN_BYTES`` where every rank may read every peer's memory:
  each rank reads its slice of the peers' arrays where they lie and folds it (cma.py).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from ...errors import DistBackendError
from ..mismatch import SignatureMismatch
from . import cma
from .reduce import Array, Reducer
from .shm import REC_WORDS, ShmSegment, wait_policy
from .tcp_algos import Ctx, Deferred, Fill, chunk_bounds

__all__ = ["ShmCollectives", "SMALL_BYTES", "BULK_BYTES"]

SMALL_BYTES = 256 * 1024
BULK_BYTES = 1 << 20

U8 = np.dtype(np.uint8)


def _u8(a: Array) -> Array:
    return a.view(U8) if a.size else np.empty(0, U8)


class ShmCollectives:
    """The collectives of one group whose ranks share a host.

    Args:
        store: the group's store (segment name exchange).
        rank, size: this rank and the group size.
        timeout: seconds for setting the segment up.
        mesh: the group's TCP mesh: sleeping waits ask it whether the peer is gone.
    """

    def __init__(self, store: Any, rank: int, size: int, *, timeout: float, mesh: Any) -> None:
        self.rank = rank
        self.size = size
        self.mesh = mesh
        spin, yields = wait_policy(store, rank, size, timeout, mesh.gone)
        self.seg = ShmSegment(store, rank, size, small_bytes=SMALL_BYTES, bulk_bytes=BULK_BYTES,
                              timeout=timeout, spin_seconds=spin, gone=mesh.gone, yields=yields)
        self._peers = [p for p in range(size) if p != rank]
        try:  # single-copy large all_reduces (cma.py) if every rank may read every peer's memory
            self._cma, self.cma_unavailable = cma.agree(store, rank, size, timeout, mesh.gone)
        except BaseException:
            self.seg.close()
            raise
        self.cma_scratch = [np.empty(0, U8) for _ in range(size)]  # cma.all_reduce's, per peer
        self._u = 0
        self._base = 0
        self._floor = 0
        self._parity = 0
        self._sig = 0
        self._checked: set[int] = set()
        self._every_peer = set(self._peers)  # (never changed: _wait adds only ranks not in it)
        self._slot_views: dict[tuple[int, int, Any], list[Array]] = {}
        self._scratch_block = np.empty(0, U8)
        self._bulk_used, self._tail = 0, (0, 0)  # the last op to use bulk buffers; the pipeline's (op, buffer)
        # Per peer: (rank, its counter's word, its header's first word by parity): the hot
        # loops index the control block with these, not with arithmetic per call.
        self._words = [(j, j * REC_WORDS, (j * REC_WORDS + 2, j * REC_WORDS + 4)) for j in self._peers]
        self._my_hdr = (rank * REC_WORDS + 2, rank * REC_WORDS + 4)

    def _slots(self, parity: int, nb: int, dtype: np.dtype[Any]) -> list[Array]:
        """Every rank's small slot of this parity as ``nb`` bytes of ``dtype`` (made once per kind)."""
        key = (parity, nb, dtype)
        views = self._slot_views.get(key)
        if views is None:
            if len(self._slot_views) >= 256:
                self._slot_views.clear()
            views = self._slot_views[key] = [self.seg.small(j, parity)[:nb].view(dtype) for j in range(self.size)]
        return views

    # ----- protocol -----
    def _begin(self, ctx: Ctx) -> None:
        seg = self.seg
        ctl, floor = seg.ctl, self._floor
        for j, ci, _ in self._words:
            if ctl[ci] < floor:
                seg.wait(j, floor, ctx.deadline, lambda: self._alive(ctx, j), ctx.what)
        u = self._u = self._u + 1
        base = self._base = seg.count
        self._floor = base + 1
        p = self._parity = u & 1
        self._sig = ctx.sig
        self._checked = set()
        i = self._my_hdr[p]
        ctl[i] = u
        ctl[i + 1] = ctx.sig

    def _post(self) -> None:
        self.seg.post()

    def _wait(self, ctx: Ctx, j: int, step: int) -> None:
        target = self._base + step
        self.seg.wait(j, target, ctx.deadline, lambda: self._alive(ctx, j), ctx.what)
        if j not in self._checked:
            op, sig = self.seg.header(j, self._parity)
            if op != self._u or sig != self._sig:
                raise SignatureMismatch(
                    f"{ctx.name}: rank {j} issued a different collective (its op #{op}, signature {sig:#x}; "
                    f"this rank op #{self._u}, signature {self._sig:#x}): ops, dtypes, sizes or roots "
                    "differ across ranks", j, sig, self._sig)
            self._checked.add(j)

    def _alive(self, ctx: Ctx, j: int) -> None:
        ctx.check()
        why = self.mesh.gone(j)
        if why is not None:
            raise DistBackendError(f"{ctx.name}: rank {j} {why}")

    def _wait_all(self, ctx: Ctx, step: int, ranks: Sequence[int] | None = None) -> None:
        for j in self._peers if ranks is None else ranks:
            self._wait(ctx, j, step)

    def _first_step(self, ctx: Ctx) -> None:
        """Wait for step 1 of this op on every peer and check each one's header: the
        one wait of a small op (:meth:`_wait_all` at step 1, with the look-ups hoisted)."""
        seg = self.seg
        ctl, target, p, u, sig = seg.ctl, self._base + 1, self._parity, self._u, self._sig
        for j, ci, hdr in self._words:
            if ctl[ci] < target:
                seg.wait(j, target, ctx.deadline, lambda: self._alive(ctx, j), ctx.what)
            h = hdr[p]
            if ctl[h] != u or ctl[h + 1] != sig:
                self._wait(ctx, j, 1)  # raises the mismatch, worded once
        self._checked = self._every_peer

    def _arrived(self, patience: float) -> bool:
        """Whether every peer reaches step 1 of this op within ``patience`` seconds of
        spinning (an async op on the caller's thread: it never sleeps on a peer)."""
        ctl, target = self.seg.ctl, self._base + 1
        now = time.perf_counter
        end = now() + patience
        while True:
            for _, ci, _ in self._words:
                if ctl[ci] < target:
                    break
            else:
                return True
            if now() > end:
                return False

    def _entry(self, ctx: Ctx) -> None:
        """Begin a large op: post once, then wait until every peer is inside it too."""
        self._begin(ctx)
        self._bulk_used = self._u
        self._post()
        self._wait_all(ctx, 1)

    # ----- reductions -----
    def all_reduce(self, ctx: Ctx, x: Array, red: Reducer) -> None:
        seg = self.seg
        nb = x.nbytes
        if nb > seg.small_bytes:
            if ctx.patience:  # async on the caller's thread: the worker runs a large op whole
                raise Deferred(lambda c: self._reduce(c, x, red, None))
            self._reduce(ctx, x, red, None)
            return
        # The small case of _reduce with _begin and _first_step inline (the hot path of
        # small ops): one slot write, one flag wait per peer, one fold.
        ctl, floor = seg.ctl, self._floor
        for j, ci, _ in self._words:
            if ctl[ci] < floor:
                seg.wait(j, floor, ctx.deadline, lambda: self._alive(ctx, j), ctx.what)
        u = self._u = self._u + 1
        self._base = floor = seg.count
        target = self._floor = floor + 1
        p = self._parity = u & 1
        sig = self._sig = ctx.sig
        self._checked = self._every_peer  # checked below, before any byte of theirs is read
        i = self._my_hdr[p]
        ctl[i] = u
        ctl[i + 1] = sig
        slots = self._slot_views.get((p, nb, x.dtype)) or self._slots(p, nb, x.dtype)  # a hit: no call
        slots[self.rank][...] = x
        seg.post()
        for j, ci, hdr in self._words:
            if ctl[ci] < target:
                if ctx.patience and not self._arrived(ctx.patience):
                    # Async, and a peer is not here yet: this rank's part is posted; the
                    # worker waits for the peers and folds (nothing else touched the state).
                    raise Deferred(lambda c: self._fold_slots(c, x, red, slots), True)
                seg.wait(j, target, ctx.deadline, lambda: self._alive(ctx, j), ctx.what)
            h = hdr[p]
            if ctl[h] != u or ctl[h + 1] != sig:
                self._checked = set()
                self._wait(ctx, j, 1)  # raises the mismatch, worded once
        ufunc = red.plain  # (as _fold_slots, inline: the hot path)
        if ufunc is None:
            red.fold(x, slots)
            return
        ufunc(slots[0], slots[1], out=x)
        if len(slots) > 2:
            for part in slots[2:]:
                ufunc(x, part, out=x)

    def _fold_slots(self, ctx: Ctx, x: Array, red: Reducer, slots: list[Array]) -> None:
        """The end of a deferred small all_reduce: wait for step 1 of every peer (checking
        its header), then fold every rank's slot into ``x`` in rank order."""
        if ctx.patience and not self._arrived(ctx.patience):
            raise Deferred(lambda c: self._fold_slots(c, x, red, slots), True)
        self._checked = set()  # (all_reduce marked every peer checked before it deferred)
        self._first_step(ctx)
        red.fold(x, slots)

    def reduce(self, ctx: Ctx, x: Array, dst: int, red: Reducer) -> None:
        self._reduce(ctx, x, red, dst)

    def all_reduce_filled(self, ctx: Ctx, x: Array, red: Reducer, fill: Fill) -> None:
        """:meth:`all_reduce` of ``x`` as ``fill`` would write it (``fill(lo, hi, out)`` writes
        elements ``lo:hi`` into ``out``) straight into the staging buffers, without a pass
        through ``x``; the protocol of the filled ``x``'s. Async: the worker runs it whole."""
        if ctx.patience:
            raise Deferred(lambda c: self._reduce(c, x, red, None, fill))
        self._reduce(ctx, x, red, None, fill)

    def _scratch(self, count: int, dtype: np.dtype[Any]) -> Array:
        """A block of ``count`` elements of ``dtype``, reused (one op at a time)."""
        nb = count * dtype.itemsize
        if self._scratch_block.nbytes < nb:
            self._scratch_block = np.empty(nb, U8)
        return self._scratch_block[:nb].view(dtype)

    def _reduce(self, ctx: Ctx, x: Array, red: Reducer, dst: int | None, fill: Fill | None = None) -> None:
        seg, r, n = self.seg, self.rank, self.size
        nb = x.nbytes
        reader = self._cma if dst is None and nb >= cma.MIN_BYTES else None
        if reader is not None:  # filled or not (ranks may mix the two): the peers read this rank's part in x
            if fill is not None:
                fill(0, x.size, x)
                fill = None
            if cma.all_reduce(self, ctx, x, red, reader):
                return  # (else some rank's array cannot be read: the pipeline, its entry step done)
        if nb <= seg.small_bytes:
            self._begin(ctx)
            slots = self._slots(self._parity, nb, x.dtype)
            if fill is None:
                slots[r][...] = x
            else:
                fill(0, x.size, slots[r])
            seg.post()
            self._first_step(ctx)  # every rank, the non-destinations too: checks every header
            if dst is not None and r != dst:
                return
            red.fold(x, slots)
            return
        f, s0 = 0, 1  # block k goes through buffer (f + k) & 1, its steps come after s0
        if reader is None:  # no entry step where op u - 1 left buffer f free (docs/cpu-backend.md)
            self._begin(ctx)
            u, (tail_u, tail_b) = self._u, self._tail
            if self._bulk_used < u - 1 or tail_u == u - 1:
                f, s0 = (1 - tail_b if tail_u == u - 1 else 0), 0
            else:
                self._post()
                self._wait_all(ctx, 1)
        self._bulk_used = self._u
        isz = x.itemsize
        cap = seg.bulk_bytes // n // 64 * 64 // isz  # elements per rank slice per block
        per_block = cap * n
        gets = dst is None or r == dst
        # A filled slice of rank 0 or 1 goes straight into the fold's output (its first step
        # reads parts 0 and 1 before it writes); other ranks fill a scratch block.
        in_place = r <= 1
        pending: tuple[int, Array, list[tuple[int, int]]] | None = None  # the block to copy out
        copy, by = red.copy, red.copy_by  # (AVG: each copy of a folded sum divides it)

        def copy_out(k: int, blk: Array, bounds: list[tuple[int, int]]) -> None:
            self._wait_all(ctx, s0 + 2 + 2 * k)
            for j in self._peers:
                lo, hi = bounds[j]
                src = seg.bulk(j, (f + k) & 1)[j * cap * isz:(j * cap + hi - lo) * isz]
                if copy is None:
                    np.copyto(_u8(blk[lo:hi]), src)
                else:
                    copy(src.view(x.dtype), by, out=blk[lo:hi])

        # Block k: stage the peers' slices (step s0+1+2k), fold this rank's slice once every peer
        # staged (s0+2+2k); the copy-out of block k-1 runs between posting and waiting.
        for k, start in enumerate(range(0, x.size, per_block)):
            b = (f + k) & 1
            blk = x[start:start + per_block]
            bounds = chunk_bounds(blk.size, n)
            mine = seg.bulk(r, b)
            for j in self._peers:
                lo, hi = bounds[j]
                if fill is None:
                    np.copyto(mine[j * cap * isz:(j * cap + hi - lo) * isz], _u8(blk[lo:hi]))
                else:
                    fill(start + lo, start + hi, mine[j * cap * isz:(j * cap + hi - lo) * isz].view(x.dtype))
            self._post()
            if pending is not None:
                copy_out(*pending)
                pending = None
            lo, hi = bounds[r]
            own = blk[lo:hi]
            res = mine[r * cap * isz:(r * cap + hi - lo) * isz].view(x.dtype)
            if fill is not None:  # this rank's own slice, filled where the fold stays in cache
                own = res if in_place else self._scratch(cap, x.dtype)[:hi - lo]
                fill(start + lo, start + hi, own)
            self._wait_all(ctx, s0 + 1 + 2 * k)
            parts = [own if j == r else seg.bulk(j, b)[r * cap * isz:(r * cap + hi - lo) * isz].view(x.dtype)
                     for j in range(n)]
            red.fold(res, parts, finish=False)  # (the peers divide their copies of res)
            if gets:
                if copy is None:
                    np.copyto(blk[lo:hi], res)
                else:
                    copy(res, by, out=blk[lo:hi])
                pending = (k, blk, bounds)
            self._post()
        self._tail = (self._u, b)
        if pending is not None:
            copy_out(*pending)

    def reduce_scatter(self, ctx: Ctx, out: Array, inputs: Sequence[Array], red: Reducer) -> None:
        seg, r, n = self.seg, self.rank, self.size
        nb = out.nbytes
        res = out
        if any(np.shares_memory(out, inputs[j]) for j in range(n) if j != 0):
            res = np.empty_like(out)  # the fold may write out only where it may alias parts[0]
        if n * nb <= seg.small_bytes:
            self._begin(ctx)
            p = self._parity
            slot = seg.small(r, p)
            for j in self._peers:
                np.copyto(slot[j * nb:(j + 1) * nb], _u8(inputs[j]))
            self._post()
            self._wait_all(ctx, 1)
            red.fold(res, [inputs[j] if j == r else seg.small(j, p)[r * nb:(r + 1) * nb].view(out.dtype)
                           for j in range(n)])
        else:
            self._entry(ctx)
            isz = out.itemsize
            cap = seg.bulk_bytes // n // 64 * 64 // isz
            for k, start in enumerate(range(0, out.size, cap)):
                b, stop = k & 1, min(start + cap, out.size)
                mine = seg.bulk(r, b)
                m = (stop - start) * isz
                for j in self._peers:
                    np.copyto(mine[j * cap * isz:j * cap * isz + m], _u8(inputs[j][start:stop]))
                self._post()
                self._wait_all(ctx, 2 + k)
                red.fold(res[start:stop], [inputs[j][start:stop] if j == r else
                                           seg.bulk(j, b)[r * cap * isz:r * cap * isz + m].view(out.dtype)
                                           for j in range(n)])
        if res is not out:
            np.copyto(out, res)

    # ----- data movement -----
    def broadcast(self, ctx: Ctx, x: Array, src: int) -> None:
        seg, r = self.seg, self.rank
        nb = x.nbytes
        xb = _u8(x)
        if nb <= seg.small_bytes:
            self._begin(ctx)
            p = self._parity
            if r == src:
                np.copyto(seg.small(r, p)[:nb], xb)
            seg.post()

            def rest(c: Ctx) -> None:
                if c.patience and not self._arrived(c.patience):
                    raise Deferred(rest, True)
                self._first_step(c)  # the root too: it compares every peer's header
                if r != src:
                    np.copyto(xb, seg.small(src, p)[:nb])

            if ctx.patience and not self._arrived(ctx.patience):
                raise Deferred(rest, True)  # async: a peer is not here yet (see all_reduce)
            rest(ctx)
            return
        if ctx.patience:
            raise Deferred(lambda c: self.broadcast(c, x, src))  # async, large: whole, on the worker
        self._entry(ctx)
        bb = seg.bulk_bytes
        others = self._peers if r == src else []
        for k, start in enumerate(range(0, nb, bb)):
            piece = xb[start:start + bb]
            if r == src:
                if k >= 2:
                    self._wait_all(ctx, k, others)  # they copied block k-2 out of this buffer
                np.copyto(seg.bulk(r, k & 1)[:piece.size], piece)
                self._post()
            else:
                self._wait(ctx, src, 2 + k)
                np.copyto(piece, seg.bulk(src, k & 1)[:piece.size])
                self._post()

    def all_gather(self, ctx: Ctx, outs: Sequence[Array], inp: Array) -> None:
        seg, r = self.seg, self.rank
        if not np.shares_memory(outs[r], inp):
            np.copyto(outs[r], inp)
        if self.size == 1:
            return
        nb = inp.nbytes
        ib = _u8(inp)
        if nb <= seg.small_bytes:
            self._begin(ctx)
            p = self._parity
            slots = self._slot_views.get((p, nb, U8)) or self._slots(p, nb, U8)  # a hit: no call
            np.copyto(slots[r], ib)
            seg.post()

            def rest(c: Ctx) -> None:
                if c.patience and not self._arrived(c.patience):
                    raise Deferred(rest, True)
                self._first_step(c)  # every peer's slot written and its header checked
                for j in self._peers:
                    np.copyto(_u8(outs[j]), slots[j])

            if ctx.patience and not self._arrived(ctx.patience):
                raise Deferred(rest, True)  # async: a peer is not here yet (see all_reduce)
            rest(ctx)
            return
        if ctx.patience:
            raise Deferred(lambda c: self.all_gather(c, outs, inp))  # async, large: whole, on the worker
        self._entry(ctx)
        bb = seg.bulk_bytes
        for k, start in enumerate(range(0, nb, bb)):
            piece = ib[start:start + bb]
            np.copyto(seg.bulk(r, k & 1)[:piece.size], piece)
            self._post()
            for j in self._peers:
                self._wait(ctx, j, 2 + k)
                np.copyto(_u8(outs[j])[start:start + piece.size], seg.bulk(j, k & 1)[:piece.size])

    def gather(self, ctx: Ctx, outs: Sequence[Array] | None, inp: Array, dst: int) -> None:
        seg, r = self.seg, self.rank
        if r == dst:
            assert outs is not None
            if not np.shares_memory(outs[r], inp):
                np.copyto(outs[r], inp)
        if self.size == 1:
            return
        nb = inp.nbytes
        ib = _u8(inp)
        if nb <= seg.small_bytes:
            self._begin(ctx)
            p = self._parity
            if r != dst:
                np.copyto(seg.small(r, p)[:nb], ib)
            self._post()
            self._wait_all(ctx, 1)  # every rank compares every peer's header
            if r != dst:
                return
            assert outs is not None
            for j in self._peers:
                np.copyto(_u8(outs[j]), seg.small(j, p)[:nb])
            return
        self._entry(ctx)
        bb = seg.bulk_bytes
        for k, start in enumerate(range(0, nb, bb)):
            size = min(bb, nb - start)
            if r != dst:
                if k >= 2:
                    self._wait(ctx, dst, k)
                np.copyto(seg.bulk(r, k & 1)[:size], ib[start:start + size])
                self._post()
            else:
                assert outs is not None
                for j in self._peers:
                    self._wait(ctx, j, 2 + k)
                    np.copyto(_u8(outs[j])[start:start + size], seg.bulk(j, k & 1)[:size])
                self._post()

    def scatter(self, ctx: Ctx, out: Array, inputs: Sequence[Array] | None, src: int) -> None:
        seg, r, n = self.seg, self.rank, self.size
        if r == src:
            assert inputs is not None
            if not np.shares_memory(out, inputs[r]):
                np.copyto(out, inputs[r])
        if n == 1:
            return
        nb = out.nbytes
        ob = _u8(out)
        if n * nb <= seg.small_bytes:
            self._begin(ctx)
            p = self._parity
            if r == src:
                assert inputs is not None
                slot = seg.small(r, p)
                for j in self._peers:
                    np.copyto(slot[j * nb:(j + 1) * nb], _u8(inputs[j]))
            self._post()
            self._wait_all(ctx, 1)  # the root too: it compares every peer's header
            if r != src:
                np.copyto(ob, seg.small(src, p)[r * nb:(r + 1) * nb])
            return
        self._entry(ctx)
        cap = seg.bulk_bytes // n // 64 * 64
        for k, start in enumerate(range(0, nb, cap)):
            size = min(cap, nb - start)
            if r == src:
                assert inputs is not None
                if k >= 2:
                    self._wait_all(ctx, k)
                mine = seg.bulk(r, k & 1)
                for j in self._peers:
                    np.copyto(mine[j * cap:j * cap + size], _u8(inputs[j])[start:start + size])
                self._post()
            else:
                self._wait(ctx, src, 2 + k)
                np.copyto(ob[start:start + size], seg.bulk(src, k & 1)[r * cap:r * cap + size])
                self._post()

    def all_to_all(self, ctx: Ctx, outs: Sequence[Array], inputs: Sequence[Array]) -> None:
        seg, r, n = self.seg, self.rank, self.size
        ins = list(inputs)
        if any(np.shares_memory(o, i) for o in outs for i in inputs):
            ins = [i.copy() for i in inputs]  # in place: keep the inputs while outputs are written
        np.copyto(outs[r], ins[r])
        if n == 1:
            return
        # Step 1: every rank publishes how many bytes it sends to each peer (and the data
        # itself when all of it fits its slot), so every rank knows the whole size matrix.
        sizes = [a.nbytes for a in ins]
        head = 8 * (n + 1)
        inline = head + sum(sizes[j] for j in self._peers) <= seg.small_bytes
        self._begin(ctx)
        p = self._parity
        slot = seg.small(r, p)
        slot[:head].view(np.uint64)[:] = [*sizes, int(inline)]
        if inline:
            off = head
            for j in self._peers:
                np.copyto(slot[off:off + sizes[j]], _u8(ins[j]))
                off += sizes[j]
        self._post()
        matrix: dict[int, list[int]] = {}
        for j in self._peers:
            self._wait(ctx, j, 1)
            row = [int(v) for v in seg.small(j, p)[:head].view(np.uint64)]
            matrix[j] = row
            if row[r] != outs[j].nbytes:
                raise DistBackendError(
                    f"{ctx.name}: rank {j} sends {row[r]} bytes to this rank, which expects "
                    f"{outs[j].nbytes} bytes from it: split sizes differ across ranks")
        if all(matrix[j][n] for j in self._peers) and inline:
            for j in self._peers:
                off = head + sum(matrix[j][i] for i in range(r) if i != j)
                np.copyto(_u8(outs[j]), seg.small(j, p)[off:off + matrix[j][r]])
            return
        # Step 2: blocks through the bulk buffers (every peer is inside this op now).
        self._bulk_used = self._u
        cap = seg.bulk_bytes // n // 64 * 64
        longest = max([sizes[j] for j in self._peers] + [matrix[i][j] for i in matrix for j in range(n) if j != i])
        for k in range(-(-longest // cap)):
            start = k * cap
            mine = seg.bulk(r, k & 1)
            for j in self._peers:
                piece = _u8(ins[j])[start:start + cap]
                np.copyto(mine[j * cap:j * cap + piece.size], piece)
            self._post()
            for j in self._peers:
                self._wait(ctx, j, 2 + k)
                dst = _u8(outs[j])[start:start + cap]
                np.copyto(dst, seg.bulk(j, k & 1)[r * cap:r * cap + dst.size])

    def barrier(self, ctx: Ctx) -> None:
        self._begin(ctx)
        self.seg.post()
        self._first_step(ctx)

    # ----- control -----
    def abort(self, err: BaseException) -> None:
        self.seg.wake_all()

    def close(self) -> None:
        self.seg.close()
