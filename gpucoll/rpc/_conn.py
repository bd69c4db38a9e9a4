"""RPC connections: a connection's send side (frames, deferred frames, socket options),
a request's reply, and the serving of an accepted connection.

See :mod:`gpucoll.rpc._agent` for how calls travel; this module holds what works on one
connection.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import select
import socket
import sys
import threading
import time
import traceback
from typing import Any

from .._env import RPC_SPIN_US_ENV
from .._timeouts import SPIN_BACKOFF_MIN, skip_spins
from ..futures import Future
from . import _local, _wire
from ._info import MessageType

__all__ = ["FLAG_REPLY", "FLAG_ERROR", "MAX_FRAME_BYTES", "HANDSHAKE_TIMEOUT", "LAZY_WAKE", "LAZY_REPLIES",
           "KEEPALIVE_IDLE", "KEEPALIVE_INTERVAL", "KEEPALIVE_COUNT", "USER_TIMEOUT", "Reply", "serve_conn", "dial_unix",
           "rebuild_error", "REMOTE_TRACEBACK", "await_follow", "follow_seconds"]

_log = logging.getLogger("gpucoll.rpc")

FLAG_REPLY = 1
FLAG_ERROR = 2
MAX_FRAME_BYTES = 1 << 36
HANDSHAKE_TIMEOUT = 10.0
LAZY_WAKE = 0.002  # seconds: a "soon" reply nobody reads for is read by then
# Replies the caller only reads lazily (remote()'s creation ack, the RRef control acks): they
# wait, up to LAZY_WAKE, to go out with the connection's next frame in one sendmsg.
# A caller that waits for one asks for it at once (REPLY_NOW, gpucoll.rpc._hurry).
LAZY_REPLIES = frozenset({MessageType.PYTHON_REMOTE_CALL, MessageType.RREF_USER_DELETE,
                          MessageType.RREF_FORK_REQUEST, MessageType.RREF_CHILD_ACCEPT})
_URGENT_MAX = 1024  # REPLY_NOW's marks kept per connection (a mark dropped costs a LAZY_WAKE hold only)
_READ_SLICE_MS = 1000  # a caller reading its own reply looks at its call's state this often
# A caller reading its own reply polls this long before it sleeps (reply_poller): waking a
# thread that slept costs tens of microseconds on an idle virtual machine, a fair part of a
# round trip. A reply that misses the window or comes in its second half skips polling for
# the next calls on the connection, as the store's client does (_timeouts.skip_spins).
_SPIN_US_DEFAULT = 200.0


def spin_seconds() -> float:
    """Seconds a caller polls for its own reply before it sleeps (``GPUCOLL_RPC_SPIN_US``).

    Raises:
        ValueError: the variable is not a number of microseconds >= 0.
    """
    text = os.environ.get(RPC_SPIN_US_ENV, "").strip()
    if not text:
        return _SPIN_US_DEFAULT * 1e-6
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1e6:
        raise ValueError(f"{RPC_SPIN_US_ENV} must be a number of microseconds >= 0 (and under 1e6); got {text!r}")
    return value * 1e-6


# A connection's reading thread that reads a remote() call waits this long, without
# sleeping, for the caller's next frame before it runs the call (await_follow):
# a remote(...).to_here() caller sends its fetch some 20-40 us after the call.
_FOLLOW_US_DEFAULT = 60.0


def follow_seconds(spin_s: float) -> float:
    """Seconds an owner waits for a ``remote()`` call's fetch (:func:`await_follow`): none
    when the caller's poll is off (``GPUCOLL_RPC_SPIN_US=0``), else at most that poll."""
    return min(spin_s, _FOLLOW_US_DEFAULT * 1e-6)


# A host that vanishes without closing its connections (powered off, cable pulled, network
# partitioned) is noticed by TCP itself: keepalive probes after KEEPALIVE_IDLE s without
# traffic, every KEEPALIVE_INTERVAL s, KEEPALIVE_COUNT of them; and TCP_USER_TIMEOUT, the
# most time sent data (a probe included) may stay unacknowledged before the kernel drops
# the connection. Such a peer's calls fail, naming it, within about USER_TIMEOUT s.
KEEPALIVE_IDLE = 2
KEEPALIVE_INTERVAL = 1
KEEPALIVE_COUNT = 3
USER_TIMEOUT = 5.0
_NONE_PICKLE = pickle.dumps(None, protocol=5)
REMOTE_TRACEBACK = "_gpucoll_rpc_traceback"
"""The attribute holding a user function's error's traceback as text, once its frames are
dropped (see :func:`gpucoll.rpc._info.detached`); the caller gets this text."""


