"""torch.distributed.rpc.functions: :func:`async_execution`."""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

__all__ = ["async_execution"]

F = TypeVar("F", bound=Callable[..., Any])

_ATTR = "_wrapped_async_rpc_function"  # torch's attribute name: decorators that copy it keep working


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning a :class:`gpucoll.futures.Future` that the callee waits on.

    The callee runs ``fn``, takes the future it returns and sends that future's value
    back when it completes, without holding one of its ``num_worker_threads`` threads
    meanwhile: a function that itself calls ``rpc_async`` and chains on the result
    cannot exhaust the callee's threads. With ``@staticmethod`` or ``@classmethod``
    this decorator must be the inner one, as in torch.

    Example::

        @rpc.functions.async_execution
        def add_then_double(to, x):
            return rpc.rpc_async(to, operator.add, args=(x, 1)).then(lambda f: f.value() * 2)
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    setattr(wrapper, _ATTR, wrapper)
    return wrapper  # type: ignore[return-value]


def _is_async(fn: Any) -> bool:
    """Whether ``fn`` (or the function a static/class method wraps) was marked by :func:`async_execution`."""
    return getattr(fn, _ATTR, None) is not None
