"""Collectives over the TCP mesh (ranks on several hosts, or shared memory turned off).

Algorithms, chosen by size (``SMALL`` bytes per rank):

- small messages: one round of direct exchange (every rank sends its data straight
  to the ranks that need it), the latency-optimal choice for the few ranks a CPU
  group has;
- large reductions: reduce-scatter by direct exchange (the owner of each 1/n slice
  folds it in rank order), then an all-gather of the slices;
- large broadcasts: a pipelined chain (ring) of ``CHUNK``-byte pieces, so the root
  sends each byte once and every link carries data at the same time.

Every frame carries the op's signature (kind, dtype, size, root, reduction), so a
rank that issued a different collective, dtype or size gets a DistBackendError
instead of reading foreign bytes into its arrays. In every op, every rank sends a
step-0 frame to every peer and waits for one from every peer (an empty frame where
no data flows: a broadcast root, a gather's non-destination ranks...), so every rank
compares every peer's signature: no rank can finish an op its peers did not issue.
"""

from __future__ import annotations

import zlib
from typing import Callable, Sequence

import numpy as np

from .reduce import Array, Reducer
from .tcp import KIND_COLL, Recv, TcpMesh

__all__ = ["Ctx", "Deferred", "Fill", "TcpCollectives", "signature", "chunk_bounds"]

#: ``fill(lo, hi, out)``: writes elements ``lo:hi`` of an op's input into ``out`` (a 1-D
#: array of ``hi - lo`` elements): an input assembled from several arrays on the fly.
Fill = Callable[[int, int, Array], None]

SMALL = 64 * 1024
CHUNK = 1 << 20
_STEP_BITS = 21  # a frame's tag is (primitive op number << _STEP_BITS) | step
_RESULT = 1 << 20  # steps of the all-gather half of a large all_reduce
_EMPTY = np.empty(0, np.uint8)  # a frame that carries only its signature


class Ctx:
    """What an op needs while it runs: its sequence number, deadline, signature, the
    check that raises once the backend was aborted or broken, and its name for errors
    (made only when an error needs it)."""

    __slots__ = ("seq", "deadline", "sig", "check", "op_type", "group_name", "patience")

    def __init__(self, seq: int, deadline: float, sig: int, check: Callable[[], None],
                 op_type: str, group_name: str) -> None:
        self.seq = seq
        self.deadline = deadline
        self.sig = sig
        self.check = check
        self.op_type = op_type
        self.group_name = group_name
        # > 0: an async op on the caller's thread, which must not wait for peers: the op
        # may spin this many seconds for them, then raises Deferred (see there).
        self.patience = 0.0

    @property
    def name(self) -> str:
        return op_label(self.op_type, self.seq, self.group_name)

    def what(self) -> str:
        return self.name


class Deferred(Exception):
    """Raised by an op run with ``ctx.patience`` when it would have to wait for a peer.
    ``finish(ctx)`` completes it: the rest of the op, from where it stopped (its own part
    may be posted already; the transport's state is left as the op needs it), or the
    whole op when it stopped before doing anything. Whoever catches it runs ``finish``
    next, before any later op of the group (the backend's worker thread does).
    ``resumable``: ``finish`` itself honours ``ctx.patience`` (it raises Deferred again
    rather than wait), so the issuing thread may run it when the worker has not yet."""

    def __init__(self, finish: Callable[[Ctx], None], resumable: bool = False) -> None:
        super().__init__("deferred")
        self.finish = finish
        self.resumable = resumable


def op_label(op_type: str, seq: int, group_name: str) -> str:
    """An op as the CPU backend's errors name it."""
    return f"{op_type} (CPU op #{seq}) on group {group_name!r}"


def signature(*parts: object) -> int:
    """A 32-bit digest of an op's cross-rank invariants (kind, dtype, sizes, root)."""
    return zlib.crc32(repr(parts).encode())


