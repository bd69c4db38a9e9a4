"""The Future a communication hook returns: torch.futures.Future's ``then`` / ``wait`` /
``value`` / ``done`` / ``set_result``, resolved lazily on the waiting thread.

A Future made from a :class:`~gpucoll.Work` resolves when the Work does; ``then(fn)``
gives a Future whose value is ``fn(parent)``. Callbacks run when someone waits (the
Reducer's ``wait()``, in bucket order), on that thread, never on a backend's thread: a
callback that issues a collective (PowerSGD does) then issues it in the same order on
every rank, and on GPUs ``Work.wait()`` orders the caller's stream after the op without
blocking the host, so the callback's kernels are queued behind it as in torch.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

from .._work import Work

__all__ = ["Future"]

T = TypeVar("T")
S = TypeVar("S")

_UNSET: Any = object()


class Future(Generic[T]):
    """A value that an asynchronous op or a chain of callbacks will produce.

    Made by :meth:`from_work`, by :meth:`then`, or empty (complete it with
    :meth:`set_result` / :meth:`set_exception`).

    Example:
        >>> fut = Future.from_work(gpucoll.all_reduce(x, async_op=True)).then(lambda f: f.value()[0] / 2)
        >>> fut.wait()
    """

    __slots__ = ("_work", "_parent", "_fn", "_value", "_exc")

    def __init__(self) -> None:
        self._work: Work | None = None
        self._parent: Future[Any] | None = None
        self._fn: Callable[[Future[Any]], T] | None = None
        self._value: T = _UNSET
        self._exc: BaseException | None = None

    @classmethod
    def from_work(cls, work: Work) -> Future[list[Any]]:
        """A Future whose value is the Work's ``result()`` (the list of its arrays)."""
        fut: Future[list[Any]] = Future()
        fut._work = work
        return fut

    def then(self, callback: Callable[[Future[T]], S]) -> Future[S]:
        """A Future whose value is ``callback(self)``, run once this one is complete."""
        fut: Future[S] = Future()
        fut._parent = self
        fut._fn = callback
        return fut

    def done(self) -> bool:
        """Complete (its value or error is known without running anything)."""
        if self._value is not _UNSET or self._exc is not None:
            return True
        if self._work is not None:
            return self._work.is_completed()
        return False

    def set_result(self, value: T) -> None:
        """Complete an empty Future with ``value``."""
        if self.done() or self._work is not None or self._parent is not None:
            raise RuntimeError("set_result: this Future is already complete or produced by an op")
        self._value = value

    def set_exception(self, exc: BaseException) -> None:
        """Complete an empty Future with an error that ``wait()`` raises."""
        if self.done() or self._work is not None or self._parent is not None:
            raise RuntimeError("set_exception: this Future is already complete or produced by an op")
        self._exc = exc

    def wait(self, timeout: float | None = None) -> T:
        """Run what this value depends on, and return it (or raise its error).

        Args:
            timeout: seconds for each op it waits on; None uses its group's timeout.
        """
        if self._value is _UNSET and self._exc is None:
            self._resolve(timeout)
        if self._exc is not None:
            raise self._exc
        return self._value

    def value(self) -> T:
        """The value (torch's name; here the same as :meth:`wait`)."""
        return self.wait()

    def _resolve(self, timeout: float | None) -> None:
        try:
            if self._work is not None:
                self._work.wait(timeout)
                self._value = self._work.result()  # type: ignore[assignment]
                self._work = None
            elif self._parent is not None and self._fn is not None:
                self._parent.wait(timeout)
                self._value = self._fn(self._parent)
                self._parent = self._fn = None
            else:
                raise RuntimeError("wait() on an empty Future that nobody completed")
        except BaseException as exc:
            self._exc = exc
            raise
