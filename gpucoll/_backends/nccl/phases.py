"""Running a plan's phases on the communication stream: local steps (copies, kernels)
and NCCL calls, one NCCL group per phase, each call under the communicator's lock.
Functions over an :class:`NCCLBackend`'s state, called by its issue path."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from . import lifecycle as _lifecycle
from .plan import Phase, Premul, Step
from .runtime import Comm

if TYPE_CHECKING:
    from .state import BackendState

__all__ = ["run_phase", "on_comm"]

_REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter"})


def run_phase(b: BackendState, phase: Phase) -> None:
    """Run one phase of a plan: its local steps before, its NCCL calls (one group),
    its local steps after."""
    pre, calls, post = phase
    for step in pre:
        _local(b, step)
    if calls:
        comm = b.comm_slot.comm
        assert comm is not None
        on_comm(b, _issue_calls, b, comm, calls)
    for step in post:
        _local(b, step)


def on_comm(b: BackendState, fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)``, calls on the communicator. NCCL communicators take one thread at a
    time, and ncclCommAbort frees the one under a call in flight: the calls hold
    the communicator's lock (comm.py), and an abort from another thread meanwhile is carried out by this
    thread once they return."""
    b.comm_slot.call(fn, *args)
    if b.ending.aborted is not None:
        _lifecycle.abort_comm(b, blocking=True)
        raise RuntimeError("the communicator was aborted while this op was being issued")


def _issue_calls(b: BackendState, comm: Comm, calls: Sequence[Step]) -> None:
    created: list[int] = []
    try:
        for s in calls:
            if s[0] in _REDUCING and type(s[5]) is Premul:
                calls = [_bind_premul(comm, s, created) for s in calls]
                break
        stream = b.comm_stream.ptr
        if len(calls) == 1:
            step = calls[0]
            getattr(comm, step[0])(*step[1:], stream)
        else:
            b.runtime.group_start()
            try:
                for step in calls:
                    getattr(comm, step[0])(*step[1:], stream)
            finally:
                b.runtime.group_end()
    finally:
        # NCCL allows destroying an op once the calls that use it returned.
        for op in created:
            comm.op_destroy(op)


def _bind_premul(comm: Comm, step: Step, created: list[int]) -> Step:
    if step[0] not in _REDUCING or not isinstance(step[5], Premul):
        return step
    op = comm.premul_sum(step[5].scalar, step[5].dtype)
    created.append(op)
    return step[:5] + (op,) + step[6:]


def _local(b: BackendState, step: Step) -> None:
    if step[0] == "copy":
        _, dst, src, nbytes = step
        if nbytes:
            b.runtime.memcpy(dst, src, nbytes, b.comm_stream.ptr)
    elif step[0] == "kernel":
        _, name, n, args = step
        b.runtime.launch(name, n, args, b.comm_stream.stream, b.device_index)
    else:
        raise AssertionError(f"unknown local step {step[0]!r}")