class _Conn:
    """One connection, dialed or accepted. On a dialed one, replies are read by whichever
    thread holds ``role``: the connection's reader thread, or a caller waiting for its own
    reply while the reader is parked (no call pending to the peer: it then only watches for
    the peer's hang-up and for ``wake``). On an accepted one, the serving threads wait in
    ``ep`` (see :func:`_serve`). Either way ``wake`` writes to the connection's pipe, which
    its last thread closes (:meth:`close_pipe`)."""

    __slots__ = ("sock", "lock", "peer", "closed", "role", "parked", "wake_r", "wake_w", "reader", "pipe_lock", "second",
                 "outbox", "skip_spin", "backoff", "urgent", "ep", "idle", "threads")

    def __init__(self, sock: socket.socket, peer: int) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.peer = peer
        self.closed = False
        self.role = threading.Lock()
        self.parked = False
        self.reader = _wire.FrameReader(sock, MAX_FRAME_BYTES)
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.pipe_lock = threading.Lock()
        self.second = False
        self.outbox: list[Any] = []  # deferred frames' parts (control replies, remote() requests)
        self.skip_spin = 0  # calls whose caller sleeps at once (reply_poller); the next such count:
        self.backoff = SPIN_BACKOFF_MIN
        self.urgent: set[int] = set()  # calls whose lazy reply a waiter asked for (REPLY_NOW)
        self.ep: Any = None  # an incoming connection's epoll (see _serve), its threads, and those waiting in it
        self.threads = self.idle = 0

    def wake(self) -> None:
        """Unpark the reader thread (a call is pending that nobody is reading for)."""
        with self.pipe_lock:
            if self.wake_w >= 0:
                try:
                    os.write(self.wake_w, b"w")
                except BlockingIOError:  # a full pipe: the reader has been woken already
                    pass

    def close_pipe(self) -> None:
        with self.pipe_lock:
            if self.wake_w >= 0:
                os.close(self.wake_r)
                os.close(self.wake_w)
                self.wake_r = self.wake_w = -1

    def send(self, kind: int, flags: int, mid: int, data: Any, bufs: list[Any], defer: bool = False) -> bool:
        """Write a frame, after those deferred before it (one ``sendmsg`` for all). With
        ``defer``, only queue it (for the next send or :meth:`flush`); returns whether the
        queue was empty before (the caller then arranges a flush)."""
        with self.lock:
            if self.closed:
                raise OSError("the connection is closed")
            parts = _wire.frame_parts(kind, flags, mid, data, bufs)
            if defer and self.urgent and mid in self.urgent:
                self.urgent.discard(mid)  # somebody waits for this reply: it goes now
                defer = False
            if defer:
                self.outbox += parts
                return len(self.outbox) == len(parts)
            if self.outbox:
                parts, self.outbox = self.outbox + parts, []
            _wire.send_parts(self.sock, parts)
            return False

    def hurry(self, mid: int) -> None:
        """Write the deferred frames now, and the reply to call ``mid`` once made (a caller
        waits for it: see :mod:`gpucoll.rpc._hurry`)."""
        with self.lock:
            if len(self.urgent) >= _URGENT_MAX:  # replies already sent when asked for: forget them
                self.urgent.clear()
            self.urgent.add(mid)
        self.flush()

    def flush(self) -> None:
        """Write the deferred frames now."""
        with self.lock:
            if self.outbox and not self.closed:
                parts, self.outbox = self.outbox, []
                _wire.send_parts(self.sock, parts)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.wake()  # the parked reader sees it; it closes the pipe when it leaves


