"""Futures: torch.futures' names and behaviour, without torch.

A :class:`Future` is completed once, with a value (:meth:`Future.set_result`) or an
exception (:meth:`Future.set_exception`). Callbacks added with :meth:`Future.then` or
:meth:`Future.add_done_callback` run on the thread that completes the future, right
when it completes (or at once, on the adding thread, if it already has) -- never on
whichever thread happens to wait. ``gpucoll.rpc`` returns these from ``rpc_async``.

Example::

    from gpucoll.futures import Future, collect_all

    fut = Future()
    doubled = fut.then(lambda f: f.value() * 2)
    fut.set_result(21)
    assert doubled.wait() == 42
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Generic, Sequence, TypeVar

__all__ = ["Future", "collect_all", "wait_all"]

T = TypeVar("T")
S = TypeVar("S")

_log = logging.getLogger(__name__)
_UNSET: Any = object()


class Future(Generic[T]):
    """The result of an asynchronous operation, completed once (torch.futures.Future).

    Args:
        devices: accepted for torch's signature; device arrays are synchronized by the
            operation that produces them (``gpucoll.rpc`` stages them through host memory).
    """

    __slots__ = ("_lock", "_value", "_error", "_callbacks", "_waiters", "__weakref__")

    def __init__(self, *, devices: Sequence[Any] | None = None) -> None:
        self._lock = threading.Lock()
        self._value: Any = _UNSET
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Future[T]], None]] | None = None
        self._waiters: list[threading.Lock] | None = None

    def done(self) -> bool:
        """Whether the future has a value or an exception."""
        return self._value is not _UNSET or self._error is not None

    def set_result(self, result: T) -> None:
        """Complete the future with ``result`` and run its callbacks on this thread.

        Raises:
            RuntimeError: the future was already completed.
        """
        self._complete(result, None)

    def set_exception(self, result: BaseException) -> None:
        """Complete the future with an exception: ``wait()`` and ``value()`` raise it.

        Raises:
            TypeError: ``result`` is not an exception.
            RuntimeError: the future was already completed.
        """
        if not isinstance(result, BaseException):
            raise TypeError(f"set_exception needs an exception; got {type(result).__name__}: {result!r}")
        self._complete(_UNSET, result)

    def _complete(self, value: Any, error: BaseException | None) -> bool:
        with self._lock:
            if self.done():
                raise RuntimeError("Future can only be marked completed once; this one already holds "
                                   + ("an exception" if self._error is not None else "a value"))
            if error is not None:
                self._error = error
            else:
                self._value = value
            callbacks, self._callbacks = self._callbacks, None
            waiters, self._waiters = self._waiters, None
        if waiters:
            for w in waiters:
                w.release()
        if callbacks:
            for cb in callbacks:
                self._run(cb)
        return True

    def _try_complete(self, value: Any, error: BaseException | None) -> bool:
        """Complete unless already completed (a race between a reply and a timeout)."""
        try:
            return self._complete(value, error)
        except RuntimeError:
            if self.done():
                return False
            raise

    def _run(self, cb: Callable[[Future[T]], None]) -> None:
        try:
            cb(self)
        except Exception:  # torch logs a failing done-callback and goes on
            _log.exception("a callback added with Future.add_done_callback raised")

    def wait(self) -> T:
        """Block until the future completes; return its value or raise its exception."""
        if not self.done():
            self._block(None)
        return self.value()

    def _block(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: forever); whether it completed."""
        waiter = threading.Lock()
        waiter.acquire()
        with self._lock:
            if self.done():
                return True
            if self._waiters is None:
                self._waiters = []
            self._waiters.append(waiter)
        if waiter.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            return True
        with self._lock:
            if self._waiters and waiter in self._waiters:
                self._waiters.remove(waiter)
        return self.done()

    def value(self) -> T:
        """The value of a completed future (raises its exception if it failed).

        Raises:
            RuntimeError: the future has not completed yet.
        """
        if self._error is not None:
            raise self._error
        if self._value is _UNSET:
            raise RuntimeError("Future.value() called before the future completed; call wait() first")
        return self._value  # type: ignore[no-any-return]

    def then(self, callback: Callable[[Future[T]], S]) -> Future[S]:
        """A new future completed with ``callback(self)`` once this one completes.

        An exception raised by ``callback`` fails the new future, as a RuntimeError (torch's
        rule: its message is the original's, which is chained as ``__cause__``); a
        RuntimeError, and anything derived from it, is kept as it is.

        Raises:
            TypeError: ``callback`` is not callable.
        """
        return self._chain(callback, wrap=True)

    def _chain(self, callback: Callable[[Future[T]], S], wrap: bool) -> Future[S]:
        if not callable(callback):
            raise TypeError(f"incompatible function arguments. then() takes a callable; got {callback!r}")
        child: Future[S] = Future()

        def run(fut: Future[T]) -> None:
            try:
                out = callback(fut)
            except BaseException as e:  # noqa: BLE001 -- handed to the child, as torch does
                if wrap and not isinstance(e, RuntimeError) and isinstance(e, Exception):
                    err = RuntimeError(f"{type(e).__name__}: {e}")
                    err.__cause__ = e
                    child._try_complete(_UNSET, err)
                else:
                    child._try_complete(_UNSET, e)
            else:
                child._try_complete(out, None)

        self.add_done_callback(run)
        return child

    def add_done_callback(self, callback: Callable[[Future[T]], None]) -> None:
        """Run ``callback(self)`` when the future completes (at once if it has).

        Exceptions the callback raises are logged and ignored, as in torch; use
        :meth:`then` to catch them in a future.

        Raises:
            TypeError: ``callback`` is not callable.
        """
        if not callable(callback):
            raise TypeError(f"incompatible function arguments. add_done_callback() takes a callable; got {callback!r}")
        with self._lock:
            if not self.done():
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(callback)
                return
        self._run(callback)

    def __reduce__(self) -> Any:
        raise RuntimeError("Can not pickle gpucoll.futures.Future: send its value, or mark the function that "
                           "returns it @rpc.functions.async_execution")

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error is not None else "done")
        return f"<gpucoll.futures.Future {state}>"


def collect_all(futures: Sequence[Future[Any]]) -> Future[list[Future[Any]]]:
    """A future completed with the list of ``futures`` once every one of them has completed.

    As torch's: the first of them to fail fails the combined future at once, with its
    exception (so :func:`wait_all` returns early).
    """
    futures = list(futures)
    out: Future[list[Future[Any]]] = Future()
    if not futures:
        out.set_result([])
        return out
    left = [len(futures)]
    lock = threading.Lock()

    def one(f: Future[Any]) -> None:
        if f._error is not None:
            out._try_complete(None, f._error)
            return
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            out._try_complete(futures, None)

    for f in futures:
        if not isinstance(f, Future):
            raise TypeError(f"collect_all takes gpucoll.futures.Future objects; got {type(f).__name__}")
        f.add_done_callback(one)
    return out


def wait_all(futures: Sequence[Future[Any]]) -> list[Any]:
    """Wait for every future; return their values in order. The first failure is raised at
    once, without waiting for the others (torch's rule)."""
    done = collect_all(futures).wait()
    return [f.wait() for f in done]
