"""The gpucoll exception hierarchy.

Names follow torch.distributed so that ``except`` clauses port unchanged::

    DistError
    ├── DistBackendError        a collective or communicator failed (NCCL error,
    │                           peer died, watchdog timeout, aborted group)
    ├── DistNetworkError        a socket could not connect, was reset, or timed out
    ├── DistStoreError          a store request failed
    │   ├── DistStoreTimeoutError   get/wait/connect did not finish within its timeout
    │   └── QueueEmptyError         queue_pop(block=False) found the queue empty
    └── BackendUnavailableError the requested backend cannot run here (no CuPy,
                                no NCCL library, no GPU); the message says what to install

Bad arguments raise ``ValueError``/``TypeError`` naming the argument, its value
and what was expected. Foreign exceptions (CuPy's ``NcclError``,
``CUDARuntimeError``, ``OSError``) are converted at the boundary with the
original chained as ``__cause__``.
"""

from __future__ import annotations

__all__ = [
    "DistError",
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "DistStoreTimeoutError",
    "QueueEmptyError",
    "BackendUnavailableError",
    "ParameterMismatchError",
    "RegistrationError",
]


class DistError(RuntimeError):
    """Base class of every error gpucoll raises for a distributed failure."""


class DistBackendError(DistError):
    """A collective, point-to-point op or communicator failed or was aborted."""


class RegistrationError(DistBackendError, ValueError):
    """Registering memory with a communicator (``ProcessGroup.register_buffer``,
    ``register_mem_pool``) broke one of NCCL's conditions, or NCCL refused it: the
    message names the condition, the buffer and, for a window, the ranks."""


class DistNetworkError(DistError):
    """A connection could not be made, was reset, or a socket timed out."""


class DistStoreError(DistError):
    """A store request failed (server gone, bad reply, value too large, ...)."""


class DistStoreTimeoutError(DistStoreError, TimeoutError):
    """A store ``get``/``wait``/connect did not complete within its timeout."""


class QueueEmptyError(DistStoreError):
    """``queue_pop(key, block=False)`` found the queue empty (torch's ``QueueEmptyError``)."""


class BackendUnavailableError(DistError):
    """The requested backend cannot run on this machine; the message says why."""


class ParameterMismatchError(DistError):
    """Ranks disagree about the parameters of a data-parallel reduction: different shapes
    or dtypes (``verify_params_across_processes``), or a gradient some rank did not hand
    over in an iteration (``Reducer.wait``). The message lists the parameters and ranks."""
