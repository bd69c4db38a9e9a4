"""What the multi-process RPC tests' workers share: joining the RPC world under
``run_spmd``'s environment."""

from __future__ import annotations

import os

import gpucoll.rpc as rpc


def init_worker(rpc_timeout: float = 60) -> int:
    """``init_rpc`` as ``worker<RANK>`` of ``WORLD_SIZE`` workers (``run_spmd`` sets both),
    with ``rpc_timeout`` seconds per call; returns the rank."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=rpc_timeout))
    return rank
