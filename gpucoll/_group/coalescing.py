"""Coalescing: ``with gpucoll.coalescing(group) as cm:`` batches the ops issued inside
into one op when the block ends.

Every coalescing rule is here: which ops may be deferred (the group's op methods
hand them to :meth:`CoalescingManager._defer`), which are refused inside a block
(:func:`_not_coalescable`, :func:`refuse_inside`), and how a block opens and
flushes (:func:`block`). The group is reached through :class:`CoalescingGroup`, so
this module imports nothing of the group's.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Protocol, Sequence

from .. import array as _array
from .._backends.base import Backend
from .._buffer import Buffer
from .._work import Work

__all__ = ["CoalescingManager", "CoalescingGroup", "block", "refuse_inside", "_not_coalescable"]


class CoalescingGroup(Protocol):
    """What a coalescing block needs of its ProcessGroup."""

    group_name: str
    _coalescing: CoalescingManager | None

    def size(self) -> int: ...
    def _restate(self) -> None: ...
    def _check_usable(self) -> None: ...
    def _backend_for_all(self, bufs: Sequence[Buffer], names: Sequence[str]) -> Backend: ...
    def _issue(self, backend: Backend, start: Callable[[], Work], buf: Buffer | None,
               outputs: list[Any], peer: int = -1, op: str = "", red: Any = None, async_op: bool = False) -> Work: ...
    def _finish(self, backend: Backend, work: Work, async_op: bool) -> Work | None: ...


def _not_coalescable(op: str) -> None:
    raise RuntimeError(f"{op} cannot run inside gpucoll.coalescing(); only all_reduce, "
                       "all_gather_single, reduce_scatter_single, isend and irecv can")


def refuse_inside(pg: CoalescingGroup, what: str) -> None:
    """Raise if a coalescing block is open on ``pg`` (object collectives)."""
    if pg._coalescing is not None:
        raise RuntimeError(f"{what} cannot run inside gpucoll.coalescing()")


@contextlib.contextmanager
def block(pg: CoalescingGroup, async_ops: bool) -> Iterator[CoalescingManager]:
    """Open a coalescing block on ``pg``; flush it when the block ends without error."""
    pg._check_usable()
    if pg._coalescing is not None:
        raise RuntimeError(f"coalescing() blocks on group {pg.group_name!r} do not nest")
    cm = CoalescingManager(pg, async_ops)
    pg._coalescing = cm
    pg._restate()  # (the device hot path's derived state: ProcessGroup._restate)
    try:
        yield cm
    finally:
        pg._coalescing = None
        pg._restate()
    cm._flush()


class CoalescingManager:
    """What ``with gpucoll.coalescing(group) as cm:`` yields: ops on ``group`` inside the
    block are collected and issued as one op when the block ends.

    Attributes:
        works: the Works issued at the end of the block (one per batch; one per op for
            reduce_scatter_single, which has no coalesced form).
    """

    def __init__(self, group: CoalescingGroup, async_ops: bool) -> None:
        self.group = group
        self.async_ops = async_ops
        self.works: list[Work] = []
        self._kind: str | None = None
        self._op: Any = None
        self._items: list[tuple[Any, ...]] = []
        self._placeholders: list[Work] = []
        self._backend: Backend | None = None

    def _defer(self, group: CoalescingGroup, kind: str, op: Any, item: tuple[Any, ...],
               async_op: bool) -> Work | None:
        if self._kind is None:
            self._kind, self._op = kind, op
        elif kind != self._kind or op != self._op:
            raise ValueError(f"a coalescing() block batches one kind of op with one ReduceOp; got {kind} "
                             f"(op={op}) after {self._kind} (op={self._op})")
        placeholder = Work(item[0] if kind == "p2p" else kind)
        placeholder.group_name = group.group_name
        placeholder._result[:] = [item[2]] if not (kind == "p2p" and item[0] == "send") else []
        self._items.append(item)
        self._placeholders.append(placeholder)
        return placeholder if async_op else None

    def _defer_p2p(self, group: CoalescingGroup, item: tuple[Any, ...]) -> Work:
        work = self._defer(group, "p2p", None, item, True)
        assert work is not None  # async_op=True: the placeholder
        return work

    def _flush(self) -> None:
        g, kind, op, items, a = self.group, self._kind, self._op, self._items, self.async_ops
        if kind is None:
            return
        bufs = [it[1] for it in items]
        backend = self._backend = g._backend_for_all(bufs, [f"op {i} of the coalescing block" for i in range(len(bufs))])
        if kind == "all_reduce":
            works = [g._issue(backend, lambda: backend.all_reduce_coalesced(bufs, op), bufs[0],
                              [it[2] for it in items], async_op=a)] * len(items)
        elif kind == "all_gather_single":
            outs = [_array.split_buffer(b, g.size()) for b in bufs]
            ins = [it[3] for it in items]
            works = [g._issue(backend, lambda: backend.all_gather_coalesced(outs, ins), ins[0],
                              [it[2] for it in items], async_op=a)] * len(items)
        elif kind == "reduce_scatter_single":
            works = [g._issue(backend, lambda it=it: backend.reduce_scatter_single(it[1], it[3], op),  # type: ignore[misc]
                              it[1], [it[2]], async_op=a) for it in items]
        else:
            batch = [(it[0], it[1], it[3], it[4]) for it in items]
            works = [g._issue(backend, lambda: backend.batch_p2p(batch), bufs[0],
                              [it[2] for it in items if it[0] == "recv"], async_op=a)] * len(items)
        for placeholder, work in zip(self._placeholders, works):
            work._add_done_callback(lambda w, p=placeholder: _complete_from(p, w))  # type: ignore[misc]
        self.works = list({id(w): w for w in works}.values())
        for work in self.works:
            g._finish(backend, work, self.async_ops)

    def wait(self) -> None:
        """Wait for every Work of the block (as a synchronous op would)."""
        if self._backend is None:
            return
        for work in self.works:
            self.group._finish(self._backend, work, False)


def _complete_from(placeholder: Work, work: Work) -> None:
    placeholder.seq = work.seq
    exc = work.exception()
    if exc is not None:
        placeholder._set_exception(exc)
    else:
        placeholder._set_result(active_duration=work.active_duration, source_rank=work._source_rank)