def reply_poller(conn: _Conn, spin_s: float, slice_ms: int) -> tuple[Any, bool]:
    """A poller of ``conn`` for a caller waiting for its own reply, and whether the reply
    (or a hang-up) is there: polled without sleeping for up to ``spin_s`` seconds first,
    unless the last calls on ``conn`` taught that it does not pay (``conn.skip_spin``,
    :func:`gpucoll._timeouts.skip_spins`), then for up to ``slice_ms`` ms asleep."""
    poller = select.poll()
    poller.register(conn.sock, select.POLLIN | select.POLLRDHUP)
    if spin_s > 0.0:
        if conn.skip_spin:
            conn.skip_spin -= 1
        else:
            now = time.perf_counter
            start = now()
            while not poller.poll(0):
                if now() - start > spin_s:
                    skip_spins(conn)
                    break
            else:
                if now() - start > 0.5 * spin_s:
                    skip_spins(conn)
                else:
                    conn.backoff = SPIN_BACKOFF_MIN
                return poller, True
    return poller, bool(poller.poll(slice_ms))


def await_follow(conn: _Conn, budget_s: float) -> None:
    """Before a connection's reading thread runs a ``remote()`` call it has read:
    receive, for up to ``budget_s`` seconds without sleeping, the frame that a
    caller sends right after it in the common loop (``remote(...).to_here()``'s fetch), so
    that this thread serves it (an RRef fetch never blocks) and the fetch's answer leaves
    from the thread that sets the value, with no second thread waking to read it. The
    call's start is delayed by at most ``budget_s``. A frame that does not come in time,
    or comes in the window's second half, turns the wait off for the next calls on the
    connection (:func:`gpucoll._timeouts.skip_spins`), as a caller's poll does."""
    if budget_s <= 0.0:
        return
    if conn.skip_spin:
        conn.skip_spin -= 1
        return
    reader, now = conn.reader, time.perf_counter
    start = now()
    while True:
        if reader.pull() and reader.buffered_kind() is not None:
            if now() - start > 0.5 * budget_s:
                skip_spins(conn)
            else:
                conn.backoff = SPIN_BACKOFF_MIN
            return
        if now() - start > budget_s:
            skip_spins(conn)
            return




def _tune(sock: socket.socket) -> None:
    """An RPC connection's socket options: no Nagle delay; keepalive and a user timeout (TCP);
    larger buffers (a same-host Unix socket: its peer's exit closes it, no keepalive needed)."""
    if _local.family_name(sock) == "unix":
        _local.tune(sock)
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT), ("TCP_USER_TIMEOUT", int(USER_TIMEOUT * 1000))):
        option = getattr(socket, name, None)
        if option is not None:  # Linux has all four; elsewhere keepalive runs at the system's pace
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


class _Call:
    __slots__ = ("fut", "peer", "what", "timeout")

    def __init__(self, fut: Future[Any], peer: int, what: Any, timeout: float) -> None:  # what: str() in errors
        self.fut = fut
        self.peer = peer
        self.what = what
        self.timeout = timeout


def _outcome(fut: Future[Any]) -> Any:
    """The value of a call's own future once it completes, or its error raised, taken out of
    the future first. Raised, the error's traceback holds the frames it passes (the caller's
    among them, with the call's arguments and ``fut``): were the future still holding the
    error, they would make a cycle that only the garbage collector frees, and an RRef among
    them would outlive the failed call. Only for a future nobody else holds."""
    if not fut.done():
        fut._block(None)
    error = fut._error
    if error is None:
        return fut._value
    fut._error, fut._value = None, None  # done, with nothing kept
    try:
        raise error
    finally:
        del error  # this frame, in the traceback, must not hold the error either


