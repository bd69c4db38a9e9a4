"""gpucoll as a ``ray.util.collective`` backend (``"GPUCOLL"``): one process group per
Ray collective group, over NumPy arrays (the CPU backend) and CuPy arrays (NCCL).

Rendezvous: the group's rank 0 serves a TCPStore (port 0, a fresh token) and publishes
its address and token in Ray's internal key-value store under the group's name, as
Ray's own gloo group publishes its master address; the other ranks read it (bounded by
the timeout), and rank 0 removes it once every rank has connected. This module imports
Ray; only :func:`gpucoll.ray.register` imports it.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import ray.experimental.internal_kv as internal_kv
from ray.util.collective.collective_group.base_collective_group import BaseGroup
from ray.util.collective.types import (AllGatherOptions, AllReduceOptions, BarrierOptions, BroadcastOptions,
                                       RecvOptions, ReduceOp, ReduceOptions, ReduceScatterOptions, SendOptions)

from .. import _collectives as coll
from .._group import ProcessGroup, normalize_backend
from ..errors import DistNetworkError
from ..store import PrefixStore, TCPStore
from .._reduce_op import ReduceOp as GReduceOp
from .._world import destroy_process_group
from ._actor import node_address

__all__ = ["GpucollGroup", "TIMEOUT_S"]

TIMEOUT_S = 300.0
"""The group's timeout (Ray's BaseGroup takes none): rendezvous and every op."""

_OPS = {ReduceOp.SUM: GReduceOp.SUM, ReduceOp.PRODUCT: GReduceOp.PRODUCT, ReduceOp.MIN: GReduceOp.MIN,
        ReduceOp.MAX: GReduceOp.MAX}


def _kv_key(group_name: str) -> str:
    return f"gpucoll_ray_collective_store_{group_name}"


class GpucollGroup(BaseGroup):  # type: ignore[misc, unused-ignore]  # BaseGroup is Any where Ray is not installed
    """One ``ray.util.collective`` group on gpucoll (made by Ray's group manager)."""

    def __init__(self, world_size: int, rank: int, group_name: str) -> None:
        super().__init__(world_size, rank, group_name)
        self._server: TCPStore | None = None
        store = self._rendezvous(world_size, rank, group_name)
        self._store = store
        self.pg = ProcessGroup(PrefixStore(f"ray_collective/{group_name}", store), rank, world_size,
                               group_name=f"ray:{group_name}", global_ranks=range(world_size), timeout=TIMEOUT_S,
                               backend=normalize_backend(None))
        if rank == 0:  # every rank has connected to the group by now: the address is spent
            try:
                internal_kv._internal_kv_del(_kv_key(group_name))
            except Exception:  # noqa: BLE001 - a stale key is replaced by the next rank 0
                pass

    def _rendezvous(self, world_size: int, rank: int, group_name: str) -> TCPStore:
        key = _kv_key(group_name)
        if rank == 0:
            token = secrets.token_hex(16)
            single = world_size == 1
            host = "127.0.0.1" if single else node_address()
            self._server = TCPStore("127.0.0.1" if single else "", 0, is_master=True, wait_for_workers=False,
                                    timeout=TIMEOUT_S, token=token)
            internal_kv._internal_kv_put(key, json.dumps({"host": host, "port": int(self._server.port),
                                                          "token": token}).encode(), overwrite=True)
            return self._server
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            raw = internal_kv._internal_kv_get(key)
            if raw is not None:
                break
            if time.monotonic() >= deadline:
                raise DistNetworkError(f"ray.util.collective group {group_name!r} (GPUCOLL): rank {rank} found no "
                                       f"address of rank 0's store under {key!r} within {TIMEOUT_S:g} s; did rank 0 "
                                       "call init_collective_group?")
            time.sleep(0.02)
        info = json.loads(raw)
        return TCPStore(info["host"], int(info["port"]), is_master=False, timeout=TIMEOUT_S, token=info["token"])

    @classmethod
    def backend(cls) -> str:
        """The name Ray knows this backend by."""
        return "GPUCOLL"

    @classmethod
    def check_backend_availability(cls) -> bool:
        """Always available: the CPU backend needs only NumPy."""
        return True

    def destroy_group(self) -> None:
        """Destroy the process group and close the store."""
        try:
            destroy_process_group(self.pg)
        finally:
            self._store.close()

    def allreduce(self, tensors: list[Any], allreduce_options: Any = AllReduceOptions()) -> None:
        """All-reduce ``tensors[0]`` in place."""
        coll.all_reduce(_one(tensors), op=_op(allreduce_options), group=self.pg)

    def barrier(self, barrier_options: Any = BarrierOptions()) -> None:
        """Wait for every rank."""
        coll.barrier(group=self.pg)

    def reduce(self, tensors: list[Any], reduce_options: Any = ReduceOptions()) -> None:
        """Reduce ``tensors[0]`` into the root rank's."""
        coll.reduce(_one(tensors), dst=int(reduce_options.root_rank), op=_op(reduce_options), group=self.pg)

    def allgather(self, tensor_lists: list[list[Any]], tensors: list[Any],
                  allgather_options: Any = AllGatherOptions()) -> None:
        """Gather every rank's ``tensors[0]`` into ``tensor_lists[0]``."""
        coll.all_gather(list(_one(tensor_lists)), _one(tensors), group=self.pg)

    def broadcast(self, tensors: list[Any], broadcast_options: Any = BroadcastOptions()) -> None:
        """Broadcast the root rank's ``tensors[0]``."""
        coll.broadcast(_one(tensors), src=int(broadcast_options.root_rank), group=self.pg)

    def reducescatter(self, tensors: list[Any], tensor_lists: list[list[Any]],
                      reducescatter_options: Any = ReduceScatterOptions()) -> None:
        """Reduce ``tensor_lists[0]`` across ranks; rank i gets part i in ``tensors[0]``."""
        coll.reduce_scatter(_one(tensors), list(_one(tensor_lists)), op=_op(reducescatter_options), group=self.pg)

    def send(self, tensors: list[Any], send_options: SendOptions) -> None:
        """Send ``tensors[0]`` to ``send_options.dst_rank``."""
        coll.send(_one(tensors), dst=int(send_options.dst_rank), group=self.pg)

    def recv(self, tensors: list[Any], recv_options: RecvOptions) -> None:
        """Receive into ``tensors[0]`` from ``recv_options.src_rank``."""
        coll.recv(_one(tensors), src=int(recv_options.src_rank), group=self.pg)


def _one(items: list[Any]) -> Any:
    if len(items) != 1:
        raise ValueError(f"the GPUCOLL backend takes one array per process (one GPU each); got {len(items)}")
    return items[0]


def _op(options: Any) -> GReduceOp:
    op = options.reduceOp
    if op not in _OPS:
        raise ValueError(f"ray.util.collective reduce op {op!r} is not one of {list(_OPS)}")
    return _OPS[op]
