"""The general issue path's helpers (``NCCLBackend._issue``, ``_launch``, ``barrier``):
an op's Work, the checks before a communicator is made or an op planned, the
caller's streams, the kernels a plan launches. Functions over explicit arguments."""

from __future__ import annotations

from typing import Sequence

from ..._buffer import Buffer
from ...errors import DistBackendError
from .plan import Plan
from .protocols import Runtime
from .work import NCCLWork, WorkOwner

__all__ = ["new_work", "prepare_kernels", "refuse_in_capture", "first_device", "check_devices", "caller_streams"]


def new_work(owner: WorkOwner, op_type: str, keep: Sequence[Buffer], timeout: float) -> NCCLWork:
    """The Work of an op of ``owner`` on ``keep`` (held until it completes): it holds the
    producer streams' objects, and blocks the host in ``wait()`` for foreign memory."""
    work = NCCLWork(op_type, owner, keepalive=list(keep), default_timeout=timeout)
    for b in keep:
        if b.stream is not None:
            if b.foreign_stream:
                # The producer's later work runs on a stream gpucoll cannot make
                # wait: wait() orders it the only way left, by blocking the host.
                work.host_wait = True
            if b.stream_owner is not None:
                work.hold_stream(b.stream_owner)
        elif b.foreign_stream:
            work.host_wait = True
    return work


def prepare_kernels(rt: Runtime, device: int, plan: Plan) -> None:
    """Compile (once) the kernels the plan launches, before any NCCL call is made."""
    for pre, _, post in plan:
        if pre or post:
            for step in (*pre, *post):
                if step[0] == "kernel":
                    rt.prepare(step[1], device)


def refuse_in_capture(rt: Runtime, op_type: str, group_name: str, bufs: Sequence[Buffer]) -> None:
    """ncclCommInitRank inside a CUDA graph capture would allocate and synchronise
    (invalidating the capture) and block on the other ranks: refuse it, clearly."""
    streams = {b.stream for b in bufs if b.stream is not None} | {rt.current_stream()}
    if any(rt.is_capturing(s) for s in streams):
        raise DistBackendError(
            f"{op_type} on group {group_name!r}: its NCCL communicator does not exist yet, and "
            "it cannot be created during CUDA graph capture. Create it before capturing: pass "
            "device_id to init_process_group/new_group, or run one op (a warm-up) first")


def first_device(op_type: str, bufs: Sequence[Buffer]) -> int:
    """The device of the first CUDA array of ``bufs`` (where a lazily made communicator
    goes); ValueError when there is none."""
    cuda = [b for b in bufs if b.is_cuda]
    if not cuda:
        raise ValueError(f"{op_type}: the NCCL backend needs CUDA device arrays; got host memory")
    return cuda[0].device.index


def check_devices(device: int, group_name: str, op_type: str, bufs: Sequence[Buffer]) -> None:
    """Every array of ``bufs`` is on cuda:``device``; ValueError otherwise."""
    for b in bufs:
        if b.device.type != "cuda" or b.device.index != device:
            raise ValueError(
                f"{op_type}: every array must be on cuda:{device}, the device of group "
                f"{group_name!r}'s NCCL communicator; got one on {b.device}")


def caller_streams(rt: Runtime, bufs: Sequence[Buffer]) -> tuple[int, ...]:
    """The streams the op's arrays were made on, each once: a producer's, else the
    caller's current stream."""
    if len(bufs) == 1:
        s = bufs[0].stream
        return (rt.current_stream() if s is None else s,)
    streams: list[int] = []
    current = -1
    for b in bufs:
        s = b.stream
        if s is None:
            # No producer stream published (or the legacy default): the caller's
            # current stream is where the data was made and will be used.
            if current < 0:
                current = rt.current_stream()
            s = current
        if s not in streams:
            streams.append(s)
    if not streams:
        streams.append(rt.current_stream())
    return tuple(streams)
