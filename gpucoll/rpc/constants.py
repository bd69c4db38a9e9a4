"""torch.distributed.rpc.constants: the defaults of the RPC API, by torch's names."""

from __future__ import annotations

from typing import Final

__all__ = ["DEFAULT_RPC_TIMEOUT_SEC", "DEFAULT_INIT_METHOD", "DEFAULT_SHUTDOWN_TIMEOUT",
           "DEFAULT_NUM_WORKER_THREADS", "UNSET_RPC_TIMEOUT"]

DEFAULT_RPC_TIMEOUT_SEC: Final[float] = 60.0
"""The default timeout of a call, in seconds (``TensorPipeRpcBackendOptions.rpc_timeout``)."""

DEFAULT_INIT_METHOD: Final[str] = "env://"
"""The default rendezvous: MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE from the environment."""

DEFAULT_SHUTDOWN_TIMEOUT: Final[float] = 0
"""``shutdown(timeout=0)``: wait for the other workers without a time limit."""

DEFAULT_NUM_WORKER_THREADS: Final[int] = 16
"""Threads that run incoming calls on a worker."""

UNSET_RPC_TIMEOUT: Final[float] = -1.0
"""A call's ``timeout=-1``: use the default (``get_rpc_timeout()``)."""
