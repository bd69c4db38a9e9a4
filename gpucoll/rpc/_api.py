"""The RPC API: calls, remote references, the worker's identity and shutdown.

The module holds one slot, the current agent (torch's ``_get_current_rpc_agent``).
"""

from __future__ import annotations

import logging
import threading
import traceback
from types import FunctionType
from typing import Any, Callable

from ..futures import Future, collect_all
from . import _deletes, _devices, _hurry, _wire, constants
from ._agent import Agent, Reply
from ._conn import REMOTE_TRACEBACK
from ._info import (AsyncReturnTypeError, FunctionNotFoundError, IntentionalFailureError, MessageType as M, WorkerInfo,
                    detached)
from ._rref import TIMED_OUT, RRef, RRefContext, set_current_context
from .functions import _is_async, async_execution

__all__ = ["rpc_sync", "rpc_async", "remote", "get_worker_info", "get_rpc_timeout", "_set_rpc_timeout",
           "_get_current_rpc_agent", "_rref_context_get_debug_info", "_get_debug_info", "install", "current", "finalize",
           "_thread_local_var"]

_log = logging.getLogger("gpucoll.rpc")
_agent: list[Agent | None] = [None]
_thread_local_var = threading.local()  # torch's name: ``api._wait_all()`` collects rpc_async futures here


def current() -> Agent:
    agent = _agent[0]
    if agent is None:
        raise RuntimeError("RPC has not been initialized. Call gpucoll.rpc.init_rpc first.")
    return agent


def install(agent: Agent) -> None:
    """Make ``agent`` the current one: its handlers, its RRef context, its pickling hook."""
    if _agent[0] is not None:
        raise RuntimeError("RPC is already initialized")
    ctx = RRefContext(agent)
    agent.rrefs = ctx  # type: ignore[attr-defined]
    agent.handlers[M.PYTHON_CALL] = _on_call
    agent.handlers[M.PYTHON_REMOTE_CALL] = _on_remote_call

    def factory(peer: int | None) -> Callable[[Any], Any]:
        dst = agent.by_id.get(peer) if peer is not None else None
        device_map: dict[str, str] = {}
        if dst is not None:
            theirs = getattr(agent, "peer_maps", {}).get(dst.name, {}).get(agent.info.name, {})
            device_map = agent.device_maps.get(dst.name) or _devices.inverse(theirs)

        def hook(obj: Any) -> Any:
            t = type(obj)
            if t is RRef:
                return ctx.reduce(obj, peer)
            if t is FunctionType:  # (pickled by its name)
                return NotImplemented
            return _devices.reduce(obj, device_map, dst)
        return hook

    agent.pickle_hook_factory = factory
    ctx.proxy_factory = _Proxy
    set_current_context(ctx)
    _agent[0] = agent
    agent.start()


def _get_current_rpc_agent() -> Agent:
    """The current agent (``get_worker_info(name=None)``, ``get_worker_infos()``, ``_get_device_map(to)``)."""
    return current()


# ----- calls --------------------------------------------------------------------------------


class _What:
    """A call's name in its errors (``"PYTHON_CALL module.function"``), written out only
    when one is raised: formatting it costs more than the rest of the request's bookkeeping."""

    __slots__ = ("kind", "func")

    def __init__(self, kind: M, func: Any) -> None:
        self.kind, self.func = kind, func

    def __str__(self) -> str:
        return f"{self.kind.name} {getattr(self.func, '__qualname__', repr(self.func))}"


def _call(to: Any, kind: M, func: Any, args: Any, kwargs: Any, timeout: float, extra: tuple[Any, ...] = (),
          wake: str = "now", into: Any = None) -> tuple[Agent, WorkerInfo, Future[Any]]:
    if not callable(func):
        raise TypeError("function should be callable.")
    agent = current()
    info = agent.worker_info(to)
    fut = _deletes.send(agent.rrefs, info, kind,  # type: ignore[attr-defined]  # (deletions queued for the callee go first)
                        (func, tuple(args) if args else (), dict(kwargs) if kwargs else {}, *extra),
                        timeout, _What(kind, func), wake, into)
    return agent, info, fut


