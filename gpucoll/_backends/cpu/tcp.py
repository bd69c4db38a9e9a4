"""The CPU backend's TCP mesh: one connection per pair of ranks, tagged messages.

Every rank listens on port 0 of its advertised address (loopback for a one-host
job) and publishes ``host identity|address|port`` in the group's store; rank r
connects to every lower rank's published address and accepts the higher ones. Every
connection is authenticated by a mutual handshake (:mod:`.auth`) before it counts;
the listener runs the handshakes of several incoming connections at once and drops
one that does not finish within ``HANDSHAKE_S``. After that the mesh is used for:

- collective traffic between hosts (and on one host when shared memory is off),
- point-to-point send/recv (any source included),
- liveness: a connection that closes without a goodbye frame marks the whole mesh
  broken, which fails every pending and later op naming the dead peer. A rank that
  leaves after an error says why in its goodbye, so its peers' errors name the cause.

One reader thread per peer reads frames as they come. A frame whose receive was
already posted is read straight into the destination memory; an unexpected frame is
buffered until its receive is posted. So a sender never waits for the receiving
rank's program to reach its receive, and collectives, sends and receives cannot
deadlock one another through the sockets.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ..._timeouts import Backoff
from ..._env import CPU_IFADDR_ENV
from ...errors import DistBackendError, DistNetworkError
from . import auth
from .. import deaths
from ..mismatch import SignatureMismatch

__all__ = ["TcpMesh", "Recv", "KIND_COLL", "KIND_P2P", "local_address"]

KIND_COLL = 0
KIND_P2P = 1
_KIND_BYE = 2
_HDR = struct.Struct("<B7xqQQ")  # kind, tag, nbytes, meta
_POLL = 0.5  # seconds between checks of the closed flag in blocking socket calls
_FINISH_LOCK = threading.Lock()
HANDSHAKE_S = 5.0
"""Seconds an incoming connection has to authenticate before it is dropped."""


@dataclass(eq=False)
class Recv:
    """A posted receive: completes when a matching frame has been read into ``buf``."""

    src: int | None
    kind: int
    tag: int
    buf: memoryview | None  # None: take any size into a fresh bytearray (``data``)
    meta: int | None = None  # expected sender meta (collectives); None: not checked
    order: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    source: int = -1
    data: bytearray | None = None
    on_done: Callable[[Recv], None] | None = None

    def complete(self) -> None:
        """Mark the receive finished (``error`` set or data in place) and run ``on_done``."""
        self.finish(self.error)

    def finish(self, error: BaseException | None) -> None:
        """Complete once: the first call (data in place, or an abort's error) wins."""
        with _FINISH_LOCK:
            if self.done.is_set():
                return
            self.error = error
            self.done.set()
        if self.on_done is not None:
            self.on_done(self)

    def wait(self, deadline: float, what: Callable[[], str], abort_check: Callable[[], None]) -> None:
        """Block until the frame arrived; raise on failure or past ``deadline`` (monotonic)."""
        while not self.done.wait(min(_POLL, max(0.0, deadline - time.monotonic()))):
            abort_check()
            if time.monotonic() >= deadline:
                peer = "any rank" if self.src is None else f"rank {self.src}"
                raise DistBackendError(f"{what()}: timed out waiting for data from {peer}")
        if self.error is not None:
            raise self.error


def local_address(peer_hint: str | None) -> str:
    """The local IP address that routes to ``peer_hint`` (the store's host), or loopback.

    A UDP ``connect`` sends nothing; it only asks the kernel which source address it
    would use, so no name resolution or traffic is involved.
    """
    override = os.environ.get(CPU_IFADDR_ENV)
    if override:
        return override
    if not peer_hint or peer_hint in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer_hint, 9))
            addr: str = s.getsockname()[0]
            return addr
    except OSError:
        return "127.0.0.1"


