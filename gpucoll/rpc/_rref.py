"""Remote references: torch's RRef protocol (docs/source/rpc/rref.rst), one context per agent.

An RRef has one owner, which holds the value, and any number of users, each a fork
named by a fork id. The owner keeps, per RRef id, the set of fork ids it knows
(``forks``) and the RRef itself while any fork is alive (``owners``).

- ``remote()`` to another worker makes a user RRef that is *pending* until the owner's
  REMOTE_RET confirms it; to itself, an owner RRef with a fork of its own id until the
  call completes.
- Sending an RRef forks it. The owner registers the child fork at once (early fork
  registration). A user keeps itself alive as a *pending child* until the child is
  accepted; the child, unless it is the owner or was sent by the owner, is a pending
  user until the owner acknowledges its RREF_FORK_REQUEST, and then sends
  RREF_CHILD_ACCEPT to its parent. An RRef sent to its owner is accepted at once.
- A user RRef's deletion sends RREF_USER_DELETE; the owner drops the fork, and the RRef
  once no fork is left.
- A call runs only after every RRef in its arguments is confirmed.

Control messages (fork request, child accept, user delete) are idempotent on the
receiving side and retried by the sender; user functions are never retried.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from typing import Any, Callable, Generic, TypeVar

from ..futures import Future, collect_all
from . import _deletes, _hurry, _wire
from ._info import MessageType as M, detached
from ._info import WorkerInfo

__all__ = ["RRef", "RRefContext", "current_context", "set_current_context"]

T = TypeVar("T")
_log = logging.getLogger("gpucoll.rpc")
Id = tuple[int, int]
TIMED_OUT = ("RRef creation via rpc.remote() timed out, and it is possible that the RRef on the owner node "
             "does not exist.")
RETRIES, BACKOFF = 8, 0.05

_state = threading.local()
_current: list[RRefContext | None] = [None]


def current_context() -> RRefContext:
    ctx = _current[0]
    if ctx is None:
        raise RuntimeError("RPC has not been initialized. Call gpucoll.rpc.init_rpc first.")
    return ctx


def set_current_context(ctx: RRefContext | None) -> None:
    _current[0] = ctx


class RRef(Generic[T]):
    """A reference to a value owned by one worker (torch.distributed.rpc.RRef).

    ``RRef(value)`` makes a local (owner) RRef; ``gpucoll.rpc.remote`` makes one owned by
    another worker. Pass RRefs as arguments and return values of RPC calls: each
    receiver gets a fork, and the owner keeps the value while any fork is alive.
    """

    _ctx: RRefContext
    _owner: WorkerInfo
    _rref_id: Id
    _fork_id: Id | None
    _value: Future[Any]  # (on the owner; a user's is None)
    _confirmed: bool
    _timed_out: bool
    _deleted_on_owner: bool
    _creation: Future[Any] | None
    _type_fut: Future[Any] | None = None

    def __init__(self, value: Any = None, type_hint: Any = None, *, _user: tuple[WorkerInfo, Id, Id] | None = None) -> None:
        ctx = current_context()
        self._ctx = ctx
        self._timed_out = False
        self._deleted_on_owner = False
        self._creation: Future[Any] | None = None
        if _user is None:
            self._owner = ctx.agent.info
            self._rref_id = ctx.new_id()
            self._fork_id = None
            self._value: Future[Any] = Future()
            self._value.set_result(value)
            self._confirmed = True
        else:
            self._owner, self._rref_id, self._fork_id = _user
            self._value = Future()
            self._confirmed = False

    @classmethod
    def _new_owner(cls, ctx: RRefContext, rref_id: Id) -> RRef[Any]:
        r: RRef[Any] = cls.__new__(cls)
        r._ctx, r._timed_out, r._deleted_on_owner, r._creation = ctx, False, False, None
        r._owner, r._rref_id, r._fork_id, r._value, r._confirmed = ctx.agent.info, rref_id, None, Future(), True
        return r

    def is_owner(self) -> bool:
        """Whether this worker owns the value."""
        return self._fork_id is None

    def owner(self) -> WorkerInfo:
        """The owner's WorkerInfo."""
        return self._owner

    def owner_name(self) -> str:
        """The owner's name."""
        return self._owner.name

    def confirmed_by_owner(self) -> bool:
        """Whether the owner knows of this fork (always True on the owner)."""
        if not self._confirmed and isinstance(self._creation, _hurry.Asked):
            self._creation.ask()  # somebody polls: the owner's confirmation is read as it comes
        return self._confirmed

    def local_value(self) -> T:
        """The value, on the owner.

        Raises:
            RuntimeError: called on a user (not the owner).
        """
        if not self.is_owner():
            me = self._ctx.agent.info
            raise RuntimeError(f"For UserRRef(rref_id={_gid(self._rref_id)}, fork_id={_gid(self._fork_id)}), can't "
                               f"call localValue() on user {me}. Call it on owner {self._owner}")
        return self._value.wait()  # type: ignore[no-any-return]

    def to_here(self, timeout: float = -1.0) -> T:
        """The value, copied from the owner (blocking).

        Args:
            timeout: seconds (-1: the default RPC timeout; 0: none).
        """
        if self._timed_out:
            raise RuntimeError(TIMED_OUT)
        if self.is_owner():
            return self.local_value()
        if self._deleted_on_owner:
            raise RuntimeError(f"User RRef with RRefId={_gid(self._rref_id)} and ForkId={_gid(self._fork_id)} has "
                               "been deleted. Cannot call to_here() on it after deletion.")
        ctx, owner = self._ctx, self._owner
        agent = ctx.agent
        fut = _deletes.send(ctx, owner, M.PYTHON_RREF_FETCH_CALL, (self._rref_id, agent.info.id), timeout,
                            _Fetch(self), "caller", None, True)  # (deletions queued for the owner go first)
        return agent.wait(fut, owner.id)  # type: ignore[no-any-return]

    def _get_type(self, timeout: float = -1.0, blocking: bool = True) -> Any:
        """The type of the value (asked of the owner once, then cached); a Future of it if not ``blocking``."""
        fut: Future[Any]
        if self._type_fut is not None:  # cached: the same future every time, as torch's
            return self._type_fut.wait() if blocking else self._type_fut
        if self.is_owner():
            fut = self._value._chain(lambda f: type(f.value()), wrap=False)
        else:
            agent = self._ctx.agent
            fut = agent.send(self._owner, M.PYTHON_CALL, (_type_on_owner, (self,), {}), timeout, f"_get_type of {self!r}")

        out = fut._chain(lambda f: f.value(), wrap=False)
        self._type_fut = out
        out.add_done_callback(self._forget_failed_type)
        return out.wait() if blocking else out

    def _forget_failed_type(self, fut: Future[Any]) -> None:
        if fut._error is not None and self._type_fut is fut:
            self._type_fut = None  # a failed fetch (a timeout) is asked again next time

    def _serialize(self) -> tuple[Any, ...]:
        """torch's fork data, without forking (raises as forking would for a timed-out creation)."""
        self._check_forkable()
        return (self._owner.id, self._rref_id, self._fork_id)

    def _check_forkable(self) -> None:
        if self._timed_out:
            raise RuntimeError(TIMED_OUT)
        if self._deleted_on_owner:
            raise RuntimeError(f"User RRef with RRefId={_gid(self._rref_id)} and ForkId={_gid(self._fork_id)} has "
                               "been deleted. Cannot call fork an UserRRef after deletion.")

    def _get_future(self) -> Future[Any]:
        """The future of the ``remote()`` call that created this RRef."""
        if self._creation is None:
            done: Future[Any] = Future()
            done.set_result(None)
            return done
        return self._creation

    def rpc_sync(self, timeout: float = -1.0) -> Any:
        """A proxy: ``rref.rpc_sync().method(*args)`` runs ``method`` on the owner's value, blocking."""
        return self._ctx.proxy_factory(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float = -1.0) -> Any:
        """A proxy: ``rref.rpc_async().method(*args)`` returns a Future of the method's result."""
        return self._ctx.proxy_factory(self, "rpc_async", timeout)

    def remote(self, timeout: float = -1.0) -> Any:
        """A proxy: ``rref.remote().method(*args)`` returns an RRef (owned by this RRef's owner) of the result."""
        return self._ctx.proxy_factory(self, "remote", timeout)

    def __reduce__(self) -> Any:
        raise RuntimeError("Can not pickle rref in python pickler, rref can only be pickled when using RPC "
                           "(as an argument or return value of rpc_sync, rpc_async or remote)")

    def __repr__(self) -> str:
        if self.is_owner():
            return f"OwnerRRef({_gid(self._rref_id)})"
        return f"UserRRef(RRefId = {_gid(self._rref_id)}, ForkId = {_gid(self._fork_id)})"

    def __del__(self) -> None:
        fork_id = getattr(self, "_fork_id", None)
        if fork_id is not None and not self._deleted_on_owner:
            try:  # (only queued here, for the next request to the owner: safe on any thread, see delete_user)
                self._ctx.delete_user(self._owner, self._rref_id, fork_id)
            except Exception:  # noqa: BLE001 -- interpreter teardown
                pass


