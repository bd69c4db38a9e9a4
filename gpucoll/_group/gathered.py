"""One all_reduce of an input assembled from several host arrays, each divided on the
way in: what the Reducer's ``reduce()`` runs per bucket (the gradients read where they
are: a floating bucket's AVG, the others' SUM of the gradients divided by the world
size). On the CPU backend the gradients go straight into the transport's staging
buffers (``ReducesGathered``); the op is the bucket's all_reduce (AVG or SUM) by every
measure a peer can see, so a peer may issue that instead."""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

from .. import array as _array
from .._backends.base import Backend
from .._backends.cpu.backend import gathered_fill
from .._reduce_op import ReduceOp
from .._work import Work
from .checks import _check_op
from .core import Issuer
from .dispatch import backend_for

__all__ = ["all_reduce_gathered"]


class _Group(Protocol):
    """What of a ``ProcessGroup`` this reads (group.py imports this package's modules)."""

    backend_name: str
    group_name: str
    _cpu: Backend
    _nccl: Backend | None
    _device_id: int | None
    _issuer: Issuer
    _coalescing: Any

    def _check_usable(self) -> None: ...

    def all_reduce(self, tensor: Any, op: Any = ReduceOp.SUM, async_op: bool = False) -> Work | None: ...


def all_reduce_gathered(pg: _Group, out: np.ndarray, parts: Sequence[np.ndarray], divisor: int,
                        async_op: bool = False, op: ReduceOp = ReduceOp.SUM) -> Work | None:
    """``out`` = the sum over ``pg``'s ranks of the concatenation of ``parts`` (1-D NumPy
    arrays, ``out.size`` elements in all; ``[out]`` itself is allowed), each element
    divided by ``divisor`` first (``np.divide``, as the Reducer's ``mark_ready``); with
    ``op=ReduceOp.AVG`` the average of that (the op is then the all_reduce AVG of the
    concatenation, by every measure a peer can see).

    Returns:
        A Work if ``async_op`` (the parts must stay as they are until it completes), else None.

    Raises:
        ValueError: the parts do not add up to ``out``, or ``op`` is neither SUM nor AVG.
        DistBackendError: the op failed (as ``all_reduce``).
    """
    pg._check_usable()
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"all_reduce_gathered: op must be SUM or AVG; got {op!r}")
    total = sum(int(p.size) for p in parts)
    if total != out.size:
        raise ValueError(f"all_reduce_gathered: the parts hold {total} elements; out holds {out.size}")
    buf = _array.as_buffer(out, name="out", writable=True)
    backend = backend_for(pg, buf, "out")  # type: ignore[arg-type]  # (GroupBackends: a superset read)
    gathered = getattr(backend, "all_reduce_gathered", None)
    if pg._coalescing is not None or gathered is None:  # divide into out, then its all_reduce
        gathered_fill(parts, divisor)(0, out.size, out)
        return pg.all_reduce(out, op, async_op)
    red = _check_op(op, buf.dtype)
    issuer = pg._issuer
    args = (buf, parts, divisor, red)
    if issuer.hooks or issuer.debug_detail:  # a Work for the hook; DETAIL's cross-rank check
        return issuer.call(backend, gathered, args, buf, [out], async_op, False, "all_reduce", red)
    return issuer.run_now(backend, getattr(backend, "all_reduce_gathered_now"), gathered, args, buf, "all_reduce",
                          [out], -1, async_op)
