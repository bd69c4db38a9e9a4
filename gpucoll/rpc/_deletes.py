"""User RRefs' deletions (RREF_USER_DELETE), sent with the next request to their owner.

A deleted user RRef's deletion waits in its context's queue for the owner
(``RRefContext.deletes``). The next request to that owner (``rpc_sync``, ``rpc_async``,
``remote()``, ``to_here()``) takes the queue and writes it as a frame nobody answers
(message id 0), just before its own request and in the same ``sendmsg``. The owner serves
RRef control messages on the connection's reader, in the order they arrive, before it
reads the next frame, so the request's reply, whatever it says, comes after the deletions
were done: it is their acknowledgement. A queue no request takes within ``2 * LAZY_WAKE``
is sent on its own, answered and retried as every control message is (deleting a fork
twice is a no-op); so is every deletion under the faulty agent, whose injected failures
count RREF_USER_DELETE sends.

This spares a deletion its own message id, pending call, acknowledgement frame and
reply handling on both ends; ``remote()`` + ``to_here()`` in a loop deletes one RRef
per round trip.
"""

from __future__ import annotations

import logging
from typing import Any

from ..futures import Future
from . import _wire
from ._info import MessageType as M
from ._info import WorkerInfo

__all__ = ["Flush", "send", "send_all"]

_log = logging.getLogger("gpucoll.rpc")

# ``ctx`` below is the worker's gpucoll.rpc._rref.RRefContext (which imports this module).


class Flush:
    """Sends the queue for one owner on its own (the agent's lazy sweep calls :meth:`flush`)."""

    __slots__ = ("ctx", "owner")

    def __init__(self, ctx: Any, owner: WorkerInfo) -> None:
        self.ctx, self.owner = ctx, owner

    def flush(self) -> None:
        try:
            self._send()
        except Exception:  # noqa: BLE001 -- the timer's thread must go on
            _log.exception("gpucoll.rpc: sending RRef deletions to %s failed", self.owner)

    def _send(self) -> None:
        ctx, owner = self.ctx, self.owner
        agent = ctx.agent
        with ctx.lock:
            ctx.flushing.discard(owner.id)  # (a deletion from now on queues a Flush again)
            batch = ctx.deletes.pop(owner.id, None)
        if not batch or agent.closed:
            return
        conn = agent._out.get(owner.id)
        if conn is None:  # dialing may block: not on the timer's thread
            agent.submit(lambda: ctx.send_with_retries(owner, M.RREF_USER_DELETE, batch))
            return
        ctx.send_with_retries(owner, M.RREF_USER_DELETE, batch)  # (its errors go to its future)
        conn.flush()  # now: this is the timer's sweep already


def send(ctx: Any, to: WorkerInfo, kind: M, obj: Any, timeout: float, what: Any, wake: str = "now", into: Any = None,
         plain: bool = False) -> Future[Any]:
    """``ctx.agent.send(to, ...)`` (a request to ``to``), with the deletions queued for
    ``to`` written first, as an unanswered frame in the same ``sendmsg``."""
    if to.id not in ctx.deletes or not _carry(ctx, to):
        return ctx.agent.send(to, kind, obj, timeout, what, wake, into, plain)  # type: ignore[no-any-return]
    try:  # (these requests are never deferred: their write takes the deletions too)
        return ctx.agent.send(to, kind, obj, timeout, what, wake, into, plain)  # type: ignore[no-any-return]
    except BaseException:
        _sent(ctx, to)
        raise


def _carry(ctx: Any, to: WorkerInfo) -> bool:
    """Before a request to ``to``: put the deletions queued for it on the connection's
    outbox as an unanswered frame (the request's ``sendmsg`` writes it); whether it did."""
    agent = ctx.agent
    conn = agent._out.get(to.id)
    if conn is None or agent.faults is not None:
        return False  # the lazy flush sends them on their own
    with ctx.lock:
        batch = ctx.deletes.pop(to.id, None)
    if not batch:
        return False
    data, _ = _wire.dumps(batch)
    parts = _wire.frame_parts(M.RREF_USER_DELETE, 0, 0, data, [])
    with conn.lock:
        if conn.closed:  # a broken connection: the owner is lost (see _sent())
            return False
        conn.outbox += parts  # (written by the request's sendmsg, first)
    return True


def _sent(ctx: Any, to: WorkerInfo) -> None:
    """After the request that carried a batch raised before its write: a frame still on
    the outbox is written soon. Only a broken connection loses it, and then the owner is lost: its
    RRefs go with it, and calls to it fail at once, deletions sent alone included."""
    conn = ctx.agent._out.get(to.id)
    if conn is not None and conn.outbox:
        ctx.agent.timer.flush_soon(conn)


def send_all(ctx: Any) -> list[Future[Any]]:
    """Every queued deletion, sent on its own now (shutdown); the futures of their acknowledgements."""
    with ctx.lock:
        queued, ctx.deletes = ctx.deletes, {}
    infos = ctx.agent.by_id  # (an owner that left a dynamic group took its RRefs with it)
    return [ctx.send_with_retries(infos[owner], M.RREF_USER_DELETE, batch)
            for owner, batch in queued.items() if batch and owner in infos]
