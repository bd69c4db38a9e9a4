"""The result check (``-c``): deterministic inputs per rank, the exact expected output, mismatch count.

Every rank computes the inputs of every other rank itself (they depend only on
rank, position and seed), so it knows the exact output it should receive
without any communication, as nccl-tests does. Inputs are chosen so that the
expected value is exactly representable in every datatype, float8 included:

- data movement (all_gather, broadcast, alltoall, gather, scatter, sendrecv):
  hashed bit patterns, compared byte for byte. Float types never get an
  all-ones exponent (no NaN or Inf) so that no conversion could alter them.
- sum, avg, premulsum: small non-negative integers whose total over all ranks
  stays within the datatype's exact-integer range (``exact_limit``); when the
  world is larger than that range, 0/1 values with a bounded number of ones.
- prod: ones and twos with at most six twos per element (products <= 64).
- max, min: small integers, negative ones too for signed and float types.
- band, bor, bxor: hashed bits (integer types only).

The comparison is exact except for ``avg`` on float types, whose result is
``sum/n`` rounded by the backend (NCCL multiplies by ``1/n`` before summing);
there an element is wrong when it is further than ``(n + 1)`` units of the
datatype's epsilon (relative, at least 1) from ``sum/n``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .ops import Layout, OpSpec

__all__ = ["np_dtype", "exact_limit", "Expected", "make_input", "make_expected", "count_wrong", "corrupt"]

_EPS = {
    "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "float64": 2.0 ** -52,
    "float8_e4m3fn": 2.0 ** -3, "float8_e5m2": 2.0 ** -2,
}
"""Machine epsilon of the float types (NumPy's finfo does not know the ml_dtypes ones)."""
_EXACT_FLOAT_LIMIT = {name: int(2 / eps) for name, eps in _EPS.items()}
_MASK64 = (1 << 64) - 1


def exact_limit(dtype: str) -> int:
    """The largest L such that every integer 0..L is exactly representable in ``dtype``
    (capped at 2**62 so that int64 arithmetic on expected values cannot overflow)."""
    if dtype in _EXACT_FLOAT_LIMIT:
        return _EXACT_FLOAT_LIMIT[dtype]
    info = np.iinfo(np.dtype(dtype))
    return int(min(int(info.max), 1 << 62))


def np_dtype(dtype: str) -> np.dtype[Any]:
    """The NumPy dtype of a gpucoll dtype name (ml_dtypes for bfloat16 and float8)."""
    from .._buffer import dtype_by_name

    return dtype_by_name(dtype).numpy()


def _is_float(dtype: str) -> bool:
    return dtype in _EXACT_FLOAT_LIMIT


def _mix(words: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """splitmix64's finaliser: every input bit affects every output bit (wraps silently)."""
    z = words
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    mixed: np.ndarray[Any, Any] = z ^ (z >> np.uint64(31))
    return mixed


def _hash_words(rank: int, seed: int, first: int, count: int) -> np.ndarray[Any, Any]:
    salt = np.uint64(((rank + 1) * 0x9E3779B97F4A7C15 + seed * 0xD1B54A32D192ED03) & _MASK64)
    return _mix(np.arange(first, first + count, dtype=np.uint64) + salt)


def _pattern(dtype: str, rank: int, seed: int, start: int, count: int) -> np.ndarray[Any, Any]:
    """Rank ``rank``'s bit pattern for elements ``start .. start+count`` as raw bytes (count, itemsize)."""
    npd = np_dtype(dtype)
    isz = npd.itemsize
    b0, nbytes = start * isz, count * isz
    w0 = b0 // 8
    words = _hash_words(rank, seed, w0, (b0 + nbytes + 7) // 8 - w0)
    raw: np.ndarray[Any, Any] = words.view(np.uint8)[b0 - w0 * 8: b0 - w0 * 8 + nbytes].reshape(count, isz).copy()
    if _is_float(dtype):
        raw[:, isz - 1] &= 0xBF  # top exponent bit off: never NaN or Inf
    return raw


def _red_values(dtype: str, redop: str, rank: int, n: int, seed: int, start: int,
                count: int) -> np.ndarray[Any, Any]:
    """Rank ``rank``'s input values (int64) for a reduction, elements ``start .. start+count``."""
    i = np.arange(start, start + count, dtype=np.int64) + seed
    limit = exact_limit(dtype)
    if redop in ("sum", "avg", "premulsum"):
        budget = max(1, limit // 2 if redop == "premulsum" else limit)
        top = min(budget // n, 16)
        if top >= 1:
            return (i + 5 * rank) % (top + 1)
        # More ranks than exact integers: 0/1 inputs with (i % budget) + 1 ones per element.
        return ((i + rank) % n < (i % budget) + 1).astype(np.int64)
    if redop == "prod":
        return np.where((i + rank) % n < i % 7, 2, 1).astype(np.int64)
    if redop in ("max", "min"):
        top = min(limit, 100)
        v = (i * 7 + rank * 13) % (top + 1)
        signed = _is_float(dtype) or np.issubdtype(np.dtype(dtype), np.signedinteger)
        return v - top // 2 if signed else v
    if redop in ("band", "bor", "bxor"):
        bits = np.dtype(dtype).itemsize * 8
        width = min(bits - 1 if np.issubdtype(np.dtype(dtype), np.signedinteger) else bits, 62)
        h = _hash_words(rank, seed, start, count)
        bits_out: np.ndarray[Any, Any] = (h & np.uint64((1 << width) - 1)).astype(np.int64)
        return bits_out
    raise ValueError(f"no check inputs for reduction {redop!r}")


def _reduce_all(dtype: str, redop: str, n: int, seed: int, start: int, count: int) -> np.ndarray[Any, Any]:
    acc = _red_values(dtype, redop, 0, n, seed, start, count)
    for r in range(1, n):
        v = _red_values(dtype, redop, r, n, seed, start, count)
        if redop in ("sum", "avg", "premulsum"):
            acc += v
        elif redop == "prod":
            acc *= v
        elif redop == "max":
            np.maximum(acc, v, out=acc)
        elif redop == "min":
            np.minimum(acc, v, out=acc)
        elif redop == "band":
            acc &= v
        elif redop == "bor":
            acc |= v
        else:
            acc ^= v
    return acc


def _as_dtype(values: np.ndarray[Any, Any], dtype: str) -> np.ndarray[Any, Any]:
    npd = np_dtype(dtype)
    if _is_float(dtype):
        return values.astype(np.float64).astype(npd)  # exact: every value is in range
    return values.astype(npd)


def make_input(spec: OpSpec, dtype: str, redop: str | None, rank: int, n: int, layout: Layout,
               seed: int) -> np.ndarray[Any, Any]:
    """This rank's input (``layout.send_count`` elements of ``dtype``) for a checked run."""
    count = layout.send_count
    if spec.reduces:
        assert redop is not None
        return _as_dtype(_red_values(dtype, redop, rank, n, seed, 0, count), dtype)
    return _pattern(dtype, rank, seed, 0, count).reshape(-1).view(np_dtype(dtype))


@dataclass(frozen=True)
class Expected:
    """What one rank's output must hold.

    ``raw`` is (elements, itemsize) bytes for data movement; else ``values`` (int64, or
    float64 for float types) with ``tolerance`` (None: exact).
    """

    dtype: str
    raw: np.ndarray[Any, Any] | None = None
    values: np.ndarray[Any, Any] | None = None
    rel_tolerance: float | None = None


def make_expected(spec: OpSpec, dtype: str, redop: str | None, rank: int, n: int, root: int,
                  layout: Layout, seed: int) -> Expected:
    """The output this rank must receive (``layout.recv_count`` elements)."""
    per = layout.param_count
    name = spec.name
    if spec.reduces:
        assert redop is not None
        start = rank * per if name == "reduce_scatter" else 0
        total = _reduce_all(dtype, redop, n, seed, start, layout.recv_count)
        if redop == "premulsum":
            from .options import PREMUL_FACTOR

            total = total * int(PREMUL_FACTOR)
        if redop == "avg":
            if _is_float(dtype):
                return Expected(dtype, values=total.astype(np.float64) / n,
                                rel_tolerance=(n + 1) * _EPS[dtype])
            return Expected(dtype, values=total // n)  # inputs are >= 0: floor == trunc
        return Expected(dtype, values=total.astype(np.float64) if _is_float(dtype) else total)
    if name in ("all_gather", "gather"):
        raw = np.concatenate([_pattern(dtype, j, seed, 0, per) for j in range(n)])
    elif name == "alltoall":
        raw = np.concatenate([_pattern(dtype, j, seed, rank * per, per) for j in range(n)])
    elif name == "scatter":
        raw = _pattern(dtype, root, seed, rank * per, per)
    elif name == "broadcast":
        raw = _pattern(dtype, root, seed, 0, layout.recv_count)
    elif name == "sendrecv":
        raw = _pattern(dtype, (rank - 1) % n, seed, 0, layout.recv_count)
    else:
        raise ValueError(f"no expected output for op {name!r}")
    return Expected(dtype, raw=raw)


def count_wrong(got: np.ndarray[Any, Any], expected: Expected) -> int:
    """Number of elements of ``got`` (host array of the op's dtype) that differ from ``expected``."""
    flat = np.ascontiguousarray(got).reshape(-1)
    if expected.raw is not None:
        isz = expected.raw.shape[1] if expected.raw.ndim == 2 else 1
        if flat.size != expected.raw.shape[0]:
            raise ValueError(f"output has {flat.size} elements; expected {expected.raw.shape[0]}")
        mine = flat.view(np.uint8).reshape(-1, isz)
        return int(np.count_nonzero((mine != expected.raw).any(axis=1)))
    assert expected.values is not None
    if flat.size != expected.values.size:
        raise ValueError(f"output has {flat.size} elements; expected {expected.values.size}")
    if _is_float(expected.dtype):
        mine_f = flat.astype(np.float64)
        if expected.rel_tolerance is None:
            return int(np.count_nonzero(mine_f != expected.values))
        scale = np.maximum(np.abs(expected.values), 1.0)
        bad = ~(np.abs(mine_f - expected.values) <= expected.rel_tolerance * scale)
        return int(np.count_nonzero(bad))
    return int(np.count_nonzero(flat.astype(np.int64) != expected.values))


def corrupt(raw_bytes: Any, itemsize: int) -> None:
    """Test hook: flip the second-highest bit of element 0 in place (a byte view of the output).

    That bit is the top exponent bit of every float type and a high value bit of every
    integer type, so the element is wrong however it is compared.
    """
    raw_bytes[itemsize - 1] ^= 0x40