def rpc_async(to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None,
              timeout: float = constants.UNSET_RPC_TIMEOUT) -> Future[Any]:
    """Call ``func(*args, **kwargs)`` on worker ``to``; return a Future of the result.

    Args:
        to: the callee's name, id (rank) or WorkerInfo.
        func: a picklable callable (module-level function, builtin, class).
        args, kwargs: its arguments (NumPy arrays travel out of band, never copied into the pickle).
        timeout: seconds; -1 the default (``get_rpc_timeout()``), 0 none.

    Returns:
        A :class:`gpucoll.futures.Future`. An exception raised by ``func`` fails it with the
        same type, its message starting "On WorkerInfo(id=..., name=...):" and holding the
        remote traceback. A lost callee fails it at once, naming the callee.

    Raises:
        TypeError: ``func`` is not callable. RuntimeError: RPC is not initialized.
        ValueError: an unknown worker. Also whatever pickling the arguments raises.

    Example::

        fut = rpc.rpc_async("worker1", operator.add, args=(np.ones(3), 1))
        print(fut.wait())
    """
    fut = _call(to, M.PYTHON_CALL, func, args, kwargs, timeout)[2]
    collected = getattr(_thread_local_var, "future_list", None)
    if collected is not None:
        collected.append(fut)
    return fut


def rpc_sync(to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None,
             timeout: float = constants.UNSET_RPC_TIMEOUT) -> Any:
    """Call ``func(*args, **kwargs)`` on worker ``to`` and return its result (blocking).

    Same arguments and errors as :func:`rpc_async`; the remote exception is raised here.
    """
    agent, info, fut = _call(to, M.PYTHON_CALL, func, args, kwargs, timeout, wake="caller")
    return agent.wait(fut, info.id)


def remote(to: Any, func: Callable[..., Any], args: Any = None, kwargs: Any = None,
           timeout: float = constants.UNSET_RPC_TIMEOUT) -> RRef[Any]:
    """Run ``func`` on worker ``to`` and return an RRef to the result, owned by ``to``.

    Returns at once; ``rref.to_here()`` waits for the value. If the call times out the
    RRef is marked so, and ``to_here()`` (or sending it) raises.
    """
    if not callable(func):
        raise TypeError("function should be callable.")
    agent = current()
    ctx: RRefContext = agent.rrefs  # type: ignore[attr-defined]
    info = agent.worker_info(to)
    if info.id == agent.info.id:
        rref: RRef[Any] = RRef._new_owner(ctx, ctx.new_id())
        ctx.add_self_as_fork(rref)
        _, _, fut = _call(info, M.PYTHON_REMOTE_CALL, func, args, kwargs, timeout, (rref._rref_id, rref._rref_id))

        def owner_done(f: Future[Any]) -> None:
            _mark_timeout(rref, f)
            ctx.del_fork(rref._rref_id, rref._rref_id)
        owner_done.inline = True  # type: ignore[attr-defined]  # never blocks: run on the reader
        fut.add_done_callback(owner_done)
    else:
        rref_id, fork_id = ctx.new_id(), ctx.new_id()
        rref = ctx.new_user(info, rref_id, fork_id, waited=False)
        fut = _hurry.Asked(agent, info.id)
        fut._callbacks = [_UserDone(rref)]  # (a future nobody else has seen yet: no lock needed)
        try:  # (deletions queued for the owner go first)
            _deletes.send(ctx, info, M.PYTHON_REMOTE_CALL, (func, tuple(args) if args else (),
                          dict(kwargs) if kwargs else {}, rref_id, fork_id), timeout,
                          _What(M.PYTHON_REMOTE_CALL, func), "soon", fut,
                          type(func) is FunctionType and not args and not kwargs)  # (plain: no hook to ask)
        except BaseException:
            fut._callbacks = None
            ctx.confirm_user(fork_id)
            rref._deleted_on_owner = True
            raise
    rref._creation = fut
    return rref