def chunk_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``n`` contiguous slices (the first ones one longer)."""
    base, extra = divmod(numel, n)
    out = []
    start = 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def _bytes(a: Array) -> memoryview:
    return memoryview(a.view(np.uint8)) if a.nbytes else memoryview(bytearray(0))  # type: ignore[arg-type]


class TcpCollectives:
    """The collectives of one group over a :class:`TcpMesh`."""

    def __init__(self, mesh: TcpMesh) -> None:
        self.mesh = mesh
        self.rank = mesh.rank
        self.size = mesh.size
        self._u = 0  # primitive ops run so far (a coalesced op runs several), same on every rank

    # ----- message helpers -----
    def _begin(self) -> None:
        self._u += 1

    def _tag(self, ctx: Ctx, step: int) -> int:
        return (self._u << _STEP_BITS) | step

    def _send(self, ctx: Ctx, dst: int, step: int, a: Array) -> None:
        ctx.check()
        self.mesh.send(dst, KIND_COLL, self._tag(ctx, step), _bytes(a), ctx.sig, ctx.deadline)

    def _post(self, ctx: Ctx, src: int, step: int, into: Array) -> Recv:
        return self.mesh.post(Recv(src, KIND_COLL, self._tag(ctx, step), _bytes(into), ctx.sig))

    def _wait(self, ctx: Ctx, recvs: Sequence[Recv]) -> None:
        try:
            for r in recvs:
                r.wait(ctx.deadline, ctx.what, ctx.check)
        except BaseException:
            for r in recvs:
                if not r.done.is_set():
                    self.mesh.cancel(r)
            raise

    def _exchange(self, ctx: Ctx, step: int, sends: Sequence[tuple[int, Array]],
                  recvs: Sequence[tuple[int, Array]]) -> None:
        """Post every receive, then send everything, then wait: one round."""
        posted = [self._post(ctx, src, step, into) for src, into in recvs]
        try:
            # Start with the next rank so that every rank does not send to rank 0 first.
            for dst, a in sorted(sends, key=lambda s: (s[0] - self.rank) % self.size):
                self._send(ctx, dst, step, a)
        except BaseException:
            for r in posted:
                self.mesh.cancel(r)
            raise
        self._wait(ctx, posted)

    def _peers(self) -> list[int]:
        return [p for p in range(self.size) if p != self.rank]

    def _empties(self) -> list[tuple[int, Array]]:
        """Empty receives from every peer: a rank that takes no data from them still hears
        their step-0 frame, and so compares their signature with its own."""
        return [(p, np.empty(0, np.uint8)) for p in self._peers()]

    # ----- reductions -----
    # An async op on the caller's thread (ctx.patience) over TCP is deferred whole, before it
    # starts: the worker thread runs it (a TCP op cannot be resumed half-way elsewhere).
    def all_reduce(self, ctx: Ctx, x: Array, red: Reducer) -> None:
        if ctx.patience and self.size > 1:
            raise Deferred(lambda c: self._reduce(c, x, red, None))
        self._reduce(ctx, x, red, None)

    def reduce(self, ctx: Ctx, x: Array, dst: int, red: Reducer) -> None:
        self._reduce(ctx, x, red, dst)

    def _reduce(self, ctx: Ctx, x: Array, red: Reducer, dst: int | None) -> None:
        n, r = self.size, self.rank
        self._begin()
        if n == 1:
            _single(x, red)
            return
        peers = self._peers()
        if x.nbytes <= SMALL or x.size < n:
            # Every rank hears from every peer at step 0 (empty frames where no data
            # flows), so every rank compares every peer's signature, the root's included.
            if dst is not None and r != dst:
                self._exchange(ctx, 0, [(p, x if p == dst else _EMPTY) for p in peers],
                               [(p, np.empty(0, np.uint8)) for p in peers])
                return
            parts = [np.empty_like(x) if p != r else x for p in range(n)]
            self._exchange(ctx, 0, [(p, _EMPTY if dst is not None else x) for p in peers],
                           [(p, parts[p]) for p in peers])
            if r != 0:
                parts[r] = x.copy()
            red.fold(x, parts)
            return
        # Pipelined reduce-scatter + all-gather: rank j owns slice j. Pieces of each slice
        # go to their owner, which folds piece k as soon as every peer's piece k landed and
        # sends the result on at once, so the all-gather of early pieces overlaps the
        # reduce-scatter of later ones. Only dst gets results in a reduce.
        bounds = chunk_bounds(x.size, n)
        per = max(1, CHUNK // x.itemsize)

        def pieces(j: int) -> list[tuple[int, int]]:
            lo, hi = bounds[j]
            return [(a, min(a + per, hi)) for a in range(lo, hi, per)]

        lo, hi = bounds[r]
        mine = pieces(r)
        to = peers if dst is None else [] if dst == r else [dst]
        staged = {p: np.empty(hi - lo, x.dtype) for p in peers}
        got = [[self._post(ctx, p, k, staged[p][a - lo:b - lo]) for k, (a, b) in enumerate(mine)] for p in peers]
        results = [] if dst is not None and r != dst else [
            self._post(ctx, p, _RESULT + k, x[a:b]) for p in peers for k, (a, b) in enumerate(pieces(p))]
        try:
            for p in sorted(peers, key=lambda q: (q - r) % n):
                for k, (a, b) in enumerate(pieces(p)):
                    self._send(ctx, p, k, x[a:b])
            for k, (a, b) in enumerate(mine):
                self._wait(ctx, [g[k] for g in got])
                own = x[a:b] if r == 0 else x[a:b].copy()
                out = x[a:b] if dst is None or dst == r else np.empty_like(own)
                red.fold(out, [own if p == r else staged[p][a - lo:b - lo] for p in range(n)])
                for p in to:
                    self._send(ctx, p, _RESULT + k, out)
            self._wait(ctx, results)
        except BaseException:
            for rv in [g for row in got for g in row] + results:
                if not rv.done.is_set():
                    self.mesh.cancel(rv)
            raise

    def reduce_scatter(self, ctx: Ctx, out: Array, inputs: Sequence[Array], red: Reducer) -> None:
        n, r = self.size, self.rank
        self._begin()
        if n == 1:
            np.copyto(out, inputs[0])
            _single(out, red)
            return
        parts = [np.empty_like(out) if p != r else inputs[r] for p in range(n)]
        self._exchange(ctx, 0, [(p, inputs[p]) for p in self._peers()],
                       [(p, parts[p]) for p in self._peers()])
        if any(np.shares_memory(out, q) for q in parts[1:]):
            parts = [q.copy() if i else q for i, q in enumerate(parts)]
        red.fold(out, parts)

    # ----- data movement -----
    def broadcast(self, ctx: Ctx, x: Array, src: int) -> None:
        if ctx.patience and self.size > 1:
            raise Deferred(lambda c: self.broadcast(c, x, src))  # (c.patience is 0)
        n, r = self.size, self.rank
        self._begin()
        if n == 1:
            return
        if x.nbytes <= SMALL or n == 2:
            if r == src:
                self._exchange(ctx, 0, [(p, x) for p in self._peers()], self._empties())
            else:
                self._exchange(ctx, 0, [(p, _EMPTY) for p in self._peers()],
                               [(p, x if p == src else np.empty(0, np.uint8)) for p in self._peers()])
            return
        # A round of empty frames first: every rank compares every peer's signature.
        self._exchange(ctx, 0, [(p, _EMPTY) for p in self._peers()], self._empties())
        # Pipelined chain src -> src+1 -> ... : each piece is forwarded as soon as it lands.
        pos = (r - src) % n
        prev, nxt = (r - 1) % n, (r + 1) % n
        flat = x.view(np.uint8)
        pieces = [(i, min(i + CHUNK, flat.size)) for i in range(0, flat.size, CHUNK)]
        posted = [] if pos == 0 else [self._post(ctx, prev, 1 + k, flat[a:b]) for k, (a, b) in enumerate(pieces)]
        for k, (a, b) in enumerate(pieces):
            if pos != 0:
                self._wait(ctx, [posted[k]])
            if pos != n - 1:
                self._send(ctx, nxt, 1 + k, flat[a:b])

    def all_gather(self, ctx: Ctx, outs: Sequence[Array], inp: Array) -> None:
        if ctx.patience and self.size > 1:
            raise Deferred(lambda c: self.all_gather(c, outs, inp))
        r = self.rank
        self._begin()
        if not np.shares_memory(outs[r], inp):
            np.copyto(outs[r], inp)
        if self.size == 1:
            return
        self._exchange(ctx, 0, [(p, inp) for p in self._peers()], [(p, outs[p]) for p in self._peers()])

    def gather(self, ctx: Ctx, outs: Sequence[Array] | None, inp: Array, dst: int) -> None:
        r = self.rank
        self._begin()
        if r != dst:
            self._exchange(ctx, 0, [(p, inp if p == dst else _EMPTY) for p in self._peers()], self._empties())
            return
        assert outs is not None
        if not np.shares_memory(outs[r], inp):
            np.copyto(outs[r], inp)
        self._exchange(ctx, 0, [(p, _EMPTY) for p in self._peers()], [(p, outs[p]) for p in self._peers()])

    def scatter(self, ctx: Ctx, out: Array, inputs: Sequence[Array] | None, src: int) -> None:
        r = self.rank
        self._begin()
        if r != src:
            self._exchange(ctx, 0, [(p, _EMPTY) for p in self._peers()],
                           [(p, out if p == src else np.empty(0, np.uint8)) for p in self._peers()])
            return
        assert inputs is not None
        if not np.shares_memory(out, inputs[r]):
            np.copyto(out, inputs[r])
        self._exchange(ctx, 0, [(p, inputs[p]) for p in self._peers()], self._empties())

    def all_to_all(self, ctx: Ctx, outs: Sequence[Array], inputs: Sequence[Array]) -> None:
        r = self.rank
        self._begin()
        # Outputs may alias inputs (in-place all_to_all): send from copies of the inputs then.
        ins = list(inputs)
        if any(np.shares_memory(o, i) for o in outs for i in inputs):
            ins = [i.copy() for i in inputs]
        np.copyto(outs[r], ins[r])
        if self.size == 1:
            return
        self._exchange(ctx, 0, [(p, ins[p]) for p in self._peers()], [(p, outs[p]) for p in self._peers()])

    def barrier(self, ctx: Ctx) -> None:
        self._begin()
        if self.size == 1:
            return
        empty = np.empty(0, np.uint8)
        self._exchange(ctx, 0, [(p, empty) for p in self._peers()],
                       [(p, np.empty(0, np.uint8)) for p in self._peers()])


def _single(x: Array, red: Reducer) -> None:
    """A reduction over one rank: the rank's own contribution, finished (AVG/PREMUL_SUM)."""
    if red.factor is None and red.op.name != "AVG":
        return
    acc = red.contribution(x)
    acc = acc if acc is not x else x.copy()
    red.finish(acc)
    np.copyto(x, acc, casting="unsafe")
