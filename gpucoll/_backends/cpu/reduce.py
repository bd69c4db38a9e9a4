"""Host arrays from Buffers, and the CPU backend's reductions.

Every reduction is a left fold in rank order, ``x_0 op x_1 op ... op x_{n-1}``,
computed once per element by exactly one rank and copied to the others, so every
rank gets bit-identical results and a NumPy reference folded the same way matches
exactly.

Precision (documented in docs/cpu-backend.md):

- float16, bfloat16, float8_e4m3fn, float8_e5m2: the fold runs in float32 and the
  result is rounded to the array's dtype once, at the end.
- AVG: the sum divided by the group size (``sum / n``). Integers truncate toward
  zero (as C and NCCL do, not NumPy's floor); integer sums wrap on overflow.
  AVG on bool is refused.
- PREMUL_SUM: each rank's contribution is ``factor * x_r`` (rounded to the
  accumulation dtype), then summed in rank order. Integer arrays need an integral
  factor; bool is refused.
- SUM/PRODUCT/MIN/MAX on bool are logical or/and/and/or (NumPy's own).
- MIN/MAX on complex, and BAND/BOR/BXOR on floats or complex, are refused.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Sequence

import numpy as np

from ..._buffer import Buffer, DType
from ..._reduce_op import PremulSum, ReduceOp, ReduceOpLike

__all__ = ["as_array", "as_bytes", "Reducer", "division", "make_reducer", "op_key", "sig_op", "split_counts"]

Array = np.ndarray[Any, np.dtype[Any]]

_LOW_PRECISION = frozenset({"float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
_BITWISE = {ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}
_ARITH: dict[ReduceOp, Any] = {
    ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum, ReduceOp.PREMUL_SUM: np.add,
}


def as_array(buf: Buffer) -> Array:
    """A flat NumPy view of a host Buffer's memory (no copy)."""
    dt = buf.dtype.numpy()
    if buf.nbytes == 0:
        return np.empty(0, dtype=dt)
    raw = (ctypes.c_char * buf.nbytes).from_address(buf.ptr)
    arr: Array = np.frombuffer(memoryview(raw).cast("B"), dtype=dt)
    return arr


def as_bytes(buf: Buffer) -> memoryview:
    """A writable byte view of a host Buffer's memory (no copy)."""
    if buf.nbytes == 0:
        return memoryview(bytearray(0))
    raw = (ctypes.c_char * buf.nbytes).from_address(buf.ptr)
    return memoryview(raw).cast("B")