class _UserDone:
    """``remote()``'s creation reply on a user: the RRef is confirmed (or marked timed out)."""

    __slots__ = ("rref",)
    inline = True  # never blocks: run on the reader

    def __init__(self, rref: RRef[Any]) -> None:
        self.rref = rref

    def __call__(self, f: Future[Any]) -> None:
        rref = self.rref
        if f._error is not None:
            _mark_timeout(rref, f)
        rref._ctx.confirm_user(rref._fork_id)  # type: ignore[arg-type]


def _mark_timeout(rref: RRef[Any], f: Future[Any]) -> None:
    # Read the error without raising it: a raise would add this frame (which holds the
    # RRef) to the error's traceback, and the RRef would live as long as its future.
    # torch's RRef::handleError: a timeout or an injected send failure marks the RRef timed out
    if isinstance(f._error, (TimeoutError, IntentionalFailureError)):
        rref._timed_out = True
        if rref.is_owner():
            rref._value._try_complete(None, RuntimeError(TIMED_OUT))


# ----- the callee's side --------------------------------------------------------------------


def _decode_call(payload: Any, then: Callable[[Any], None], reply: Reply) -> None:
    """Unpickle a call; hand it to ``then`` once every RRef among its arguments is confirmed."""
    agent = current()
    ctx: RRefContext = agent.rrefs  # type: ignore[attr-defined]
    pending = ctx.start_recording()
    try:
        call = _wire.loads(*payload)
    except AttributeError as e:  # torch's wording: the function is not importable here
        raise FunctionNotFoundError(f"RPC pickler does not serialize the function code: it is found by name on the callee, "
                             f"and {current().info.name} cannot: {e}. Make sure the function is defined at module "
                             "level in a module the callee imports") from e
    finally:
        ctx.stop_recording()
    if not pending:
        then(call)
        return
    collect_all(pending).add_done_callback(lambda _: agent.submit(lambda: _guarded(then, call, reply)))


def _guarded(fn: Callable[[Any], None], arg: Any, reply: Reply) -> None:
    try:
        fn(arg)
    except BaseException as e:  # noqa: BLE001
        reply.fail(e)


