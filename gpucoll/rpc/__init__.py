"""Remote procedure calls and remote references: torch.distributed.rpc's API, without torch.

A program written for ``torch.distributed.rpc`` runs by changing the import::

    import gpucoll.rpc as rpc

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 0:
        total = rpc.rpc_sync("worker1", np.add, args=(np.ones(3), 1))
        rref = rpc.remote("worker1", np.zeros, args=(4,))
        print(rref.to_here())
    rpc.shutdown()

Any picklable value travels; NumPy arrays go out of band (pickle protocol 5, never
copied into the pickle). Device arrays need a device map (``set_device_map``), as in
torch. Connections are authenticated with the job's store token before anything is
unpickled (docs/security.md). See docs/rpc.md.
"""

from __future__ import annotations

from typing import Any

from . import api, backend_registry, constants, functions, internal
from ._api import (_get_current_rpc_agent, _get_debug_info, _rref_context_get_debug_info, _set_rpc_timeout,
                   get_rpc_timeout, get_worker_info, remote, rpc_async, rpc_sync)
from ._info import WorkerInfo, check_name
from ._rref import RRef
from .api import shutdown
from .constants import DEFAULT_RPC_TIMEOUT_SEC, DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT
from .options import RpcBackendOptions, TensorPipeRpcBackendOptions
from ._agent import Agent as TensorPipeAgent  # torch's name for the agent class (isinstance checks)

__all__ = ["init_rpc", "shutdown", "rpc_sync", "rpc_async", "remote", "get_worker_info", "get_rpc_timeout",
           "WorkerInfo", "RRef", "BackendType", "RpcBackendOptions", "TensorPipeRpcBackendOptions",
           "api", "backend_registry", "constants", "functions", "internal", "is_available", "DEFAULT_RPC_TIMEOUT_SEC",
           "DEFAULT_SHUTDOWN_TIMEOUT", "UNSET_RPC_TIMEOUT"]

_ = (_get_current_rpc_agent, _get_debug_info, _rref_context_get_debug_info, _set_rpc_timeout)  # torch's private API


def __getattr__(name: str) -> Any:
    if name == "BackendType":  # rebuilt by register_backend, as torch's
        return backend_registry.BackendType
    raise AttributeError(f"module 'gpucoll.rpc' has no attribute {name!r}")


def is_available() -> bool:
    """Always True: RPC needs nothing beyond gpucoll (torch's ``rpc.is_available``)."""
    return True


def _infer_backend(options: RpcBackendOptions) -> Any:
    members = list(backend_registry.BackendType)
    defaults = [(m, type(backend_registry.construct_rpc_backend_options(m))) for m in members]
    for m, cls in defaults:
        if type(options) is cls:
            return m
    for m, cls in defaults:
        if isinstance(options, cls):
            return m
    raise TypeError(f"Could not infer backend for options {options!r}")


def _init_rpc_backend(backend: Any = None, store: Any = None, name: str | None = None, rank: int = -1,
                      world_size: int | None = None, rpc_backend_options: RpcBackendOptions | None = None) -> None:
    """torch's step after the store exists: start ``backend``'s agent on ``store`` and install it."""
    from . import _api

    if _api._agent[0] is not None:
        raise RuntimeError("RPC is already initialized")
    backend = backend_registry._current(backend if backend is not None else backend_registry.BackendType.TENSORPIPE)
    if rpc_backend_options is None:
        rpc_backend_options = backend_registry.construct_rpc_backend_options(backend)
    agent = backend_registry.init_backend(backend, store=store, name=check_name(name), rank=rank,
                                          world_size=world_size, rpc_backend_options=rpc_backend_options)
    if _api._agent[0] is None:
        _api.install(agent)


def init_rpc(name: str, backend: Any = None, rank: int = -1, world_size: int | None = None,
             rpc_backend_options: RpcBackendOptions | None = None) -> None:
    """Start RPC on this process as worker ``name``.

    Args:
        name: unique in the group; ``^[A-Za-z0-9-_:]*$``, under 128 characters.
        backend: a ``BackendType`` member (default ``TENSORPIPE``, gpucoll's transport;
            inferred from ``rpc_backend_options`` when given).
        rank: this worker's id (-1: ``RANK`` from the environment, with ``env://``).
        world_size: the number of workers; None makes a dynamic group that workers
            join and leave (then ``rank`` is required).
        rpc_backend_options: e.g. ``TensorPipeRpcBackendOptions(rpc_timeout=..., init_method=...)``.
            ``init_method`` is ``env://`` (MASTER_ADDR/MASTER_PORT; rank 0 serves the store
            unless GPUCOLL_STORE_HOSTED=1, as launchers set), ``tcp://host:port`` or ``file:///path``.

    Raises:
        TypeError: a backend or options of the wrong type. ValueError: a bad or duplicate
        name, a duplicate rank, missing rendezvous settings. RuntimeError: RPC is already
        initialized.

    Example::

        rpc.init_rpc("trainer0", rank=0, world_size=2)
    """
    check_name(name)
    if backend is not None:
        backend = backend_registry._current(backend)
    if rpc_backend_options is not None and not isinstance(rpc_backend_options, RpcBackendOptions):
        raise TypeError("Argument rpc_backend_options must be an instance of RpcBackendOptions; got "
                        f"{type(rpc_backend_options).__name__}")
    if backend is None:
        backend = (backend_registry.BackendType.TENSORPIPE if rpc_backend_options is None
                   else _infer_backend(rpc_backend_options))
    if rpc_backend_options is None:
        rpc_backend_options = backend_registry.construct_rpc_backend_options(backend)
    from . import _api, _init

    if _api._agent[0] is not None:
        raise RuntimeError("RPC is already initialized")
    store, rank, world_size = _init.make_store(rpc_backend_options, rank, world_size)
    _init_rpc_backend(backend, store, name, rank, world_size, rpc_backend_options)
