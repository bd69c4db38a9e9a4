"""RPC backends by name: torch's ``backend_registry`` (``BackendType``, ``register_backend``).

``BackendType.TENSORPIPE`` (torch's default name) means gpucoll's transport.
``register_backend`` builds a new ``BackendType`` with one more member, as torch does;
read it as ``gpucoll.rpc.backend_registry.BackendType`` (or ``gpucoll.rpc.BackendType``,
which always resolves to the current one).
"""

from __future__ import annotations

import enum
from typing import Any, Callable, NamedTuple

from . import constants
from .options import RpcBackendOptions, TensorPipeRpcBackendOptions

__all__ = ["BackendType", "BackendValue", "backend_registered", "register_backend", "construct_rpc_backend_options",
           "init_backend"]


class BackendValue(NamedTuple):
    """A backend's two handlers: building its options, and starting its agent."""

    construct_rpc_backend_options_handler: Callable[..., Any]
    init_backend_handler: Callable[..., Any]


def _repr(self: enum.Enum) -> str:
    return "BackendType." + self.name


def _make(members: dict[str, BackendValue]) -> Any:
    cls = enum.Enum("BackendType", members)  # type: ignore[misc]
    cls.__repr__ = _repr  # type: ignore[method-assign,assignment]
    cls.__doc__ = "The registered RPC backends (``TENSORPIPE`` built in; more with ``register_backend``)."
    return cls


def _tensorpipe_options(rpc_timeout: float, init_method: str, num_worker_threads: int = constants.DEFAULT_NUM_WORKER_THREADS,
                        _transports: Any = None, _channels: Any = None, **kwargs: Any) -> TensorPipeRpcBackendOptions:
    return TensorPipeRpcBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method,
                                       num_worker_threads=num_worker_threads, _transports=_transports,
                                       _channels=_channels, **kwargs)


def _tensorpipe_init(store: Any, name: str, rank: int, world_size: int | None,
                     rpc_backend_options: RpcBackendOptions) -> Any:
    from ._init import start_agent

    if not isinstance(rpc_backend_options, TensorPipeRpcBackendOptions):
        raise TypeError(f"`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`; got "
                        f"{type(rpc_backend_options).__name__}")
    return start_agent(store, name, rank, world_size, rpc_backend_options)


BackendType: Any = _make({"TENSORPIPE": BackendValue(_tensorpipe_options, _tensorpipe_init)})


def backend_registered(backend_name: str) -> bool:
    """Whether ``backend_name`` has been registered."""
    return backend_name in BackendType.__members__


def register_backend(backend_name: str, construct_rpc_backend_options_handler: Callable[..., Any],
                     init_backend_handler: Callable[..., Any]) -> Any:
    """Register an RPC backend; returns its new ``BackendType`` member.

    Args:
        backend_name: its name (``BackendType.<name>``).
        construct_rpc_backend_options_handler: ``(rpc_timeout, init_method, **kwargs) -> options``.
        init_backend_handler: ``(store, name, rank, world_size, rpc_backend_options) -> agent``.

    Raises:
        RuntimeError: the name is already registered.
    """
    global BackendType
    if backend_registered(backend_name):
        raise RuntimeError(f"RPC backend {backend_name}: already registered")
    members = {m.name: m.value for m in BackendType}
    members[backend_name] = BackendValue(construct_rpc_backend_options_handler, init_backend_handler)
    BackendType = _make(members)
    return BackendType[backend_name]


def construct_rpc_backend_options(backend: Any, rpc_timeout: float = constants.DEFAULT_RPC_TIMEOUT_SEC,
                                  init_method: str = constants.DEFAULT_INIT_METHOD, **kwargs: Any) -> Any:
    """The default options of ``backend``."""
    return _current(backend).value.construct_rpc_backend_options_handler(rpc_timeout, init_method, **kwargs)


def init_backend(backend: Any, *args: Any, **kwargs: Any) -> Any:
    """Start ``backend``'s agent."""
    return _current(backend).value.init_backend_handler(*args, **kwargs)


def _current(backend: Any) -> Any:
    """The member of the current ``BackendType`` of that name (members of an older
    ``BackendType``, from before a registration, still count)."""
    name = getattr(backend, "name", None)
    if not isinstance(backend, enum.Enum) or name not in BackendType.__members__:
        raise TypeError(f"Argument backend must be a member of BackendType; got {backend!r}")
    return BackendType[name]