class _Outcome:
    """A function's outcome as ``done`` reads a completed future (``_value``, ``_error``,
    ``value()``), without a future's lock and callbacks: the common synchronous function's."""

    __slots__ = ("_value", "_error")

    def __init__(self, value: Any, error: BaseException | None) -> None:
        self._value, self._error = value, error

    def value(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


def _run(func: Callable[..., Any], args: Any, kwargs: Any, done: Callable[[Any], None]) -> None:
    """Run a user function; ``done`` gets its outcome, as a completed future (async_execution:
    the function's own future, once it completes)."""
    try:
        value = func(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 -- the caller gets it, with this traceback
        e.__traceback__ = e.__traceback__.tb_next if e.__traceback__ is not None else None
        # The traceback goes as text; the frames go now (they hold the call's arguments, RRefs
        # among them, which must be deleted when the call ends, not when the GC finds the cycle
        # the frames make with the outcome).
        try:
            setattr(e, REMOTE_TRACEBACK, "".join(traceback.format_exception(e)))
        except AttributeError:  # an exception without a __dict__: its frames are kept
            pass
        else:
            detached(e)
        done(_Outcome(None, e))
        return
    if _is_async(func):
        if not isinstance(value, Future):
            done(_Outcome(None, AsyncReturnTypeError(
                f"Functions decorated with @rpc.async_function must return a gpucoll.futures.Future object, but got "
                f"{type(value)} from {getattr(func, '__qualname__', func)}")))
            return
        value.add_done_callback(done)
        return
    done(_Outcome(value, None))


def _on_call(src: int, payload: Any, reply: Reply) -> None:
    _decode_call(payload, lambda c: _run(c[0], c[1], c[2], reply.from_future), reply)


def _on_remote_call(src: int, payload: Any, reply: Reply) -> None:
    ctx: RRefContext = current().rrefs  # type: ignore[attr-defined]

    def start(c: Any) -> None:
        func, args, kwargs, rref_id, fork_id = c
        owner = ctx.get_or_create_owner(rref_id)
        if rref_id != fork_id:
            ctx.add_fork(rref_id, fork_id)

        def done(f: Any) -> None:
            # The creation ack is queued first (it is deferred), so that a fetch answered by
            # the value's completion below carries it in the same write; only if none did
            # (no fetch waited) is the connection flushed within 2 * LAZY_WAKE.
            reply.ok(None, soon=False)
            error = f._error
            owner._value._try_complete(f._value if error is None else None, error)
            conn = reply.conn
            if conn is not None and conn.outbox:
                reply.agent.timer.flush_soon(conn)
        _run(func, args, kwargs, done)
    _decode_call(payload, start, reply)


class _Proxy:
    """``rref.rpc_sync()`` / ``rpc_async()`` / ``remote()``: attribute access names the method."""

    def __init__(self, rref: RRef[Any], api: str, timeout: float) -> None:
        self._rref, self._api, self._timeout = rref, api, timeout

    def __getattr__(self, name: str) -> Any:
        fn = {"rpc_sync": rpc_sync, "rpc_async": rpc_async, "remote": remote}[self._api]

        def call(*args: Any, **kwargs: Any) -> Any:
            getattr(self._rref._get_type(self._timeout), name)  # torch's AttributeError, raised here
            return fn(self._rref.owner(), _proxy_invoke, args=(self._rref, name, args, kwargs), timeout=self._timeout)
        return call


@async_execution
def _proxy_invoke(rref: RRef[Any], name: str, args: Any, kwargs: Any) -> Future[Any]:
    """On the owner: call ``name`` on the RRef's value (an async_execution method's future is kept)."""
    method = getattr(rref.local_value(), name)
    if _is_async(method):
        return method(*args, **kwargs)  # type: ignore[no-any-return]
    out: Future[Any] = Future()
    out.set_result(method(*args, **kwargs))
    return out


# ----- identity, timeouts, debug ------------------------------------------------------------


def get_worker_info(worker_name: str | int | None = None) -> WorkerInfo:
    """The WorkerInfo of ``worker_name`` (a name or id), or this worker's if None.

    Raises:
        RuntimeError: RPC is not initialized. ValueError: no such worker.
    """
    return current().worker_info(worker_name)


def get_rpc_timeout() -> float:
    """The default timeout of calls, in seconds."""
    return current().timeout


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """Set the default timeout of calls, in seconds (0: none)."""
    current().timeout = float(rpc_timeout)


def _rref_context_get_debug_info() -> dict[str, str]:
    """num_owner_rrefs, num_pending_futures, num_pending_users, num_forks, as strings (torch's)."""
    return current().rrefs.debug_info()  # type: ignore[attr-defined,no-any-return]


def _get_debug_info() -> dict[str, str]:
    """The RRef counters and the agent's (``agent.*``)."""
    info = _rref_context_get_debug_info()
    info.update(current().debug_info())
    return info


# ----- shutdown -----------------------------------------------------------------------------


def finalize(agent: Agent, ignore_rref_leak: bool = True) -> None:
    """Stop locally: report leaked RRefs (torch's warning; raised unless ``ignore_rref_leak``),
    close the agent, free the slot."""
    ctx: RRefContext = agent.rrefs  # type: ignore[attr-defined]
    try:
        leaks = ctx.leaks()
        if leaks:
            text = "\n".join(leaks)
            _log.warning("Detected RRef Leaks during shutdown. This usually occurs when the application code still "
                         "holds references to RRef instances when calling shutdown(). If the program has completed "
                         "correctly and the process is exiting, it is OK to ignore these leaks. However, if you "
                         "program will keep running after this, these leaks could result in memory leaks on RRef "
                         "owners. Please make sure all RRefs are out of scope and Python GC has deleted them before "
                         "calling shutdown(): \n%s", text)
            if not ignore_rref_leak:
                raise RuntimeError(text)
    finally:
        agent.close()
        set_current_context(None)
        _agent[0] = None
        try:
            agent.store.close()
        except Exception:  # noqa: BLE001 -- the store's server may be gone already
            pass
