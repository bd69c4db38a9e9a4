"""Replies somebody waits for, asked for at once (REPLY_NOW).

A callee writes the reply to a ``remote()`` call, and an owner its answer to a fork
request, lazily: it waits, up to ``2 * LAZY_WAKE``, to share the connection's next write
(``remote()`` + ``to_here()`` carries the creation's reply with the fetch's), and the
caller's reader reads it lazily too. Only the library's own callbacks run on it, unless a
thread waits on a call's creation future (``rref._get_future().wait()``) or polls
``rref.confirmed_by_owner()``, or a callee waits to run a call until the owner has
confirmed an RRef among its arguments (its fork request). Then the caller asks for it: a
REPLY_NOW frame naming the call (no answer; the callee serves it on its reader) makes the
callee write its deferred frames now and the call's reply as soon as it is made. (A fork
request is deferred and asked for at once: both frames leave in one ``sendmsg``.)
A thread that waits reads the reply itself (as ``rpc_sync`` reads its own; unless the call
has a timeout under ``_READ_MIN_TIMEOUT``, which the reader keeps better); a poll of
``confirmed_by_owner()`` wakes the caller's reader to read it. Each creation future asks once.
"""

from __future__ import annotations

from typing import Any

from ..futures import Future
from . import _wire
from ._info import MessageType as M

__all__ = ["Asked", "on_reply_now"]

_READ_MIN_TIMEOUT = 10.0  # seconds: a waiter reads a reply itself only for calls with no timeout or one this long


class Asked(Future[Any]):
    """The future of a call whose reply may be asked for at once: ``remote()``'s (its
    RRef's creation; the first wait on it asks), a fork request that a call's callee waits
    for (asked as it is sent). See :meth:`ask`."""

    __slots__ = ("agent", "peer", "mid")

    def __init__(self, agent: Any, peer: int) -> None:
        super().__init__()
        self.agent, self.peer, self.mid = agent, peer, 0  # mid: set by the agent's send

    def _block(self, timeout: float | None) -> bool:
        if not self.done():
            agent, call = self.agent, self.agent._pending.get(self.mid) if self.agent is not None else None
            # A reading thread looks at its call's state once a second (_READ_SLICE_MS): a
            # call with a short timeout has the reader read for it, so that it fails on time.
            mine = timeout is None and call is not None and not 0 < call.timeout < _READ_MIN_TIMEOUT
            if self.ask(wake=not mine) and mine:
                # Read the reply on this thread, as rpc_sync does (no hand-off to the
                # reader): agent.wait reads until ``seen`` is done, and takes nothing
                # out of this future, which others may read.
                seen: Future[Any] = Future()

                def mark(_: Future[Any]) -> None:
                    seen._try_complete(None, None)
                mark.inline = True  # type: ignore[attr-defined]  # never blocks: run on the reader
                self.add_done_callback(mark)
                agent.wait(seen, self.peer)
        return super()._block(timeout)

    def ask(self, wake: bool = True) -> bool:
        """Ask the callee for the reply now (once; a no-op when done or not sent yet);
        whether it asked. ``wake``: the connection's reader reads the reply as it comes."""
        agent, mid = self.agent, self.mid
        if agent is None or mid == 0 or self.done():
            return False
        self.agent = None
        conn = agent._out.get(self.peer)
        if conn is None:
            return False
        data, bufs = _wire.dumps(mid)
        try:
            conn.send(M.REPLY_NOW, 0, 0, data, bufs)  # message id 0: nobody answers it
        except OSError:  # a broken connection: its reader fails the call, naming the peer
            return False
        if wake and conn.parked:
            conn.wake()  # the reply is read as it comes, not by the lazy sweep
        return True


def on_reply_now(src: int, payload: Any, reply: Any) -> None:
    """The callee's side: write the reply to the named call at once (served on the reader)."""
    mid = _wire.loads(*payload)
    if reply.conn is not None:
        reply.conn.hurry(mid)
    reply.ok(None)  # (message id 0: nothing is sent)
