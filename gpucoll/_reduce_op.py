"""Reduction operators, with torch.distributed's names."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, SupportsFloat, Union

__all__ = ["ReduceOp", "PremulSum", "make_premul_sum", "ReduceOpLike", "as_reduce_op"]


class _ReduceOpMeta(enum.EnumMeta):
    """Makes a :class:`PremulSum` an instance of :class:`ReduceOp`, as torch's
    ``_make_nccl_premul_sum`` returns a ``ReduceOp`` (ported code checks with isinstance)."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, PremulSum) or super().__instancecheck__(instance)


class ReduceOp(enum.Enum, metaclass=_ReduceOpMeta):
    """How a reducing collective combines values across ranks.

    ``PREMUL_SUM`` multiplies each rank's input by a factor before summing; build
    one with ``ReduceOp.PREMUL_SUM(factor)`` or :func:`make_premul_sum` (it is an
    instance of ReduceOp with the ``factor``, as in torch). ``AVG`` on integer arrays divides with
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

    def __call__(self, factor: SupportsFloat) -> PremulSum:
        """``ReduceOp.PREMUL_SUM(factor)``: the PREMUL_SUM reduction with ``factor``, as
        torch's; the same as :func:`make_premul_sum`.

        Raises:
            TypeError: called on another op, or ``factor`` is not a real number or a 0-d
                real array.
        """
        if self is not ReduceOp.PREMUL_SUM:
            raise TypeError(f"only ReduceOp.PREMUL_SUM takes a factor; ReduceOp.{self.name} is not callable")
        return make_premul_sum(factor)


@dataclass(frozen=True)
class PremulSum:
    """``PREMUL_SUM`` with its factor: result = sum over ranks of factor * x_rank."""

    factor: float

    @property
    def op(self) -> ReduceOp:
        return ReduceOp.PREMUL_SUM


ReduceOpLike = Union[ReduceOp, PremulSum]


def make_premul_sum(factor: SupportsFloat) -> PremulSum:
    """Return a PREMUL_SUM reduction that scales every input by ``factor`` before summing
    (torch's ``_make_nccl_premul_sum``).

    Args:
        factor: a real number, or a 0-d real array of any framework (its value is read
            once, here; each rank may pass its own factor).

    Raises:
        TypeError: ``factor`` is not a real number or a 0-d real array.

    Example:
        >>> op = make_premul_sum(0.5)
        >>> gpucoll.all_reduce(x, op=op)   # x = 0.5 * sum of x over ranks
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        factor = _scalar(factor)
    return PremulSum(float(factor))


def _scalar(factor: Any) -> float:
    """The value of a 0-d real array (NumPy, CuPy, JAX, torch ...), or TypeError."""
    shape = getattr(factor, "shape", None)
    kind = getattr(getattr(factor, "dtype", None), "kind", None)
    if shape == () and kind in ("f", "i", "u"):
        return float(factor)
    if shape is not None and tuple(shape) == () and kind is None:  # torch: dtype has no .kind
        dtype = str(getattr(factor, "dtype", ""))
        if not any(t in dtype for t in ("complex", "bool")):
            return float(factor)
    raise TypeError(f"factor must be a real number or a 0-d real array; got {type(factor).__name__} "
                    f"{factor!r:.80}")


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