class Reducer:
    """Folds per-rank arrays into an output with one ReduceOp, in rank order.

    Args:
        op: the validated reduction.
        dtype: the arrays' element type.
        size: the group size (AVG divides by it).
    """

    def __init__(self, op: ReduceOpLike, dtype: DType, size: int) -> None:
        self.op = op.op if isinstance(op, PremulSum) else op
        self.factor = op.factor if isinstance(op, PremulSum) else None
        self.dtype = dtype.numpy()
        self.size = size
        self.low = dtype.name in _LOW_PRECISION
        self.acc_dtype = np.dtype(np.float32) if self.low else self.dtype
        self.ufunc: Callable[..., Any] = _BITWISE.get(self.op) or _ARITH[self.op]
        self._int_factor: int | None = None
        if self.factor is not None and dtype.kind in "iu":
            self._int_factor = int(self.factor)
        self._check(dtype)
        # The fold is the ufunc alone (no widening, scaling or AVG's division): hot paths
        # call it directly, ``plain(parts[0], parts[1], out=out)`` then one call per part.
        plain = not self.low and self.factor is None and (self.op is not ReduceOp.AVG or size == 1)
        self.plain: Callable[..., Any] | None = self.ufunc if plain else None
        # AVG's division of a float or complex sum (:meth:`finish`).
        self.divide, self.divide_by = division(size, self.acc_dtype)
        # How a folded result is copied to where it goes, ``copy(src, copy_by, out=dst)``
        # (None: memcpy). AVG of a float or complex dtype divides there, bit for bit
        # :meth:`finish` in place, with no pass of its own. float32/64 sums and products
        # are copied as a multiplication by one: the same bits (arithmetic leaves no
        # signalling NaN to quiet; MIN/MAX could pass one through, so they keep memcpy),
        # and on the 2-core VMs here faster than memcpy for blocks another core just wrote.
        self.copy: Callable[..., Any] | None = None
        self.copy_by = 1.0
        if not self.low and self.dtype.kind in "fc":
            if self.op is ReduceOp.AVG:
                if size > 1:
                    self.copy, self.copy_by = self.divide, self.divide_by
            elif self.dtype.kind == "f" and self.dtype.itemsize >= 4 and self.ufunc in (np.add, np.multiply):
                self.copy = np.multiply

    def _check(self, dtype: DType) -> None:
        name = self.op.name
        if self.op in _BITWISE and dtype.kind not in "biu":
            raise TypeError(f"op={name} needs an integer or bool array; got dtype {dtype.name}")
        if self.op in (ReduceOp.MIN, ReduceOp.MAX) and dtype.kind == "c":
            raise TypeError(f"op={name} is not defined for complex dtype {dtype.name}")
        if self.op is ReduceOp.AVG and dtype.kind == "b":
            raise TypeError("op=AVG is not defined for bool arrays; use SUM (logical or) or a numeric dtype")
        if self.op is ReduceOp.PREMUL_SUM:
            if dtype.kind == "b":
                raise TypeError("op=PREMUL_SUM is not defined for bool arrays")
            if dtype.kind in "iu" and not float(self.factor or 0.0).is_integer():
                raise TypeError(f"PREMUL_SUM on integer dtype {dtype.name} needs an integral factor; "
                                f"got factor={self.factor!r}")

    @property
    def needs_scratch(self) -> bool:
        """True when the fold cannot run in the output's own dtype."""
        return self.low

    def contribution(self, x: Array, out: Array | None = None) -> Array:
        """This rank's input as it enters the fold (scaled for PREMUL_SUM, widened for
        low-precision floats). Returns ``x`` itself when nothing changes."""
        if self.factor is None:
            if not self.low:
                return x
            res = out if out is not None else np.empty(x.shape, self.acc_dtype)
            np.copyto(res, x, casting="unsafe")
            return res
        res = out if out is not None else np.empty(x.shape, self.acc_dtype)
        scale: Any = self._int_factor if self._int_factor is not None else self.factor
        if self.low:
            np.copyto(res, x, casting="unsafe")
            np.multiply(res, np.float32(scale), out=res)
        else:
            np.multiply(x, np.asarray(scale).astype(self.acc_dtype), out=res, casting="unsafe")
        return res

    def fold(self, out: Array, parts: Sequence[Array], *, prescaled: bool = False, finish: bool = True) -> None:
        """``out = finish(parts[0] op parts[1] op ...)``, folding left to right.

        Args:
            out: destination, in the arrays' dtype; may alias ``parts[0]`` or ``parts[1]``
                (the first step reads both before it writes), no other part.
            parts: one array per rank in rank order (2 or more), or already widened /
                prescaled contributions when ``prescaled``.
            prescaled: the parts already went through :meth:`contribution`.
            finish: False leaves AVG's division to the copies of ``out`` (only where
                :attr:`copy` is set: the caller copies with it).
        """
        if self.low or (self.factor is not None and not prescaled):
            acc = self.contribution(parts[0]) if not prescaled else np.array(parts[0], dtype=self.acc_dtype)
            for p in parts[1:]:
                q = p if prescaled else self.contribution(p)
                self.ufunc(acc, q, out=acc, casting="unsafe")
            self.finish(acc)
            np.copyto(out, acc, casting="unsafe")
            return
        self.ufunc(parts[0], parts[1], out=out)
        for p in parts[2:]:
            self.ufunc(out, p, out=out)
        if finish or self.copy is None:
            self.finish(out)

    def combine(self, acc: Array, part: Array) -> None:
        """``acc = acc op part`` in place (acc in the accumulation dtype; part as given)."""
        self.ufunc(acc, part, out=acc, casting="unsafe")

    def finish(self, acc: Array) -> None:
        """Apply AVG's division in place (a no-op for other ops)."""
        if self.op is not ReduceOp.AVG or self.size == 1:
            return
        if acc.dtype.kind == "u":
            np.floor_divide(acc, acc.dtype.type(self.size), out=acc)
        elif acc.dtype.kind == "i":
            n = acc.dtype.type(self.size)
            neg_inexact = (acc < 0) & (np.remainder(acc, n) != 0)
            np.floor_divide(acc, n, out=acc)
            np.add(acc, neg_inexact, out=acc, casting="unsafe")
        else:
            self.divide(acc, self.divide_by, out=acc, casting="unsafe")


def division(n: int, dtype: np.dtype[Any]) -> tuple[Callable[..., Any], float]:
    """``x / n`` for ``x`` of ``dtype`` as ``(fn, by)``, ``fn(x, by, out=...)``, bit for bit
    ``np.divide(x, n)``: for a real float dtype and a power of two, a multiplication by the
    inverse (the same exact quotient, rounded once, at half a division's cost or less on
    a block in cache); otherwise the division."""
    if dtype.kind == "f" and n > 0 and n & (n - 1) == 0:
        return np.multiply, 1.0 / n
    return np.divide, float(n)


def make_reducer(op: ReduceOpLike, dtype: DType, size: int) -> Reducer:
    """Validate ``op`` for ``dtype`` and build its :class:`Reducer`.

    Raises:
        TypeError: the op is not defined for the dtype.
    """
    return Reducer(op, dtype, size)


def op_key(op: ReduceOpLike) -> str:
    """A reduction as a cache key (PREMUL_SUM with its factor)."""
    return f"premul({op.factor})" if isinstance(op, PremulSum) else op.name


def sig_op(op: ReduceOpLike) -> str:
    """The reduction as ranks must agree on it: PREMUL_SUM's factor may differ per rank."""
    return op.op.name if isinstance(op, PremulSum) else op.name


def split_counts(a: Array, counts: Sequence[int]) -> list[Array]:
    """``a`` cut into consecutive pieces of ``counts`` elements."""
    offs = np.concatenate(([0], np.cumsum(np.asarray(counts, dtype=np.int64))))
    return [a[int(offs[k]):int(offs[k + 1])] for k in range(len(counts))]
