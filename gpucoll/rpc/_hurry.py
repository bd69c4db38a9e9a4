"""Replies somebody waits for, asked for at once (REPLY_NOW).

A callee writes the reply to a ``remote()`` call lazily: it waits, up to ``2 * LAZY_WAKE``,
to share the connection's next write (``remote()`` + ``to_here()`` carries it with the
fetch's reply), and the caller's reader reads it lazily too. Only the library's own
callbacks run on it, unless a thread waits on the call's creation future
(``rref._get_future().wait()``) or polls ``rref.confirmed_by_owner()``. Such a thread asks
for it: a REPLY_NOW frame naming the call (no answer; the callee serves it on its reader)
makes the callee write its deferred frames now and the call's reply as soon as it is made,
and the caller's reader is woken to read it. Each creation future asks once.
"""

from __future__ import annotations

from typing import Any

from ..futures import Future
from . import _wire
from ._info import MessageType as M

__all__ = ["Creation", "on_reply_now"]


class Creation(Future[Any]):
    """A ``remote()`` call's future (its RRef's creation): the first wait on it asks the
    callee for the reply at once (:func:`ask`)."""

    __slots__ = ("agent", "peer", "mid")

    def __init__(self, agent: Any, peer: int) -> None:
        super().__init__()
        self.agent, self.peer, self.mid = agent, peer, 0  # mid: set by the agent's send

    def _block(self, timeout: float | None) -> bool:
        if not self.done():
            self.ask()
        return super()._block(timeout)

    def ask(self) -> None:
        """Ask the callee for the reply now (once; a no-op when done or not sent yet)."""
        agent, mid = self.agent, self.mid
        if agent is None or mid == 0 or self.done():
            return
        self.agent = None
        conn = agent._out.get(self.peer)
        if conn is None:
            return
        data, bufs = _wire.dumps(mid)
        try:
            conn.send(M.REPLY_NOW, 0, 0, data, bufs)  # message id 0: nobody answers it
        except OSError:  # a broken connection: its reader fails the call, naming the peer
            return
        if conn.parked:
            conn.wake()  # the reply is read as it comes, not by the lazy sweep


def on_reply_now(src: int, payload: Any, reply: Any) -> None:
    """The callee's side: write the reply to the named call at once (served on the reader)."""
    mid = _wire.loads(*payload)
    if reply.conn is not None:
        reply.conn.hurry(mid)
    reply.ok(None)  # (message id 0: nothing is sent)