class _Fetch:
    """``to_here()``'s name in its errors, written out only when one is raised (the RRef's
    repr costs microseconds, on every call)."""

    __slots__ = ("rref",)

    def __init__(self, rref: RRef[Any]) -> None:
        self.rref = rref

    def __str__(self) -> str:
        return f"to_here() of {self.rref!r}"


def _gid(i: Id | None) -> str:
    return "None" if i is None else f"GloballyUniqueId(created_on={i[0]}, local_id={i[1]})"


def _type_on_owner(rref: RRef[Any]) -> Any:
    return type(rref.local_value())


def _no_proxy(rref: RRef[Any], api: str, timeout: float) -> Any:
    raise RuntimeError("RPC has not been initialized. Call gpucoll.rpc.init_rpc first.")


def _rref_from_fork(owner: WorkerInfo, rref_id: Id, fork_id: Id, parent: int) -> RRef[Any]:
    return current_context().receive_fork(owner, rref_id, fork_id, parent)


class RRefContext:
    """One agent's RRef bookkeeping: owners, forks, pending users and children."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.me: int = agent.info.id
        self._ids = itertools.count()
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.owners: dict[Id, RRef[Any]] = {}
        self.forks: dict[Id, set[Id]] = {}
        self.pending_owners: dict[Id, Future[RRef[Any]]] = {}
        self.pending_users: dict[Id, RRef[Any]] = {}
        self.pending_user_futs: dict[Id, Future[None]] = {}
        self.pending_children: dict[Id, RRef[Any]] = {}
        # confirmed user RRefs, held weakly (their deletion takes them out)
        self.confirmed_users: dict[Id, weakref.ref[RRef[Any]]] = {}
        self.waiting = 0  # threads waiting on ``changed`` (nobody is notified otherwise)
        self.deletes: dict[int, list[tuple[Id, Id]]] = {}  # per owner: user deletions not sent yet
        self.flushing: set[int] = set()  # owners whose deletions the agent's lazy sweep sends (one Flush each)
        self.proxy_factory: Callable[[RRef[Any], str, float], Any] = _no_proxy
        for kind, fn in ((M.PYTHON_RREF_FETCH_CALL, self._on_fetch), (M.RREF_USER_DELETE, self._on_user_delete),
                         (M.RREF_FORK_REQUEST, self._on_fork_request), (M.RREF_CHILD_ACCEPT, self._on_child_accept),
                         (M.REPLY_NOW, _hurry.on_reply_now)):
            agent.handlers[kind] = fn
        agent.inline_kinds = frozenset({M.PYTHON_RREF_FETCH_CALL, M.RREF_USER_DELETE, M.RREF_FORK_REQUEST,
                                        M.RREF_CHILD_ACCEPT, M.REPLY_NOW})

    def new_id(self) -> Id:
        return (self.me, next(self._ids))

    def debug_info(self) -> dict[str, str]:
        with self.lock:
            return {"num_owner_rrefs": str(len(self.owners)), "num_pending_futures": str(len(self.pending_owners)),
                    "num_pending_users": str(len(self.pending_users)),
                    "num_forks": str(sum(len(s) for s in self.forks.values()))}

    # ----- owners ---------------------------------------------------------------------------

    def get_or_create_owner(self, rref_id: Id) -> RRef[Any]:
        with self.lock:
            rref = self.owners.get(rref_id)
            if rref is None:
                rref = RRef._new_owner(self, rref_id)
                self.owners[rref_id] = rref
            waiting = self.pending_owners.pop(rref_id, None)
            if self.waiting:
                self.changed.notify_all()
        if waiting is not None:
            waiting._try_complete(rref, None)
        return rref

    def owner_future(self, rref_id: Id) -> Future[RRef[Any]]:
        """The owner RRef, now or once the remote call that creates it arrives."""
        with self.lock:
            rref = self.owners.get(rref_id)
            if rref is None:
                fut = self.pending_owners.get(rref_id)
                if fut is None:
                    fut = self.pending_owners[rref_id] = Future()
                return fut
        done: Future[RRef[Any]] = Future()
        done.set_result(rref)
        return done

    def add_fork(self, rref_id: Id, fork_id: Id) -> None:
        with self.lock:
            self.forks.setdefault(rref_id, set()).add(fork_id)

    def del_fork(self, rref_id: Id, fork_id: Id) -> None:
        with self.lock:
            forks = self.forks.get(rref_id)
            if forks is None:
                return
            forks.discard(fork_id)
            if not forks:
                del self.forks[rref_id]
                self.owners.pop(rref_id, None)
            if self.waiting:
                self.changed.notify_all()

    def add_self_as_fork(self, rref: RRef[Any]) -> None:
        with self.lock:
            self.owners[rref._rref_id] = rref
            self.forks.setdefault(rref._rref_id, set()).add(rref._rref_id)

    # ----- users ----------------------------------------------------------------------------

    def new_user(self, owner: WorkerInfo, rref_id: Id, fork_id: Id, waited: bool = True) -> RRef[Any]:
        """A pending user RRef; ``waited``: with a future of its confirmation
        (``pending_user_futs``: a call that has it among its arguments waits for it)."""
        rref: RRef[Any] = RRef.__new__(RRef)
        rref._ctx, rref._timed_out, rref._deleted_on_owner, rref._creation = self, False, False, None
        rref._owner, rref._rref_id, rref._fork_id, rref._confirmed = owner, rref_id, fork_id, False
        rref._value = None  # type: ignore[assignment]  # (a user's value is fetched: to_here())
        with self.lock:
            self.pending_users[fork_id] = rref
            if waited:
                self.pending_user_futs[fork_id] = Future()
        return rref

    def confirm_user(self, fork_id: Id) -> None:
        with self.lock:
            rref = self.pending_users.pop(fork_id, None)
            fut = self.pending_user_futs.pop(fork_id, None) if self.pending_user_futs else None
            if rref is not None:
                rref._confirmed = True
                self.confirmed_users[fork_id] = weakref.ref(rref)
            if self.waiting:
                self.changed.notify_all()
        if fut is not None:
            fut._try_complete(None, None)

    def delete_user(self, owner: WorkerInfo, rref_id: Id, fork_id: Id) -> None:
        """A user RRef was deleted: queue its RREF_USER_DELETE for the owner (see :mod:`._deletes`).

        Called by the RRef's finalizer, on whichever thread the garbage collector runs it,
        possibly inside any of the library's own code: it takes no lock but the context's
        (reentrant) and, without blocking, the timer's (:meth:`gpucoll.rpc._timer.Timer.flush_soon`)."""
        with self.lock:
            self.confirmed_users.pop(fork_id, None)
            if self.agent.closed:
                return
            batch = self.deletes.get(owner.id)
            if batch is None:
                batch = self.deletes[owner.id] = []
            batch.append((rref_id, fork_id))
            flush = owner.id not in self.flushing
            if flush:
                self.flushing.add(owner.id)
        if flush:  # sent with the next request to the owner, or on its own within 2 * LAZY_WAKE
            self.agent.timer.flush_soon(_deletes.Flush(self, owner), False)

    # ----- forking: pickling and unpickling an RRef -----------------------------------------

    def reduce(self, rref: RRef[Any], dst: int | None) -> Any:
        """Pickle ``rref`` for worker ``dst``: register the child fork, as the sender's role requires."""
        rref._check_forkable()
        fork_id = self.new_id()
        with self.lock:
            if rref.is_owner():
                self.forks.setdefault(rref._rref_id, set()).add(fork_id)
                self.owners[rref._rref_id] = rref
            else:
                self.pending_children[fork_id] = rref
        return (_rref_from_fork, (rref._owner, rref._rref_id, fork_id, self.me))

    def receive_fork(self, owner: WorkerInfo, rref_id: Id, fork_id: Id, parent: int) -> RRef[Any]:
        if owner.id == self.me:
            rref = self.get_or_create_owner(rref_id)
            if parent == self.me:
                self.del_fork(rref_id, fork_id)  # sent to ourselves: the early-registered fork is no one
            else:
                self.send_with_retries(self.agent.worker_info(parent), M.RREF_CHILD_ACCEPT, fork_id)
            return rref
        if parent == owner.id:
            user: RRef[Any] = RRef(_user=(owner, rref_id, fork_id))
            user._confirmed = True
            with self.lock:
                self.confirmed_users[fork_id] = weakref.ref(user)
            return user
        user = self.new_user(owner, rref_id, fork_id)
        recording = getattr(_state, "pending", None)
        if recording is not None:
            recording.append(self.pending_user_futs[fork_id])
        parent_info = self.agent.worker_info(parent)

        def accepted(fut: Future[Any]) -> None:
            self.confirm_user(fork_id)
            self.send_with_retries(parent_info, M.RREF_CHILD_ACCEPT, fork_id)
        # Among a call's arguments (recording): the call runs only once the owner has
        # confirmed the fork, so its answer is asked for at once (REPLY_NOW). Else (a
        # returned RRef) the request shares the connection's next write, as other control messages.
        self.send_with_retries(owner, M.RREF_FORK_REQUEST, (rref_id, fork_id), recording is not None
                               ).add_done_callback(accepted)
        return user

    def start_recording(self) -> list[Future[Any]]:
        _state.pending = []
        return _state.pending  # type: ignore[no-any-return]

    def stop_recording(self) -> None:
        _state.pending = None

    # ----- control messages -----------------------------------------------------------------

    def send_with_retries(self, to: WorkerInfo, kind: M, obj: Any, urgent: bool = False) -> Future[Any]:
        """Send an idempotent control message until it is acknowledged, with backoff. It
        may wait to share the connection's next write, and so may its acknowledgement,
        unless ``urgent`` (somebody waits for it: both go at once, see :mod:`._hurry`)."""
        out: Future[Any] = Future()

        def attempt(n: int) -> None:
            try:
                asked = _hurry.Asked(self.agent, to.id) if urgent else None
                fut = self.agent.send(to, kind, obj, 0, kind.name, wake="soon", into=asked)  # acks only run our callbacks
                if asked is not None:
                    asked.ask()  # its REPLY_NOW frame writes the request too, in one sendmsg
            except Exception as e:  # noqa: BLE001
                out._try_complete(None, detached(e))
                return

            def done(f: Future[Any]) -> None:
                # The error is read, never raised: raised here, it would take this frame and
                # its callers (receive_fork's new user RRef, a call's arguments) into its
                # traceback, in a cycle with ``f``, and those RRefs would outlive their calls.
                e = f._error
                if e is None:
                    out._try_complete(f._value, None)
                    return
                if n + 1 >= RETRIES or self.agent.closed or to.id in self.agent.lost:
                    _log.warning("gpucoll.rpc: %s to %s failed: %s", kind.name, to, e)
                    out._try_complete(None, e)
                    return
                t = threading.Timer(BACKOFF * 1.5 ** n, attempt, (n + 1,))
                t.daemon = True
                t.start()
            done.inline = True  # type: ignore[attr-defined]  # never blocks: completes on the reader
            fut.add_done_callback(done)

        attempt(0)
        return out

    def _on_fetch(self, src: int, payload: Any, reply: Any) -> None:
        rref_id, _ = _wire.loads(*payload)
        owner = self.owners.get(rref_id)  # (a dict look-up is atomic; owners are only ever added under the lock)
        if owner is not None:
            owner._value.add_done_callback(reply.from_future)
            return
        self.owner_future(rref_id).add_done_callback(
            lambda f: f.value()._value.add_done_callback(reply.from_future))

    def _on_user_delete(self, src: int, payload: Any, reply: Any) -> None:
        # A list of (rref id, fork id): a batch (_deletes), answered only when sent on its own
        for rref_id, fork_id in _wire.loads(*payload):
            self.del_fork(rref_id, fork_id)
        reply.ok(None)

    def _on_fork_request(self, src: int, payload: Any, reply: Any) -> None:
        rref_id, fork_id = _wire.loads(*payload)

        def created(_: Future[Any]) -> None:
            self.add_fork(rref_id, fork_id)
            reply.ok(None)
        self.owner_future(rref_id).add_done_callback(created)

    def _on_child_accept(self, src: int, payload: Any, reply: Any) -> None:
        fork_id = _wire.loads(*payload)
        with self.lock:
            self.pending_children.pop(fork_id, None)
            if self.waiting:
                self.changed.notify_all()
        reply.ok(None)

    # ----- shutdown -------------------------------------------------------------------------

    def delete_all_users(self, timeout: float) -> None:
        """torch's ``_delete_all_user_and_unforked_owner_rrefs``: wait for pending users and
        children, delete every user RRef, then wait for our owners to lose their forks."""
        deadline = time.monotonic() + timeout
        with self.lock:
            self.waiting += 1
            try:
                if not self.changed.wait_for(lambda: not self.pending_users and not self.pending_children,
                                             max(deadline - time.monotonic(), 0)):
                    _log.error("Timed out waiting for pending UserRRefs to be confirmed by owner and parent.")
            finally:
                self.waiting -= 1
            users = [(f, r) for f, r in ((f, ref()) for f, ref in self.confirmed_users.items()) if r is not None]
            self.confirmed_users = {}
        sent = _deletes.send_all(self)  # deletions still queued go first
        for fork_id, rref in users:
            if not rref._deleted_on_owner:
                rref._deleted_on_owner = True
                sent.append(self.send_with_retries(rref._owner, M.RREF_USER_DELETE, [(rref._rref_id, fork_id)]))
        collect_all(sent)._block(max(deadline - time.monotonic(), 0))
        with self.lock:
            for rref_id in [r for r in self.owners if r not in self.forks]:
                del self.owners[rref_id]
            self.waiting += 1
            try:
                self.changed.wait_for(lambda: not self.owners and not self.pending_owners,
                                      max(deadline - time.monotonic(), 0))
            finally:
                self.waiting -= 1

    def leaks(self) -> list[str]:
        with self.lock:
            return [f"Leaking RRef {r} with fork Id {f}" for r, fs in self.forks.items() for f in fs]
