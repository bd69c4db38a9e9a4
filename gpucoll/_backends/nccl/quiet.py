"""The runners a group's DeviceRun binds (``gpucoll/_group/device_run.py``): an all_reduce
already issued on one array (address, size, dtype, op), its hot call looked up once,
run again with what the group read of the array per call.

``run(handle, keep, seq, entry, group_name) -> bool`` is ``NCCLBackend.all_reduce_quiet``
of that op and ``start(handle, keep, seq, entry, group_name) -> Work | None`` its async
form (on the communication stream, numbered and recorded; ``hot.start_async``).
``handle`` is that of the caller's current stream as CuPy's ``get_current_stream()``
returns it, the stream the array's producer names, ``stream_of(stream, device)``
(``Runtime.stream_of``, no CUDA call; None: another device's stream, and then the
caller goes the usual way, which orders it). ``run`` is called only when
``posted.ops`` is empty (posted sends and receives go first, the usual way; ``start``
declines then). ``keep`` holds the array's memory until the op completes.
The caller vouches for what the runners do not check again: an array at this address,
of this size and dtype, C-contiguous. The device and a foreign stream are checked
when the runners are made (an address names one device); a capture, posted sends and
receives, and an ended backend on every call (hot.py)."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Protocol

from ..._buffer import Buffer
from ..._reduce_op import ReduceOp, ReduceOpLike
from . import hot as _hot
from .posting import Posted
from .state import BackendState
from .work import NCCLWork

__all__ = ["Runners", "all_reduce_runners", "runners"]


class Runners(NamedTuple):
    """An op's synchronous (``run``) and async (``start``) runners."""

    run: Callable[..., bool]
    start: Callable[..., NCCLWork | None]
    posted: Posted
    stream_of: Callable[[Any, int], int | None]
    device: int
    stream_of_fixed: bool  # whether stream_of's answer for a stream object may be kept


class _Backend(BackendState, Protocol):
    """What :func:`all_reduce_runners` reads of the NCCL backend besides its state."""

    _hot: dict[tuple[Any, ...], _hot.Hot]
    posted: Posted


def all_reduce_runners(self: _Backend, buf: Buffer, op: ReduceOpLike) -> Runners | None:
    """``NCCLBackend.all_reduce_runners``: the runners of an all_reduce already issued on
    ``buf`` (its hot call), for a group's DeviceRun; None when it has none (yet)."""
    hot = self._hot.get(("all_reduce", buf.ptr, buf.nbytes, buf.dtype.name, op.name)) if type(op) is ReduceOp else None
    return None if hot is None else runners(self, self.posted, hot, buf)


def runners(b: BackendState, posted: Posted, hot: _hot.Hot, buf: Buffer) -> Runners | None:
    """The runners of ``hot`` (the op on ``buf``) on backend ``b`` (whose posted sends and
    receives are ``posted``); None where ``buf`` must always go the usual way."""
    where = buf.device
    if buf.foreign_stream or where.index != b.device_index or where.type != "cuda":
        return None
    return Runners(functools.partial(_hot.issue_quiet_at, b, hot),
                   functools.partial(_hot.start_async, b, posted, hot, buf.nbytes, _hot.run_work_class(b, hot.op_type)),
                   posted, b.runtime.stream_of, b.device_index, getattr(b.runtime, "stream_of_fixed", False))