class TcpMesh:
    """Connections to every peer of one group, with tag matching.

    Args:
        store: the group's private store (set/get of bytes).
        rank, size: this rank and the group size.
        timeout: seconds for connecting and for each blocking socket operation.
        host_id: identifies this machine (published; the backend uses it to decide shared memory).
        advertise: address to listen on and publish.
        on_broken: called once (from a reader thread) when a peer dies or the mesh breaks.
    """

    def __init__(self, store: Any, rank: int, size: int, *, timeout: float, host_id: str,
                 advertise: str, on_broken: Callable[[BaseException], None]) -> None:
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self._on_broken = on_broken
        self._store = store
        self._made = time.time()  # death records older than this mesh are not about its peers
        self._lock = threading.Lock()
        self._arrived: dict[tuple[int, int, int], deque[Recv]] = {}
        self._posted: dict[tuple[int, int, int], deque[Recv]] = {}
        self._posted_any: dict[int, deque[Recv]] = {}
        self._order = itertools.count()
        self._socks: dict[int, socket.socket] = {}
        self._send_locks = {p: threading.Lock() for p in range(size) if p != rank}
        self._gone: dict[int, str] = {}  # peer -> why it is no longer reachable
        self._dead: set[int] = set()  # peers whose connection broke without a goodbye
        # Receives taken off the posted lists whose payload a reader is reading now:
        # the abort and peer-death paths fail these too.
        self._inflight: dict[int, Recv] = {}
        self._sending: dict[int, int] = {}  # peer -> bytes of the frame being sent to it now
        self.broken: BaseException | None = None
        self._closed = False
        self._closing = False
        self._goodbyes_sent = threading.Event()
        """Set once close() has said goodbye to every peer (a second close() waits for it)."""
        self._threads: list[threading.Thread] = []
        if size > 1:
            self._connect(store, host_id, advertise)

    # ----- setup -----
    def _connect(self, store: Any, host_id: str, advertise: str) -> None:
        key, secret = auth.group_key(store)
        # Listen on the advertised address only: loopback for a one-host job (store on
        # loopback), the interface that routes to the store otherwise. Never 0.0.0.0.
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((advertise, 0))
            listener.listen(128)  # strangers may queue up too: they must not crowd out peers
            port = listener.getsockname()[1]
            store.set(f"tcp/{self.rank}", f"{host_id}|{advertise}|{port}".encode())
            deadline = time.monotonic() + self.timeout
            for peer in range(self.rank):
                _, addr, peer_port = store.get(f"tcp/{peer}").decode().split("|")
                # The published address, also on this host: "same hostname" is not "same host".
                self._socks[peer] = self._dial(peer, addr, int(peer_port), key, secret, deadline)
            self._accept(listener, key, secret, deadline)
        finally:
            listener.close()
        for peer, s in self._socks.items():
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(_POLL)
            t = threading.Thread(target=self._reader, args=(peer, s), daemon=True,
                                 name=f"gpucoll-cpu-r{self.rank}-from{peer}")
            t.start()
            self._threads.append(t)

    def _accept(self, listener: socket.socket, key: bytes, secret: bool, deadline: float) -> None:
        """Accept and authenticate the higher ranks, several handshakes at once.

        A connection that does not complete its handshake within ``HANDSHAKE_S`` (idle,
        slow or a stranger's) is dropped; it never holds up the others.
        """
        listener.setblocking(False)
        pending: dict[socket.socket, auth.ListenerHandshake] = {}
        rejected: list[str] = []
        try:
            while len(self._socks) < self.size - 1:
                now = time.monotonic()
                if now >= deadline:
                    missing = sorted(set(range(self.size)) - set(self._socks) - {self.rank})
                    extra = f"; rejected connections: {'; '.join(rejected[-3:])}" if rejected else ""
                    raise DistNetworkError(f"CPU backend rank {self.rank}: ranks {missing} did not connect "
                                           f"within {self.timeout:.3g} s{extra}")
                for conn, hs in list(pending.items()):
                    if now >= hs.deadline:
                        del pending[conn]
                        conn.close()
                wait = min([deadline - now, *[hs.deadline - now for hs in pending.values()]])
                ready, _, _ = select.select([listener, *pending], [], [], max(0.0, wait))
                for s in ready:
                    if s is listener:
                        try:
                            conn, _ = listener.accept()
                        except (BlockingIOError, InterruptedError):
                            continue
                        conn.setblocking(False)
                        pending[conn] = auth.ListenerHandshake(time.monotonic() + min(HANDSHAKE_S, self.timeout))
                        continue
                    hs = pending[s]
                    try:
                        peer = hs.step(s, self.rank, self.size, self._socks, key, secret)
                    except (OSError, EOFError, auth.HandshakeError, struct.error) as exc:
                        rejected.append(str(exc))
                        del pending[s]
                        s.close()
                        continue
                    if peer is not None:
                        del pending[s]
                        s.setblocking(True)
                        self._socks[peer] = s
        finally:
            for conn in pending:
                conn.close()

    def _dial(self, peer: int, host: str, port: int, key: bytes, secret: bool, deadline: float) -> socket.socket:
        wait = Backoff(deadline - time.monotonic(), first=0.01, cap=0.5)
        while True:
            s: socket.socket | None = None
            try:
                s = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
                s.settimeout(max(0.1, min(HANDSHAKE_S, deadline - time.monotonic())))
                auth.check_local_owner(s, peer, strict=not secret)
                hello, nonce = auth.make_hello(self.rank, peer)
                s.sendall(hello)
                proof = auth.check_reply(key, self.rank, peer, nonce, auth.recv_exact(s, auth.REPLY.size))
                s.sendall(proof)
                if auth.recv_exact(s, 1) != auth.OK:
                    raise auth.HandshakeError(f"rank {peer} refused the handshake")
                return s
            except (OSError, EOFError, auth.HandshakeError) as exc:
                if s is not None:
                    s.close()
                if isinstance(exc, auth.HandshakeError) or not wait.sleep():
                    raise DistNetworkError(f"CPU backend rank {self.rank} could not connect to rank {peer} "
                                           f"at {host}:{port}: {exc}") from exc

    # ----- receiving -----
    def _reader(self, peer: int, s: socket.socket) -> None:
        hdr = bytearray(_HDR.size)
        why: str | None = None
        err: BaseException | None = None
        try:
            while True:
                if not self._read_into(s, memoryview(hdr), idle_ok=True):
                    why = "closed its connection without shutting down (process died?)" + self._obituary()
                    break
                kind, tag, nbytes, meta = _HDR.unpack(hdr)
                if kind == _KIND_BYE:
                    note = bytearray(nbytes)
                    self._read_exact(s, memoryview(note))
                    why = "shut down its CPU backend" + (f" after an error ({note.decode(errors='replace')})"
                                                         if nbytes else "")
                    self._peer_gone(peer, why, fatal=False)
                    return
                self._deliver(peer, s, kind, tag, nbytes, meta)
        except (OSError, EOFError) as exc:
            why, err = f"connection failed: {exc}" + self._obituary(), exc
        except DistBackendError as exc:
            why, err = str(exc), exc
        if not self._closed:
            self._peer_gone(peer, why or "connection lost", fatal=True, cause=err)

    def _obituary(self) -> str:
        """What the job's launcher recorded about the death that broke a connection (if
        it records deaths: ``deaths.enabled()``), waited for at most ``deaths.WAIT_S``."""
        if self._closed or not deaths.enabled():
            return ""
        found = deaths.await_since(self._store, self._made)
        if not found:
            return f"; the job's launcher recorded no death within {deaths.WAIT_S:g} s"
        return "; the job's launcher recorded: " + "; ".join(deaths.describe(r) for r in found)

    def _deliver(self, peer: int, s: socket.socket, kind: int, tag: int, nbytes: int, meta: int) -> None:
        key = (peer, kind, tag)
        with self._lock:
            r = self._match_posted(key, tag if kind == KIND_P2P else None)
            if r is not None:
                self._inflight[peer] = r
        if r is None:
            data = bytearray(nbytes)
            self._read_exact(s, memoryview(data))
            msg = Recv(peer, kind, tag, None, meta, next(self._order), data=data)
            msg.source = peer
            with self._lock:
                r = self._match_posted(key, tag if kind == KIND_P2P else None)
                if r is None:
                    self._arrived.setdefault(key, deque()).append(msg)
                    return
            _fill(r, msg, peer)
            return
        error: BaseException | None = None
        # If reading fails, r stays in _inflight: the peer-death path fails it there.
        if r.buf is not None and r.buf.nbytes != nbytes or (r.meta is not None and r.meta != meta):
            self._read_exact(s, memoryview(bytearray(nbytes)))  # drain it, keep the stream in sync
            error = _mismatch(peer, r, nbytes, meta)
        elif r.buf is None:
            data = bytearray(nbytes)
            self._read_exact(s, memoryview(data))
            r.data = data
        else:
            self._read_exact(s, r.buf)
        self._inflight.pop(peer, None)
        r.source = peer
        r.finish(error)

    def _match_posted(self, key: tuple[int, int, int], any_tag: int | None) -> Recv | None:
        q = self._posted.get(key)
        qa = self._posted_any.get(any_tag) if any_tag is not None else None
        if q and qa:
            q = q if q[0].order < qa[0].order else qa
        elif not q:
            q = qa
        if not q:
            return None
        return q.popleft()

    def post(self, r: Recv) -> Recv:
        """Post a receive; it completes (``r.done``) once a matching frame arrived."""
        r.order = next(self._order)
        with self._lock:
            if self.broken is not None:
                r.error = self.broken
                r.complete()
                return r
            msg = self._take_arrived(r)
            if msg is None:
                if r.src is not None and r.src in self._gone:
                    r.error = DistBackendError(f"rank {r.src} {self._gone[r.src]}")
                    r.complete()
                    return r
                if r.src is None:
                    self._posted_any.setdefault(r.tag, deque()).append(r)
                else:
                    self._posted.setdefault((r.src, r.kind, r.tag), deque()).append(r)
                return r
        _fill(r, msg, msg.source)
        return r

    def _take_arrived(self, r: Recv) -> Recv | None:
        if r.src is not None:
            q = self._arrived.get((r.src, r.kind, r.tag))
            return q.popleft() if q else None
        best: deque[Recv] | None = None
        for (src, kind, tag), q in self._arrived.items():
            if kind == r.kind and tag == r.tag and q and (best is None or q[0].order < best[0].order):
                best = q
        return best.popleft() if best else None

    def cancel(self, r: Recv) -> None:
        """Withdraw a posted receive that will not be waited for (after an error)."""
        with self._lock:
            q = self._posted_any.get(r.tag) if r.src is None else self._posted.get((r.src, r.kind, r.tag))
            if q is not None and r in q:
                q.remove(r)

    def gone(self, peer: int) -> str | None:
        """Why ``peer`` can no longer be reached, or None while it is connected."""
        return self._gone.get(peer)

    def dead(self, peer: int) -> str | None:
        """Why ``peer``'s connection broke without a goodbye (it died), or None."""
        return self._gone.get(peer) if peer in self._dead else None

    # ----- sending -----
    def send(self, dst: int, kind: int, tag: int, payload: memoryview, meta: int = 0,
             deadline: float | None = None) -> None:
        """Send one frame to ``dst`` (returns once the kernel has it all).

        Raises:
            DistBackendError: the mesh is broken, ``dst`` is gone, or the send timed out.
        """
        if self.broken is not None:
            raise self.broken
        if dst in self._gone:
            raise DistBackendError(f"rank {dst} {self._gone[dst]}")
        s = self._socks[dst]
        hdr = _HDR.pack(kind, tag, payload.nbytes, meta)
        limit = deadline if deadline is not None else time.monotonic() + self.timeout
        with self._send_locks[dst]:
            self._sending[dst] = payload.nbytes
            try:
                if payload.nbytes <= 16384:
                    self._send_all(s, memoryview(hdr + payload), dst, limit)
                else:
                    self._send_all(s, memoryview(hdr), dst, limit)
                    self._send_all(s, payload, dst, limit)
            except OSError as exc:
                raise self._send_failed(dst, payload.nbytes, exc) from exc
            finally:
                self._sending.pop(dst, None)

    def _send_failed(self, dst: int, nbytes: int, exc: OSError) -> DistBackendError:
        """The error for a send that the peer's end broke: why the peer left, once known.

        A peer that aborts says why in a goodbye frame before it closes; the reader of
        that connection records it within moments of the broken pipe.
        """
        limit = time.monotonic() + 1.0
        while dst not in self._gone and self.broken is None and time.monotonic() < limit:
            time.sleep(0.01)
        why = self._gone.get(dst)
        if why is not None:
            return DistBackendError(f"sending {nbytes} bytes to rank {dst} failed: rank {dst} {why}")
        if self.broken is not None:
            return DistBackendError(f"sending {nbytes} bytes to rank {dst} failed: {self.broken}")
        return DistBackendError(f"sending {nbytes} bytes to rank {dst} failed: {exc}")

    def stalled(self) -> list[str]:
        """What this rank is waiting for now: peers whose data or reading it waits on."""
        with self._lock:
            out = [f"data from rank {src}" for (src, _, _), q in self._posted.items() if q]
            if any(self._posted_any.values()):
                out.append("data from any rank")
        out += [f"rank {p} to read {n} bytes" for p, n in list(self._sending.items())]
        out += [f"the rest of a frame from rank {p}" for p in list(self._inflight)]
        return out

    def _send_all(self, s: socket.socket, data: memoryview, dst: int, deadline: float) -> None:
        while data.nbytes:
            try:
                n = s.send(data)
            except socket.timeout:
                n = 0
            data = data[n:]
            if data.nbytes and n == 0:
                if self.broken is not None:
                    raise self.broken
                if dst in self._gone:
                    raise DistBackendError(f"sending to rank {dst} failed: rank {dst} {self._gone[dst]}")
                if self._closed:
                    raise DistBackendError("the CPU backend was shut down")
                if time.monotonic() >= deadline:
                    raise DistBackendError(f"sending to rank {dst} timed out after {self.timeout:.3g} s "
                                           "(the peer stopped reading)")

    # ----- socket helpers -----
    def _read_into(self, s: socket.socket, view: memoryview, *, idle_ok: bool) -> bool:
        """Fill ``view``; False on a clean EOF before the first byte."""
        got = 0
        while got < view.nbytes:
            try:
                n = s.recv_into(view[got:])
            except socket.timeout:
                if self._closed:
                    raise EOFError("closed") from None
                continue
            if n == 0:
                if got == 0 and idle_ok:
                    return False
                raise EOFError("connection closed in the middle of a frame")
            got += n
        return True

    def _read_exact(self, s: socket.socket, view: memoryview) -> None:
        self._read_into(s, view, idle_ok=False)

    # ----- failure and shutdown -----
    def _peer_gone(self, peer: int, why: str, *, fatal: bool, cause: BaseException | None = None) -> None:
        err = DistBackendError(f"CPU backend: rank {peer} {why}")
        if cause is not None:
            err.__cause__ = cause
        with self._lock:
            self._gone[peer] = why
            if fatal:
                self._dead.add(peer)
            if fatal and self.broken is None:
                self.broken = err
            failed = [r for (src, _, _), q in self._posted.items() if src == peer or fatal for r in q]
            for key in [k for k in self._posted if k[0] == peer or fatal]:
                del self._posted[key]
            if fatal:
                failed += [r for q in self._posted_any.values() for r in q]
                self._posted_any.clear()
            failed += [r for p, r in list(self._inflight.items()) if p == peer or fatal]
        for r in failed:
            r.finish(err)
        if fatal:
            self._on_broken(err)

    def fail_all(self, err: BaseException) -> None:
        """Fail every posted receive and every later op with ``err`` (abort)."""
        with self._lock:
            if self.broken is None:
                self.broken = err
            failed = [r for q in itertools.chain(self._posted.values(), self._posted_any.values()) for r in q]
            failed += list(self._inflight.values())
            self._posted.clear()
            self._posted_any.clear()
        for r in failed:
            r.finish(err)

    def close(self, reason: str = "") -> None:
        """Say goodbye to every peer and close the connections.

        Args:
            reason: why this rank leaves after an error (peers put it in their errors);
                empty for a clean shutdown.
        """
        with self._lock:
            closing = self._closing
            self._closing = True
        if closing:
            # Another thread (an abort's) is closing: wait, within bounds, until the peers
            # have its goodbye, so that leaving right after this call does not turn the
            # reason it carries into "closed without shutting down".
            self._goodbyes_sent.wait(1.0 + _POLL)
            return
        note = reason.encode()[:4000]
        bye = _HDR.pack(_KIND_BYE, 0, len(note), 0) + note
        for peer, s in self._socks.items():
            # A peer that said goodbye first is alive and still reading until it closes:
            # it gets ours too, or it takes our closing for a death (monitored_barrier
            # asks which peers died). Only a dead peer is skipped.
            if peer in self._dead:
                continue
            try:
                with self._send_locks[peer]:
                    self._send_all(s, memoryview(bye), peer, time.monotonic() + 1.0)
            except (OSError, DistBackendError):
                pass
        self._goodbyes_sent.set()
        self._closed = True
        for s in self._socks.values():
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(2 * _POLL)


def _fill(r: Recv, msg: Recv, peer: int) -> None:
    data = msg.data or bytearray()
    if r.meta is not None and msg.meta is not None and r.meta != msg.meta:
        r.error = _mismatch(peer, r, len(data), msg.meta)
    elif r.buf is None:
        r.data = data
    elif r.buf.nbytes != len(data):
        r.error = _mismatch(peer, r, len(data), msg.meta)
    else:
        r.buf[:] = data
    r.source = peer
    r.complete()


def _mismatch(peer: int, r: Recv, nbytes: int, meta: int | None) -> DistBackendError:
    if r.meta is not None and meta is not None and r.meta != meta:
        return SignatureMismatch(
            f"rank {peer} issued a different collective (signature {meta:#x}, this rank {r.meta:#x}): "
            "ops, dtypes, sizes or roots differ across ranks", peer, meta, r.meta)
    want = r.buf.nbytes if r.buf is not None else -1
    what = "message" if r.kind == KIND_P2P else "collective chunk"
    return DistBackendError(f"rank {peer} sent a {what} of {nbytes} bytes (tag {r.tag}) where this rank "
                            f"expected {want} bytes: sizes or dtypes differ across ranks")
