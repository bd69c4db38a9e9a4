"""The faulty agent for tests (torch's ``torch.distributed.rpc._testing``): registers the
``FAULTY_TENSORPIPE`` backend, whose sends of chosen message types fail or are delayed.

Importing this module registers the backend (once).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from . import backend_registry, constants
from ._faults import FaultSpec
from ._info import MessageType
from .options import RpcBackendOptions, TensorPipeRpcBackendOptions

__all__ = ["FaultyTensorPipeRpcBackendOptions", "is_available"]


def is_available() -> bool:
    """Always True: the faulty agent is built in."""
    return True


class FaultyTensorPipeRpcBackendOptions(TensorPipeRpcBackendOptions):
    """Options of the faulty agent: torch's names and meanings.

    Args:
        num_worker_threads, rpc_timeout, init_method: as TensorPipeRpcBackendOptions.
        messages_to_fail: message types (torch's names, e.g. "RREF_FORK_REQUEST") whose
            first ``num_fail_sends`` sends fail.
        messages_to_delay: ``{message type: seconds}`` to hold each such send back.
        num_fail_sends: how many sends of each type in ``messages_to_fail`` fail.

    Raises:
        ValueError: an unknown message type name.
    """

    def __init__(self, *, num_worker_threads: int = constants.DEFAULT_NUM_WORKER_THREADS,
                 rpc_timeout: float = constants.DEFAULT_RPC_TIMEOUT_SEC,
                 init_method: str = constants.DEFAULT_INIT_METHOD, messages_to_fail: Sequence[str] = (),
                 messages_to_delay: Mapping[str, float] | None = None, num_fail_sends: int = 0) -> None:
        super().__init__(num_worker_threads=num_worker_threads, rpc_timeout=rpc_timeout, init_method=init_method)
        known = set(MessageType.__members__)
        bad = [m for m in [*messages_to_fail, *(messages_to_delay or {})] if m not in known]
        if bad:
            raise ValueError(f"unknown message types {bad}; known: {sorted(known)}")
        self.messages_to_fail = list(messages_to_fail)
        self.messages_to_delay = dict(messages_to_delay or {})
        self.num_fail_sends = int(num_fail_sends)


def _options(rpc_timeout: float, init_method: str, num_worker_threads: int = constants.DEFAULT_NUM_WORKER_THREADS,
             messages_to_fail: Sequence[str] = (), messages_to_delay: Mapping[str, float] | None = None,
             num_fail_sends: int = 0, **kwargs: Any) -> FaultyTensorPipeRpcBackendOptions:
    return FaultyTensorPipeRpcBackendOptions(num_worker_threads=num_worker_threads, rpc_timeout=rpc_timeout,
                                             init_method=init_method, messages_to_fail=messages_to_fail,
                                             messages_to_delay=messages_to_delay, num_fail_sends=num_fail_sends)


def _init(store: Any, name: str, rank: int, world_size: int | None, rpc_backend_options: RpcBackendOptions) -> Any:
    from ._init import start_agent

    if not isinstance(rpc_backend_options, FaultyTensorPipeRpcBackendOptions):
        raise TypeError(f"`rpc_backend_options` must be a `FaultyTensorPipeRpcBackendOptions`; got "
                        f"{type(rpc_backend_options).__name__}")
    o = rpc_backend_options
    return start_agent(store, name, rank, world_size, o, FaultSpec(o.messages_to_fail, o.messages_to_delay,
                                                                   o.num_fail_sends))


if not backend_registry.backend_registered("FAULTY_TENSORPIPE"):
    backend_registry.register_backend("FAULTY_TENSORPIPE", _options, _init)
