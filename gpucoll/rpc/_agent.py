"""The RPC agent: one listening port per worker, authenticated connections, pending calls.

Each worker listens on its own port (bound as 0, published in the store). A caller dials
a callee once, on first use, and sends its requests on that connection (the caller's
thread pickles and writes a request itself, one ``sendmsg``); replies come back on it.

Replies on a dialed connection are read by whichever thread holds its reading role: the
connection's reader thread while calls nobody waits on are pending, or a caller waiting
for its own reply (``rpc_sync``, ``to_here``) while the reader is parked; parked, the
reader only watches for the peer's hang-up and a wake. RRef control frames nobody waits
for may wait up to ``2 * LAZY_WAKE`` to share the next write (see :mod:`._hurry`).
Incoming connections are served by :func:`gpucoll.rpc._conn.serve_conn` (at most two
threads per connection, idle in one epoll; a frame wakes one) and a pool of ``num_worker_threads`` threads; at
most ``num_worker_threads`` requests run at once.

A connection that breaks (the peer exited or was killed, or TCP keepalive gave up on a
vanished host) fails every call pending on it at once, naming the peer, and marks the
peer lost: later calls to it fail at once too.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import queue
import select
import socket
import threading
import time
from typing import Any, Callable, Iterable

from ..futures import Future
from . import _local, _wire
from ._conn import (FLAG_ERROR, FLAG_REPLY, HANDSHAKE_TIMEOUT, _READ_SLICE_MS, Reply, _Call, _Conn, _outcome,
                    _tune, dial_unix, rebuild_error, reply_poller, serve_conn, spin_seconds)
from ._faults import FaultSpec
from ._info import AgentShutDownError, IntentionalFailureError, MessageType, PeerLostError, UnknownWorkerError, WorkerInfo, detached
from ._timer import Timer

__all__ = ["Agent", "Reply", "FLAG_REPLY", "FLAG_ERROR"]

_log = logging.getLogger("gpucoll.rpc")
Handler = Callable[[int, Any, Reply], None]
_NO_HOOK: Any = object()

class Agent:
    """One worker's RPC endpoint. Built by ``init_rpc``; the API module holds the only one."""

    def __init__(self, store: Any, info: WorkerInfo, peers: dict[int, WorkerInfo], listener: socket.socket,
                 addresses: dict[int, tuple[str, int]], options: Any, faults: FaultSpec | None,
                 unix_listener: socket.socket | None = None) -> None:
        self.store = store
        self.info = info
        self.options = options
        self.timeout = float(options.rpc_timeout)
        self.spin_s = spin_seconds()  # a caller's poll for its own reply before it sleeps
        self.num_worker_threads = int(getattr(options, "num_worker_threads", 16))
        self.device_maps: dict[str, dict[str, str]] = dict(getattr(options, "device_maps", {}) or {})
        self.faults = faults
        self.is_static_group = True
        self.by_id: dict[int, WorkerInfo] = dict(peers)
        self.by_name = {w.name: w for w in peers.values()}
        self.addresses = dict(addresses)
        self.unix_addresses: dict[int, str] = {}  # same-host peers' Unix addresses (see _local)
        self.key, self.secret = _wire.rpc_key(store)
        self.handlers: dict[int, Handler] = {}
        self.inline_kinds: frozenset[int] = frozenset()  # handlers that never block run on the reader
        self.pickle_hook_factory: Callable[[int | None], Callable[[Any], Any] | None] = lambda _peer: None
        self.lost: dict[int, str] = {}
        self._hooks: dict[int | None, Callable[[Any], Any] | None] = {}
        self.closed = False
        self._active = 0  # calls received and not yet answered
        self._active_lock = threading.Lock()
        self._listener = listener
        self._unix_listener = unix_listener
        self._out: dict[int, _Conn] = {}
        self._incoming: set[_Conn] = set()
        self._dial_locks: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()
        self._pending: dict[int, _Call] = {}
        self._per_peer: dict[int, int] = {}  # calls pending to each peer (its reader parks at 0)
        self._count_lock = threading.Lock()
        self._ids = itertools.count(1)
        self.timer = Timer(self)  # calls' timeouts, the lazy sweep
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.idle_threads = 0
        self._slots = threading.BoundedSemaphore(self.num_worker_threads)  # requests running at once
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start serving (once the handlers are installed) and running timeouts."""
        if self._threads:
            return
        self._threads = [self._spawn(self._accept_loop, "rpc-accept", self._listener),
                         self._spawn(self.timer.loop, "rpc-timer")]
        if self._unix_listener is not None:
            self._threads.append(self._spawn(self._accept_loop, "rpc-accept-unix", self._unix_listener))
        self._threads += [self._spawn(self._work_loop, f"rpc-worker-{i}") for i in range(self.num_worker_threads)]

    # ----- workers ------------------------------------------------------------------------

    def _spawn(self, fn: Callable[..., None], name: str, *args: Any) -> threading.Thread:
        t = threading.Thread(target=fn, args=args, name=f"{name}:{self.info.name}", daemon=True)
        t.start()
        return t

    def worker_info(self, to: Any = None) -> WorkerInfo:
        """The WorkerInfo of a name, an id or a WorkerInfo (None: this worker)."""
        if type(to) is str:
            found = self.by_name.get(to)
            if found is not None:
                return found
        if to is None:
            return self.info
        if isinstance(to, WorkerInfo):
            return to
        found = self.by_name.get(to) if isinstance(to, str) else (
            self.by_id.get(to) if isinstance(to, int) and not isinstance(to, bool) else None)
        if found is None:
            if not isinstance(to, (str, int)):
                raise ValueError(f"Cannot get WorkerInfo from name {to!r}: pass a worker name, id or WorkerInfo")
            raise UnknownWorkerError(f"Unknown destination worker {to!r}: could not find destination among the "
                                     f"workers {sorted(self.by_name)}")
        return found

    def worker_infos(self) -> list[WorkerInfo]:
        return sorted(self.by_id.values(), key=lambda w: w.id)

    # torch's RpcAgent names, for code (and torch's tests) that reach the agent directly
    def get_worker_info(self, worker_name: Any = None) -> WorkerInfo:
        return self.worker_info(worker_name)

    def get_worker_infos(self) -> list[WorkerInfo]:
        return self.worker_infos()

    def get_debug_info(self) -> dict[str, str]:
        return self.debug_info()

    def _get_device_map(self, to: WorkerInfo) -> dict[str, str]:
        return dict(self.device_maps.get(to.name, {}))

    def pickle_hook(self, peer: int | None) -> Callable[[Any], Any] | None:
        hook = self._hooks.get(peer, _NO_HOOK)
        if hook is _NO_HOOK:
            hook = self._hooks[peer] = self.pickle_hook_factory(peer)
        return hook  # type: ignore[no-any-return]

    def peers_changed(self) -> None:
        """A worker joined or left: the pickling hooks (device maps per peer) are made anew."""
        self._hooks = {}

    # ----- sending ------------------------------------------------------------------------

    def resolve_timeout(self, timeout: float) -> float:
        """-1: the agent's default; 0: none (returned as 0)."""
        t = self.timeout if timeout is None or timeout < 0 else float(timeout)
        return t

    def send(self, to: WorkerInfo, kind: MessageType, obj: Any, timeout: float = -1.0, what: Any = "",
             wake: str = "now", into: Any = None, plain: bool = False) -> Future[Any]:
        """Send a request; the future completes with the reply's value or fails with its error.

        ``plain``: ``obj`` holds nothing the pickling hook answers for (no RRef, no device
        array): it is pickled without the hook.

        ``wake`` says who reads the reply: ``"now"`` the connection's reader (woken if parked),
        ``"caller"`` the caller itself, through :meth:`wait` (``rpc_sync``, ``to_here``),
        ``"soon"`` whoever reads next, or the reader within ``2 * LAZY_WAKE`` seconds (a reply
        that only runs the library's own callbacks: ``remote()``).

        Raises (synchronously, as torch): an unpicklable argument, an unknown worker.
        """
        fut: Future[Any] = Future() if into is None else into  # into: a future of ours (_hurry.Asked)
        if self.closed:
            raise AgentShutDownError(f"RPC has been shut down on {self.info.name}: cannot send {kind.name} to "
                                     f"{to.name}")
        if not what:
            what = kind.name
        faults = self.faults
        if faults is not None and faults.should_fail(kind.name):
            fut.set_exception(IntentionalFailureError(f"Send attempt failed intentionally for {kind.name}"))
            return fut
        peer = to.id
        if plain:
            data, bufs = _wire.dumps(obj)
        else:
            hook = self._hooks.get(peer, _NO_HOOK)
            data, bufs = _wire.dumps(obj, self.pickle_hook(peer) if hook is _NO_HOOK else hook)
        timeout = self.timeout if timeout is None or timeout < 0 else float(timeout)
        mid = next(self._ids)
        if into is not None:
            into.mid = mid
        with self._count_lock:
            self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        self._pending[mid] = _Call(fut, peer, what, timeout)
        if timeout > 0:
            self.timer.deadline(timeout, mid)
        if wake == "soon":
            clock = self.timer
            clock.lazy.append((time.monotonic(), mid))
            if not clock.lazy_armed:
                clock.arm_lazy(True)
        delay = faults.delay(kind.name) if faults is not None else 0.0
        if delay > 0:
            timer = threading.Timer(delay, self._transmit, (to, kind, mid, data, bufs, False))
            timer.daemon = True
            timer.start()
        else:
            # A user function's request (remote()'s) leaves at once: it starts the callee's
            # work, which a caller overlaps with its own. Only the RRef protocol's control
            # messages wait for the next frame.
            self._transmit(to, kind, mid, data, bufs, defer=wake == "soon" and kind is not MessageType.PYTHON_REMOTE_CALL)
        if wake == "now":
            conn = self._out.get(peer)
            if conn is not None and conn.parked:
                conn.wake()
        return fut

    def _pop(self, mid: int) -> _Call | None:
        """Take a pending call (its reply came, it timed out or failed); None if gone already."""
        call = self._pending.pop(mid, None)
        if call is not None:
            with self._count_lock:
                self._per_peer[call.peer] -= 1
        return call

    def wait(self, fut: Future[Any], to: int) -> Any:
        """Wait for a call's reply to worker ``to``, reading it on this thread when the
        connection's reader is parked (one thread hand-off less per round trip); else as
        ``fut.wait()``. Returns the value or raises the error.

        ``fut`` is the caller's alone (``rpc_sync``, ``to_here``): its error is taken out of
        it as it is raised (see :func:`gpucoll.rpc._conn._outcome`)."""
        conn = self._out.get(to)
        if conn is None or fut.done() or not conn.role.acquire(blocking=False):
            return _outcome(fut)
        try:
            if not conn.closed:
                self._read(conn, fut)
        except Exception as e:  # noqa: BLE001 -- the connection is over; say why to its calls
            conn.role.release()
            self._peer_lost(conn, e)
        else:
            conn.role.release()
            if self._per_peer.get(conn.peer) and conn.parked:
                conn.wake()  # others' replies are still to come: the reader reads them
        return _outcome(fut)

    def _read(self, conn: _Conn, fut: Future[Any] | None) -> None:
        """Read replies on ``conn`` (holding its role) until ``fut`` is done, or, for the
        reader thread (``fut`` None), until no call to the peer is pending."""
        reader, per_peer, peer = conn.reader, self._per_peer, conn.peer
        poller = None
        while True:
            if fut is not None:
                if fut.done():
                    return
                if not reader.buffered():
                    if poller is None:  # (it polls a while first: _conn.reply_poller)
                        poller, ready = reply_poller(conn, self.spin_s, _READ_SLICE_MS)
                    else:
                        ready = bool(poller.poll(_READ_SLICE_MS))
                    if not ready:
                        continue  # look again whether the call timed out meanwhile
            elif not per_peer.get(peer) and not reader.buffered():
                return
            kind, flags, mid, data, bufs = reader.read()
            if not flags & FLAG_REPLY:
                raise _wire.FrameError(f"a request (kind {kind}) on a reply connection")
            self.on_reply(mid, flags, data, bufs)

    def _transmit(self, to: WorkerInfo, kind: MessageType, mid: int, data: Any, bufs: list[Any],
                  raising: bool = True, defer: bool = False) -> None:
        if to.id == self.info.id:
            self.count_served(1)
            reply = Reply(self, None, mid, kind)
            copied = [bytearray(_wire._flat(b)) for b in bufs]
            self._jobs.put(lambda: self.dispatch(self.info.id, kind, data, copied, reply))
            return
        try:
            reason = self.lost.get(to.id)
            if reason is not None:
                raise PeerLostError(reason)
            conn = self._conn_to(to)
            if conn.send(kind, 0, mid, data, bufs, defer):
                self.timer.flush_soon(conn)
        except (OSError, EOFError, PeerLostError, AgentShutDownError) as e:
            call = self._pop(mid)
            if call is not None:
                err = e if isinstance(e, (PeerLostError, AgentShutDownError)) else PeerLostError(
                    f"RPC {call.what} to {to} failed: could not send to it ({e})")
                call.fut._try_complete(None, detached(err))  # its frames would keep the call's arguments
        except Exception as e:  # noqa: BLE001 -- a local error (a buffer that cannot be sent)
            call = self._pop(mid)
            if raising:
                raise
            if call is not None:
                call.fut._try_complete(None, detached(e))

    def _conn_to(self, to: WorkerInfo) -> _Conn:
        conn = self._out.get(to.id)
        if conn is not None:
            return conn
        with self._lock:
            lock = self._dial_locks.setdefault(to.id, threading.Lock())
        with lock:
            conn = self._out.get(to.id)
            if conn is not None:
                return conn
            host, port = self.addresses[to.id]
            name = self.unix_addresses.get(to.id)
            sock = dial_unix(name, self.key, self.info.id, to.id) if name is not None else None
            try:
                if sock is None:
                    sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT)
                    _tune(sock)
                    _wire.dial_handshake(sock, self.key, self.info.id, to.id)
                    sock.settimeout(None)
            except Exception as e:  # noqa: BLE001
                reason = f"cannot connect to worker {to.name} (id {to.id}) at {host}:{port}: {e}"
                if isinstance(e, (ConnectionRefusedError, ConnectionResetError, EOFError)):
                    self.lost[to.id] = f"worker {to.name} (id {to.id}) is gone: {reason}"
                raise PeerLostError(reason) from e
            conn = _Conn(sock, to.id)
            if self.closed:
                conn.close()
                raise AgentShutDownError(f"RPC has been shut down on {self.info.name}")
            self._out[to.id] = conn
            self._spawn(self._reply_loop, f"rpc-out-{to.id}", conn)
            return conn

    def _reply_loop(self, conn: _Conn) -> None:
        """The connection's reader: reads replies while calls to the peer are pending and no
        caller reads for itself; parked otherwise, watching for the peer's hang-up (a worker
        that exits or is killed is noticed at once, pending calls or not) and for a wake."""
        poller = select.poll()
        poller.register(conn.sock, select.POLLRDHUP)
        poller.register(conn.wake_r, select.POLLIN)
        try:
            while not conn.closed:
                conn.parked = True
                if not self._per_peer.get(conn.peer) and not conn.reader.buffered():
                    poller.poll()
                    try:
                        os.read(conn.wake_r, 4096)
                    except BlockingIOError:
                        pass
                conn.parked = False
                with conn.role:
                    if conn.closed:
                        break
                    if poller.poll(0) and not self._per_peer.get(conn.peer) and not conn.reader.buffered():
                        # A hang-up (or stray bytes) with nothing pending: read, to learn which.
                        self._read_one(conn)
                    self._read(conn, None)
            raise EOFError("the connection was closed")
        except Exception as e:  # noqa: BLE001 -- the connection is over; say why to its calls
            self._peer_lost(conn, e)
        finally:
            conn.parked = False
            conn.close_pipe()

    def _read_one(self, conn: _Conn) -> None:
        kind, flags, mid, data, bufs = conn.reader.read()  # a hang-up: this does not block
        if not flags & FLAG_REPLY:
            raise _wire.FrameError(f"a request (kind {kind}) on a reply connection")
        self.on_reply(mid, flags, data, bufs)

    def on_reply(self, mid: int, flags: int, data: Any, bufs: list[bytearray]) -> None:
        call = self._pop(mid)
        if call is None:
            return  # timed out already
        try:
            if flags & FLAG_ERROR:
                exc_type, text = _wire.loads(data, bufs)
                self._finish(call.fut, None, rebuild_error(exc_type, text))
            else:
                self._finish(call.fut, _wire.loads(data, bufs), None)
        except Exception as e:  # noqa: BLE001 -- e.g. the reply names a class this worker cannot import
            self._finish(call.fut, None, e)

    def _finish(self, fut: Future[Any], value: Any, error: BaseException | None) -> None:
        """Complete a call's future. Its callbacks may block (torch allows a callback to wait on
        another call), so a future with callbacks completes on a pool thread, never on a
        connection's reader or the timer; a plain wait is woken from here directly, and so are
        the library's own callbacks that never block (marked ``inline``)."""
        callbacks = fut._callbacks
        if callbacks and not self.closed and not all(getattr(cb, "inline", False) for cb in callbacks):
            self._jobs.put(functools.partial(_complete, fut, value, error))
        else:
            fut._try_complete(value, error)

    def _peer_lost(self, conn: _Conn, exc: BaseException) -> None:
        peer = self.by_id.get(conn.peer)
        name = f"worker {peer.name} (id {conn.peer})" if peer else f"worker id {conn.peer}"
        why = "closed the connection" if isinstance(exc, EOFError) else f"broke the connection: {exc}"
        reason = f"{name} {why} (it exited, was killed, or shut down)"
        with self._lock:
            if self._out.get(conn.peer) is conn:
                del self._out[conn.peer]
            if not self.closed:
                self.lost.setdefault(conn.peer, reason)
        conn.close()
        self.fail_pending(lambda c: c.peer == conn.peer, lambda c: PeerLostError(f"RPC {c.what} to {name} failed: {reason}"))

    def fail_pending(self, which: Callable[[_Call], bool], error: Callable[[_Call], BaseException]) -> None:
        for mid, call in list(self._pending.items()):
            if which(call) and self._pop(mid) is not None:
                self._finish(call.fut, None, error(call))

    @property
    def active_server(self) -> int:
        """Calls received and not yet answered."""
        return self._active

    def count_served(self, delta: int) -> None:
        with self._active_lock:
            self._active += delta

    def num_pending(self) -> int:
        return len(self._pending)

    def drain(self, deadline: float | None) -> None:
        """Wait until this worker has no call pending and serves none (or the deadline passes)."""
        while self._pending or self.active_server > 0:
            if deadline is not None and time.monotonic() > deadline:
                raise AgentShutDownError(f"shutdown on {self.info.name}: {len(self._pending)} calls still pending "
                                         f"and {self.active_server} being served after the timeout")
            time.sleep(0.002)

    # ----- serving ------------------------------------------------------------------------

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self.closed:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            self._spawn(serve_conn, "rpc-in", self, sock)

    def dispatch(self, src: int, kind: int, data: Any, bufs: list[bytearray], reply: Reply) -> None:
        """Run the handler of a request of ``kind`` (on a pool thread)."""
        try:
            self.handlers[kind](src, (data, bufs), reply)
        except BaseException as e:  # noqa: BLE001 -- the caller gets it
            reply.fail(e)

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on a pool thread (safe to call from ``__del__``: SimpleQueue.put is reentrant)."""
        self._jobs.put(job)

    def _work_loop(self) -> None:
        jobs = self._jobs
        while True:
            self.idle_threads += 1
            job = jobs.get()
            self.idle_threads -= 1
            if job is None:
                return
            try:
                with self._slots:
                    job()
            except Exception:  # noqa: BLE001
                _log.exception("gpucoll.rpc: a background job failed")
            job = None  # drop the finished call's arguments now: an RRef among them is deleted at once

    # ----- shutdown -----------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving, close every connection, fail what is still pending."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            conns: Iterable[_Conn] = [*self._out.values(), *self._incoming]
            self._out.clear()
        for listener in (self._listener, self._unix_listener):
            if listener is None:
                continue
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()  # an abstract Unix name is gone with its socket: no file to remove
        for c in conns:
            c.close()
        with self.timer.cv:
            self.timer.cv.notify()
        for _ in range(self.num_worker_threads):
            self._jobs.put(None)
        self.fail_pending(lambda c: True, lambda c: AgentShutDownError(
            f"RPC {c.what} to {self.by_id.get(c.peer, c.peer)} failed: RPC was shut down on {self.info.name}"))

    def debug_info(self) -> dict[str, str]:
        return {"agent.thread_pool_size": str(self.num_worker_threads),
                "agent.num_idle_threads": str(self.idle_threads),
                "agent.client_active_calls": str(len(self._pending)),
                "agent.server_active_calls": str(self.active_server),
                "agent.server_active_async_calls": "0",
                "agent.gil_average_wait_time_us": "0",
                "agent.connections": self.transports()}

    def transports(self) -> str:
        """The transport of each connection this worker dialed, as ``"name=unix,name=tcp"``
        (sorted by worker id): same-host peers use ``unix`` unless something failed there."""
        out = dict(self._out)
        return ",".join(f"{self.by_id[p].name if p in self.by_id else p}={_local.family_name(c.sock)}"
                        for p, c in sorted(out.items()))


def _complete(fut: Future[Any], value: Any, error: BaseException | None) -> None:
    fut._try_complete(value, error)

