"""Reference reductions in NumPy for the NCCL backend's tests (CPU fake and GPU).

Independent of the backend: the expected result of every (dtype, op) is computed
here from its definition (docs/nccl-backend.md, "Reductions"), folding the ranks'
inputs in rank order, in a wide type for floats.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpucoll._buffer import DTYPES
from gpucoll._reduce_op import ReduceOp, make_premul_sum


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
    base = op.op if not isinstance(op, ReduceOp) else op
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


def reference(ins: list[np.ndarray], name: str, op: Any, size: int) -> np.ndarray:
    """The reduction of ``ins`` (rank order) by ``op`` as ``name`` defines it."""
    dt = np_dtype(name)
    out: np.ndarray
    fn: Any
    kind = DTYPES[name].kind
    base = op if isinstance(op, ReduceOp) else op.op
    stack = np.stack(ins)
    if kind == "b":
        fn = {ReduceOp.SUM: np.logical_or, ReduceOp.MAX: np.logical_or, ReduceOp.BOR: np.logical_or,
              ReduceOp.PRODUCT: np.logical_and, ReduceOp.MIN: np.logical_and, ReduceOp.BAND: np.logical_and,
              ReduceOp.BXOR: np.logical_xor}[base]
        out = fn.reduce(stack, axis=0)
        return out
    if kind in "iu":
        if base is ReduceOp.PREMUL_SUM:
            stack = np.multiply(stack, np.asarray(int(op.factor)).astype(dt), dtype=dt)
            base = ReduceOp.SUM
        fn = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PRODUCT: np.multiply, ReduceOp.MIN: np.minimum,
              ReduceOp.MAX: np.maximum, ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or,
              ReduceOp.BXOR: np.bitwise_xor}[base]
        out = fn.reduce(stack, axis=0, dtype=dt)
        if base is ReduceOp.AVG:  # truncate toward zero, as C does
            out = np.array([(abs(int(v)) // size) * (1 if v >= 0 else -1) for v in out]).astype(dt)
        return out
    wide = stack.astype(np.complex128 if kind == "c" else np.float64)
    if base is ReduceOp.PREMUL_SUM:
        wide, base = wide * op.factor, ReduceOp.SUM
    fn = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PRODUCT: np.multiply,
          ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}[base]
    out = fn.reduce(wide, axis=0)
    if base is ReduceOp.AVG:
        out = out / size
    return out.astype(dt)


def close(got: np.ndarray, want: np.ndarray, name: str) -> bool:
    if DTYPES[name].kind in "biu":
        return bool(np.array_equal(got, want))
    tol = {"float16": 1e-2, "bfloat16": 2e-2, "float8_e4m3fn": 0.13, "float8_e5m2": 0.26}.get(name, 1e-6)
    a = got.astype(np.complex128 if DTYPES[name].kind == "c" else np.float64)
    b = want.astype(a.dtype)
    return bool(np.allclose(a, b, rtol=tol, atol=tol))


