"""The one reduction oracle of the tests (CPU backend, process groups, NCCL on the fake
GPU and on a real one), and the one dtype-name -> NumPy dtype helper.

Independent of the library: the expected result of every (dtype, op) is computed here
from its definition (docs/nccl-backend.md and docs/cpu-backend.md, "Reductions").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpucoll._buffer import DTYPES
from gpucoll._reduce_op import PremulSum, ReduceOp, make_premul_sum


def np_dtype(name: str) -> np.dtype[Any]:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        found: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name))
        return found


DTYPE_NAMES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
               "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
               "float8_e4m3fn", "float8_e5m2"]
OPS: list[Any] = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX,
                  ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR, make_premul_sum(0.5), make_premul_sum(3.0)]


def defined(name: str, op: Any, fp8: bool = True) -> bool:
    """Whether (dtype, op) is a defined reduction (docs/nccl-backend.md, Reductions)."""
    kind = DTYPES[name].kind
    base = op.op if isinstance(op, PremulSum) else op
    if base in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        return kind in "biu"
    if kind == "b":
        return base not in (ReduceOp.AVG, ReduceOp.PREMUL_SUM)
    if kind == "c":
        return base in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM)
    if name.startswith("float8"):
        return fp8
    if kind in "iu" and base is ReduceOp.PREMUL_SUM:
        return float(op.factor).is_integer()
    return True


def make_input(name: str, n: int, rank: int, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s input: small values (exact in every float type), different on
    every rank, negative ones for signed types."""
    i = np.arange(n)
    dt = np_dtype(name)
    out: np.ndarray
    if name == "bool":
        out = (i * 7 + rank * 2 + salt) % 3 == 0  # differs between ranks 0, 1, 2
    elif DTYPES[name].kind in "iu":
        ints = (i * 5 + rank * 3 + salt) % 7 - (3 if DTYPES[name].kind == "i" else 0)
        out = ints.astype(dt)
    else:
        v = ((i * 3 + rank * 5 + salt) % 9 - 4) * 0.5
        out = (v + 1j * v[::-1]).astype(dt) if DTYPES[name].kind == "c" else v.astype(dt)
    return out


LOW_PRECISION = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def as_op(op: Any) -> Any:
    """``op`` as a ReduceOp or a premultiplied sum; a name is looked up in ReduceOp, and
    "PREMUL_SUM" stands for ``make_premul_sum(0.5)``."""
    if isinstance(op, str):
        return make_premul_sum(0.5) if op == "PREMUL_SUM" else ReduceOp[op]
    return op


def reference(ins: list[np.ndarray], name: str, op: Any, size: int | None = None) -> np.ndarray:
    """The reduction of ``ins`` by ``op`` as the docs define it: a fold in rank order.

    Low-precision floats accumulate in float32 and are rounded once at the end; every
    other type accumulates in itself (integers wrap); bool folds logically (SUM/MAX/BOR
    are "or", PRODUCT/MIN/BAND "and", BXOR "xor"); AVG divides by ``size`` (default
    ``len(ins)``), truncating toward zero for integers, as C does; PREMUL_SUM scales every
    input by the factor first. The CPU backend promises this bit for bit; the NCCL
    backend within :func:`close`'s tolerance (its order of summation is a ring's).
    """
    op = as_op(op)
    base = op.op if isinstance(op, PremulSum) else op
    n = len(ins) if size is None else size
    dt = np_dtype(name)
    acc_t = np.dtype(np.float32) if name in LOW_PRECISION else dt
    vals = [np.asarray(x).astype(acc_t) for x in ins]
    if base is ReduceOp.PREMUL_SUM:
        # An integral factor for integer types, wrapped into the type as NCCL's scalar is.
        factor = np.asarray(int(op.factor)).astype(acc_t) if acc_t.kind in "iu" else acc_t.type(op.factor)
        vals = [np.multiply(v, factor, dtype=acc_t) for v in vals]
        base = ReduceOp.SUM
    fn: Any = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PRODUCT: np.multiply,
               ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum, ReduceOp.BAND: np.bitwise_and,
               ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}[base]
    acc = vals[0].copy()
    for v in vals[1:]:
        acc = fn(acc, v).astype(acc_t)
    if base is ReduceOp.AVG:
        if acc_t.kind in "iu":
            acc = np.where(acc < 0, -((-acc) // n), acc // n).astype(acc_t)
        else:
            acc = (acc / acc_t.type(n)).astype(acc_t)
    out: np.ndarray = acc.astype(dt)
    return out


def close(got: np.ndarray, want: np.ndarray, name: str) -> bool:
    if DTYPES[name].kind in "biu":
        return bool(np.array_equal(got, want))
    tol = {"float16": 1e-2, "bfloat16": 2e-2, "float8_e4m3fn": 0.13, "float8_e5m2": 0.26}.get(name, 1e-6)
    a = got.astype(np.complex128 if DTYPES[name].kind == "c" else np.float64)
    b = want.astype(a.dtype)
    return bool(np.allclose(a, b, rtol=tol, atol=tol))


