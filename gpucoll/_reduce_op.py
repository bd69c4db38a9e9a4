"""Reduction operators, with torch.distributed's names."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Union

__all__ = ["ReduceOp", "PremulSum", "make_premul_sum", "ReduceOpLike", "as_reduce_op"]


class ReduceOp(enum.Enum):
    """How a reducing collective combines values across ranks.

    ``PREMUL_SUM`` multiplies each rank's input by a factor before summing; build
    one with :func:`make_premul_sum`. ``AVG`` on integer arrays divides with
    truncation toward zero (NumPy's ``//`` would floor; we match C and NCCL).
    Bitwise ops (``BAND``, ``BOR``, ``BXOR``) need integer or bool arrays.
    """

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"
    PREMUL_SUM = "premul_sum"


@dataclass(frozen=True)
class PremulSum:
    """``PREMUL_SUM`` with its factor: result = sum over ranks of factor * x_rank."""

    factor: float

    @property
    def op(self) -> ReduceOp:
        return ReduceOp.PREMUL_SUM


ReduceOpLike = Union[ReduceOp, PremulSum]


def make_premul_sum(factor: float) -> PremulSum:
    """Return a PREMUL_SUM reduction that scales every input by ``factor`` before summing.

    Args:
        factor: a real Python number (a per-rank scalar array is not supported).

    Example:
        >>> op = make_premul_sum(0.5)
        >>> gpucoll.all_reduce(x, op=op)   # x = 0.5 * sum of x over ranks
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise TypeError(f"factor must be a real number; got {type(factor).__name__} {factor!r}")
    return PremulSum(float(factor))


def as_reduce_op(op: object) -> ReduceOpLike:
    """Validate ``op`` (a ReduceOp, a PremulSum, or a name like ``"sum"``)."""
    if isinstance(op, (ReduceOp, PremulSum)):
        if op is ReduceOp.PREMUL_SUM:
            raise ValueError("op=ReduceOp.PREMUL_SUM needs a factor: use gpucoll.make_premul_sum(factor)")
        return op
    if isinstance(op, str):
        try:
            return as_reduce_op(ReduceOp[op.upper()])
        except KeyError:
            pass
    names = ", ".join(o.name for o in ReduceOp)
    raise ValueError(f"op must be a ReduceOp ({names}) or make_premul_sum(factor); got {op!r}")