class Reply:
    """How a handler answers one request (once): a value, an exception, or a future's outcome."""

    __slots__ = ("agent", "conn", "mid", "kind", "done")

    def __init__(self, agent: Any, conn: _Conn | None, mid: int, kind: MessageType) -> None:
        self.agent, self.conn, self.mid, self.kind, self.done = agent, conn, mid, kind, False

    def ok(self, value: Any, soon: bool = True) -> None:
        """Answer with ``value``. A reply that waits for the connection's next write (a
        control message's, ``remote()``'s) goes within ``2 * LAZY_WAKE`` at the latest,
        unless not ``soon``: then the caller flushes the connection (or sees it written)."""
        if value is None:  # most control replies and no-op calls: no pickling at all
            self._send(0, _NONE_PICKLE, [], soon)
            return
        try:
            data, bufs = _wire.dumps(value, self.agent.pickle_hook(self.conn.peer if self.conn else None))
        except Exception as e:  # noqa: BLE001 -- an unpicklable result is the caller's error
            self.fail(e)
            return
        self._send(0, data, bufs)

    def fail(self, exc: BaseException, tb: str | None = None) -> None:
        if tb is None:
            tb = getattr(exc, REMOTE_TRACEBACK, None)
        text = f"On {self.agent.info}:\n{exc!r}\n{tb if tb is not None else ''.join(traceback.format_exception(exc))}"
        print(text, file=sys.stderr)  # the callee logs what it sends back, as torch's does
        try:
            data, bufs = _wire.dumps((type(exc), text))
        except Exception:  # noqa: BLE001 -- a local exception class: the caller gets a RuntimeError
            data, bufs = _wire.dumps((RuntimeError, text))
        self._send(FLAG_ERROR, data, bufs)

    def from_future(self, fut: Future[Any]) -> None:
        """Answer with a completed future's outcome. Its error is read, not raised: raised
        here, it would take this frame into its traceback, in a cycle with ``fut``."""
        error = fut._error
        if error is not None:
            self.fail(error)
        else:
            self.ok(fut._value)

    def _send(self, flags: int, data: Any, bufs: list[Any], soon: bool = True) -> None:
        if self.done:
            return
        self.done = True
        self.agent.count_served(-1)
        if self.mid == 0:  # a frame nobody waits for: a batch of deletions (see _deletes)
            return
        if self.conn is None:  # a call to ourselves
            self.agent.on_reply(self.mid, flags, data, [bytearray(b) for b in bufs])
            return
        try:
            if self.conn.send(self.kind, flags | FLAG_REPLY, self.mid, data, bufs, self.kind in LAZY_REPLIES) and soon:
                self.agent.timer.flush_soon(self.conn)
        except OSError as e:
            _log.debug("could not reply to worker id %d: %s", self.conn.peer, e)



def serve_conn(agent: Any, sock: socket.socket) -> None:
    """An accepted connection: the handshake, then its two serving threads."""
    try:
        sock.settimeout(HANDSHAKE_TIMEOUT)
        _tune(sock)
        peer = _wire.listen_handshake(sock, agent.key, agent.info.id, agent.secret,
                                      lambda p: p != agent.info.id and p >= 0)
        sock.settimeout(None)
    except Exception as e:  # noqa: BLE001 -- an unauthenticated connection is dropped, unread
        _log.warning("gpucoll.rpc: %s refused a connection: %s", agent.info.name, e)
        sock.close()
        return
    conn = _Conn(sock, peer)  # (its wake pipe tells the serving threads it closed)
    conn.ep = select.epoll()
    conn.ep.register(sock.fileno(), _ARMED)
    conn.ep.register(conn.wake_r, select.EPOLLIN)
    with agent._lock:
        if agent.closed:
            conn.close()
            conn.ep.close()
            conn.close_pipe()
            return
        agent._incoming.add(conn)
    conn.threads = 1
    _serve(agent, conn)


def dial_unix(name: str, key: bytes, me: int, peer: int) -> socket.socket | None:
    """An authenticated connection to a same-host peer's Unix address, or None when that
    fails in any way (the caller then dials the peer's TCP port: when in doubt, TCP)."""
    try:
        sock = _local.connect(name, HANDSHAKE_TIMEOUT)
    except Exception as e:  # noqa: BLE001
        _log.debug("gpucoll.rpc: the Unix address of worker id %d failed (%s): dialing its TCP port", peer, e)
        return None
    try:
        _wire.dial_handshake(sock, key, me, peer)
        sock.settimeout(None)
    except Exception as e:  # noqa: BLE001
        sock.close()
        _log.debug("gpucoll.rpc: the handshake on worker id %d's Unix address failed (%s): dialing its TCP port",
                   peer, e)
        return None
    return sock


_ARMED = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLONESHOT


