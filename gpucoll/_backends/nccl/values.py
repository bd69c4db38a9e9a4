"""The values NCCL takes from us, encoded: unique ids (as CuPy's binding takes them) and
PREMUL_SUM factors (one element of the reduction's dtype)."""

from __future__ import annotations

import struct
from typing import Any, Callable

from ..._buffer import DType

__all__ = ["normalise_unique_id", "comm_id_arg", "encode_scalar"]

_UNIQUE_ID_BYTES = 128


# ----- unique ids -----

def normalise_unique_id(uid: Any) -> bytes:
    """``get_unique_id()``'s answer as 128 bytes: CuPy >= 14 returns bytes, older CuPy a
    tuple of signed chars."""
    if isinstance(uid, (bytes, bytearray, memoryview)):
        out = bytes(uid)
    elif isinstance(uid, (tuple, list)):
        out = bytes((int(c) & 0xFF) for c in uid)
    else:
        raise TypeError(f"an NCCL unique id must be bytes or a tuple of ints; got {type(uid).__name__}")
    if len(out) != _UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {_UNIQUE_ID_BYTES} bytes; got {len(out)}")
    return out


def comm_id_arg(uid: bytes, cupy_version: str) -> bytes | tuple[int, ...]:
    """The unique id in the form ``NcclCommunicator(ndev, commId, rank)`` takes: bytes
    from CuPy 14 on, a tuple of signed chars before."""
    major = int(str(cupy_version).split(".", 1)[0] or 0)
    if major >= 14:
        return uid
    return tuple(b - 256 if b > 127 else b for b in uid)


# ----- PREMUL_SUM factors -----

def _bfloat16_bits(value: float) -> int:
    bits = int(struct.unpack("<I", struct.pack("<f", value))[0])
    if (bits & 0x7F800000) == 0x7F800000 and bits & 0x7FFFFF:
        return 0x7FC0  # NaN
    # Round to nearest, ties to even, as the hardware conversion does.
    bits += 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16) & 0xFFFF


_SCALAR_ENCODERS: dict[str, Callable[[float], bytes]] = {
    "float64": lambda v: struct.pack("<d", v),
    "float32": lambda v: struct.pack("<f", v),
    "float16": lambda v: struct.pack("<e", v),
    "bfloat16": lambda v: struct.pack("<H", _bfloat16_bits(v)),
}


def encode_scalar(factor: float, dtype: DType) -> bytes:
    """``factor`` as one element of ``dtype`` (a float type), little-endian, for
    ``ncclRedOpCreatePreMulSum``.

    Raises:
        TypeError: ``dtype`` is not a floating type, or a float8 type without ml_dtypes.
        ValueError: ``factor`` does not fit in ``dtype``.
    """
    enc = _SCALAR_ENCODERS.get(dtype.name)
    if enc is not None:
        try:
            return enc(float(factor))
        except (OverflowError, struct.error) as exc:
            raise ValueError(f"PREMUL_SUM factor {factor!r} is out of range for {dtype.name}") from exc
    if dtype.name in ("float8_e4m3fn", "float8_e5m2"):
        import numpy as np

        try:
            np_dtype = dtype.numpy()
        except TypeError as exc:
            raise TypeError(f"PREMUL_SUM on {dtype.name} needs ml_dtypes to encode the factor "
                            "(pip install ml_dtypes)") from exc
        encoded: bytes = np.asarray(factor, dtype=np.float32).astype(np_dtype).tobytes()
        return encoded
    raise TypeError(f"PREMUL_SUM factor cannot be encoded as {dtype.name}")