def _serve(agent: Any, conn: _Conn) -> None:
    """One of an incoming connection's (at most two) serving threads.

    Idle, both wait in one ``epoll`` on the socket, armed once (``EPOLLONESHOT``): a frame
    wakes one of them (an ``epoll`` wait is exclusive), which reads requests until the
    socket has nothing more. When the other thread waits and a worker slot is free, it
    re-arms the socket (the other thread reads what comes next) and runs the request
    itself: no thread is woken to take the reading over, and none hands the request to
    the pool. Otherwise requests go to the pool and it reads on. Either way at most
    ``num_worker_threads`` requests run at once, and the connection is always read."""
    ep, fd = conn.ep, conn.sock.fileno()
    try:  # (conn.threads counts this thread already: its starter counted it)
        while True:
            with conn.pipe_lock:
                conn.idle += 1
            try:
                events = ep.poll()
            finally:
                with conn.pipe_lock:
                    conn.idle -= 1
            if conn.closed:
                return
            handed = any(f == conn.wake_r for f, _ in events)
            if handed:  # frames received already: the thread that read them runs a request
                try:
                    os.read(conn.wake_r, 4096)
                except BlockingIOError:
                    pass
                if conn.closed:  # (what this read took may have been the close's wake: pass it on)
                    conn.wake()
                    return
            with conn.role:
                if handed and len(events) == 1 and not conn.reader.buffered():
                    continue  # read already
                try:
                    request = _read_requests(agent, conn)
                    more = conn.reader.buffered()
                except Exception as e:  # noqa: BLE001
                    if not isinstance(e, (EOFError, OSError)):
                        _log.warning("gpucoll.rpc: %s closed its connection from worker id %d: %s", agent.info.name,
                                     conn.peer, e)
                    with agent._lock:
                        agent._incoming.discard(conn)
                    conn.close()
                    return
            try:
                ep.modify(fd, _ARMED)  # whoever waits reads on
            except OSError:  # closed meanwhile: the wake pipe says so to the other thread
                pass
            if request is not None and more:
                conn.wake()  # the waiting thread reads what this one received
            if request is not None:
                try:
                    agent.dispatch(*request)
                finally:
                    agent._slots.release()
                    request = None  # the call's arguments go now
    finally:
        with conn.pipe_lock:
            conn.threads -= 1
            last = conn.threads == 0
        if last:
            ep.close()
            conn.close_pipe()


def _read_requests(agent: Any, conn: _Conn) -> tuple[int, int, Any, list[bytearray], Reply] | None:
    """Read requests, handing them to the pool, until one this thread may run itself
    (returned), or until nothing more has been received (None)."""
    reader, peer, jobs = conn.reader, conn.peer, agent._jobs
    while True:
        kind, flags, mid, data, bufs = reader.read()
        if flags & FLAG_REPLY or kind not in agent.handlers:
            raise _wire.FrameError(f"an unexpected frame (kind {kind}, flags {flags})")
        reply = Reply(agent, conn, mid, MessageType(kind))
        agent.count_served(1)
        if kind in agent.inline_kinds:
            agent.dispatch(peer, kind, data, bufs, reply)
        elif conn.idle and agent._slots.acquire(blocking=False):
            if kind == MessageType.PYTHON_REMOTE_CALL and not reader.buffered():
                await_follow(conn, follow_seconds(agent.spin_s))  # remote()'s fetch: served below if it comes
            # Frames that came with it and never block (an RRef fetch, control messages)
            # are served first: the other thread would need a wake-up to get to them.
            while reader.buffered_kind() in agent.inline_kinds:
                k2, f2, m2, d2, b2 = reader.read()
                if f2 & FLAG_REPLY:
                    agent._slots.release()
                    raise _wire.FrameError(f"an unexpected frame (kind {k2}, flags {f2})")
                agent.count_served(1)
                agent.dispatch(peer, k2, d2, b2, Reply(agent, conn, m2, MessageType(k2)))
            return peer, kind, data, bufs, reply  # (bytes received after it: _serve wakes the other thread)
        else:
            if not conn.second:  # the connection's second thread, once it serves a call
                conn.second = True
                with conn.pipe_lock:
                    conn.threads += 1
                agent._spawn(_serve, "rpc-in", agent, conn)
            jobs.put(functools.partial(agent.dispatch, peer, kind, data, bufs, reply))
        if not reader.buffered():
            return None


def rebuild_error(exc_type: Any, text: str) -> BaseException:
    """The remote exception as its own type with the remote message (torch's rule)."""
    if text.isascii():  # torch unescapes the repr's "\\n" so the message reads as written
        text = text.encode("ascii").decode("unicode_escape")
    if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
        return RuntimeError(text)
    try:
        return exc_type(text)
    except Exception as e:  # noqa: BLE001
        return RuntimeError(f"Failed to create original exception type. Error msg was {e} Original exception on "
                            f"remote side was {text}")
