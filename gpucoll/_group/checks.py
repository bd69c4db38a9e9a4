"""The checks every rank makes alike before a backend sees a call (no communication)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from .._buffer import DTYPES, Buffer, DType
from .._reduce_op import PremulSum, ReduceOp, ReduceOpLike, as_reduce_op

__all__ = ["_check_op", "_same_layout", "_real_view", "_row_elems", "_splits", "_op_name", "_InitTwiceError",
           "_RankError", "_SizeError", "_size_error", "_DTYPES_DIFFER",
           "_coalesced_dtypes", "_list_dtypes", "_one_dtype"]


class _InitTwiceError(ValueError, RuntimeError):
    """A second init_process_group: torch's ValueError, and RuntimeError (a state error,
    gpucoll's type before)."""


class _RankError(RuntimeError, ValueError):
    """A rank outside [0, world_size) at init: torch's RuntimeError, and ValueError (a bad argument)."""


def _op_name(red: Any) -> str:
    if red is None:
        return ""
    name = getattr(red, "name", None)
    return str(name) if name is not None else type(red).__name__


class _SizeError(ValueError, RuntimeError):
    """A list or array whose size does not fit the group: ValueError (a bad argument) and
    RuntimeError, as torch's C++ checks raise it."""


_TORCH_WORDS = {
    # the words torch's process groups (its fake backend's, which its tests match) lead with
    "scatter_list": "Incorrect input list size",
    "input_list": "invalid input tensor list size, must be world size",
    "output_tensor_list": "Size of output tensor list does not match world size",
    "input_tensor_list": "Size of input tensor list does not match world size",
    "input": "input tensor must be the same size as output size times world size",
    "output_tensor": "output tensor must be the same size as input size times world size",
    "output_tensor_lists": "invalid output size",
}


def _size_error(name: str, detail: str) -> _SizeError:
    """A _SizeError for argument ``name``: torch's words for it first, then ``detail``."""
    lead = _TORCH_WORDS.get(name.split("[", 1)[0])
    return _SizeError(f"{lead}: {detail}" if lead else detail)


# ----- local validation, same on every rank -----

_OP_KINDS: dict[ReduceOp, tuple[str, str]] = {
    # op: (dtype kinds it is defined for, the error otherwise); SUM: every kind.
    ReduceOp.BAND: ("biu", "op={op} needs integer or bool arrays; got dtype {dtype}"),
    ReduceOp.BOR: ("biu", "op={op} needs integer or bool arrays; got dtype {dtype}"),
    ReduceOp.BXOR: ("biu", "op={op} needs integer or bool arrays; got dtype {dtype}"),
    ReduceOp.MIN: ("biuf", "op={op} is undefined for complex dtype {dtype} (no ordering)"),
    ReduceOp.MAX: ("biuf", "op={op} is undefined for complex dtype {dtype} (no ordering)"),
    ReduceOp.PRODUCT: ("biuf", "op={op} is refused for complex dtype {dtype}, as torch refuses it (and NCCL "
                               "has no complex product)"),
    ReduceOp.AVG: ("iufc", "op={op} is undefined for bool arrays"),
    ReduceOp.PREMUL_SUM: ("fc", "op={op} needs floating-point or complex arrays; got dtype {dtype}"),
}
"""The group's dtype-kind x op table (kinds: b bool, i/u integers, f floats, c complex),
checked on every rank before any backend sees the op; complex arrays take the ops
torch allows on them (SUM, AVG, PREMUL_SUM), on every backend alike. A backend may
refuse more (its own table): docs/design.md, "As built"."""


class _ComplexOpError(ValueError, TypeError):
    """An op undefined on complex arrays: ValueError as torch raises it ("all_reduce does
    not support ... on complex tensors"), and TypeError like gpucoll's other op x dtype
    refusals."""


def _check_op(op: Any, dtype: DType) -> ReduceOpLike:
    if op is ReduceOp.SUM:
        return op
    checked = as_reduce_op(op)
    base = checked.op if isinstance(checked, PremulSum) else checked
    rule = _OP_KINDS.get(base)
    if rule is not None and dtype.kind not in rule[0]:
        detail = rule[1].format(op=base.name, dtype=dtype.name)
        if dtype.kind == "c":
            # torch's words lead (its check is in all_reduce; the same table serves every reduction)
            raise _ComplexOpError(f"all_reduce does not support ReduceOp.{base.name} on complex tensors: {detail}")
        raise TypeError(detail)
    return checked


_DTYPES_DIFFER = "Invalid usage of tensors with different dtypes"
"""torch's words for arrays of one call whose dtypes must match and do not."""


def _real_view(buf: Buffer) -> Buffer:
    """A complex array as its real view (complex64 = 2 x float32, last dimension 2), as
    torch's data-movement collectives treat complex tensors; other arrays unchanged."""
    if buf.dtype.kind != "c":
        return buf
    real = DTYPES["float32" if buf.dtype.name == "complex64" else "float64"]
    return replace(buf, dtype=real, shape=(*buf.shape, 2))


def _same_layout(buf: Buffer, ref: Buffer, name: str, ref_name: str, views: bool = False) -> None:
    """``buf`` must have ``ref``'s dtype and size (ValueError, torch's type); with
    ``views`` (data movement) a complex array matches its real view."""
    a, b = (_real_view(buf).dtype, _real_view(ref).dtype) if views else (buf.dtype, ref.dtype)
    if a != b:
        also = " (or its real view)" if views and ref.dtype.kind == "c" else ""
        raise ValueError(f"{_DTYPES_DIFFER}: {name} has dtype {buf.dtype.name} but {ref_name} has {ref.dtype.name}{also}; "
                         "they must match")
    if buf.nbytes != ref.nbytes:
        raise ValueError(f"{name} has shape {buf.shape} ({buf.numel} elements) but {ref_name} has shape "
                         f"{ref.shape} ({ref.numel} elements); they must match")


def _one_dtype(bufs: Sequence[Buffer], names: Sequence[str], op: str) -> tuple[list[Buffer], list[str]]:
    """The arrays of a list reduced as one op, each memory once, with their names.

    Every array must have the first one's dtype (a complex array counts as its real
    view), as torch checks: ValueError with torch's words. An array listed twice (the
    same memory: ``2 * [x]``) is reduced once, as torch's flatten-reduce-unflatten gives
    it; arrays that overlap otherwise are refused (ValueError), as no order of in-place
    reductions gives a defined result."""
    want = _real_view(bufs[0]).dtype
    seen: dict[tuple[int, int, Any], str] = {}
    out_bufs: list[Buffer] = []
    out_names: list[str] = []
    for name, buf in zip(names, bufs):
        if _real_view(buf).dtype != want:
            raise ValueError(f"{_DTYPES_DIFFER}: {name} has dtype {buf.dtype.name} but {names[0]} has "
                             f"{bufs[0].dtype.name}; {op} needs one dtype")
        key = (buf.ptr, buf.nbytes, buf.device)
        if key in seen:
            continue  # the same memory again: its one reduction serves both entries
        for (ptr, nbytes, device), other in seen.items():
            if device == buf.device and buf.nbytes and nbytes and ptr < buf.ptr + buf.nbytes and buf.ptr < ptr + nbytes:
                raise ValueError(f"{op}: {name} overlaps {other} in memory (not the same array twice); "
                                 "each array of the list must be its own memory, or the very same array")
        seen[key] = name
        out_bufs.append(buf)
        out_names.append(name)
    return out_bufs, out_names


class _DtypeError(ValueError):
    """Raised by the tolerant pre-checks below (which let other errors through)."""


def _list_dtypes(arrays: Any, ref: Buffer, name: str, ref_name: str) -> Buffer:
    """Every array of ``arrays`` has ``ref``'s dtype (real views of complex arrays compared),
    checked on every rank before any rank-role check, as torch does (gather, scatter).
    Returns ``ref``."""
    from .. import array as _array

    if not arrays or isinstance(arrays, (str, bytes)) or not hasattr(arrays, "__iter__"):
        return ref
    want = _real_view(ref).dtype
    for i, t in enumerate(arrays):
        try:
            got = _real_view(_array.as_buffer(t, name=f"{name}[{i}]")).dtype
        except (TypeError, ValueError):
            return ref  # not an array: the caller's own checks name it
        if got != want:
            raise _DtypeError(f"{_DTYPES_DIFFER}: {name}[{i}] has dtype {got.name} but {ref_name} has "
                              f"{ref.dtype.name}; they must match")
    return ref


def _coalesced_dtypes(output_lists: Any, input_list: Any) -> None:
    """all_gather_coalesced: ``output_lists[r][k]`` must have ``input_list[k]``'s dtype (real
    views of complex arrays compared), checked before the list lengths, as torch does.
    Anything that is not a list of arrays is left to the caller's own checks."""
    from .. import array as _array

    try:
        ins = [_real_view(_array.as_buffer(t, name="input")).dtype for t in input_list]
        for r, row in enumerate(output_lists):
            for k, t in enumerate(list(row)[:len(ins)]):
                got = _real_view(_array.as_buffer(t, name="output")).dtype
                if got != ins[k]:
                    raise _DtypeError(f"{_DTYPES_DIFFER}: output_tensor_lists[{r}][{k}] has dtype {got.name} but "
                                      f"input_tensor_list[{k}] has {ins[k].name}; they must match")
    except _DtypeError:
        raise
    except (TypeError, ValueError):
        return


def _row_elems(buf: Buffer, name: str) -> int:
    if not buf.shape:
        raise ValueError(f"{name} must have at least one dimension to be split along dim 0; got a 0-d array")
    row = 1
    for s in buf.shape[1:]:
        row *= s
    return row


def _splits(sizes: Sequence[int] | None, dim0: int, n: int, name: str, tensor: str) -> list[int]:
    if sizes is None or len(sizes) == 0:
        if dim0 % n:
            raise _SizeError(f"Tensor's dim 0 does not divide equally across group size: {tensor} has {dim0} "
                             f"rows along dim 0, not divisible by the group size {n}; pass {name}")
        return [dim0 // n] * n
    out = list(sizes)
    if len(out) != n or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in out):
        lead = "Number of tensor splits not equal to group size: " if len(out) != n else ""
        raise _SizeError(f"{lead}{name} must be {n} non-negative ints (one per rank); got {sizes!r}")
    if sum(out) != dim0:
        raise _SizeError(f"Split sizes doesn't match total dim 0 size: {name}={out} sums to {sum(out)} but "
                         f"{tensor} has {dim0} rows along dim 0")
    return out


# ----- arguments of new groups (new_group, split_group, new_subgroups) -----

def _check_desc(group_desc: Any) -> str:
    if group_desc is not None and not isinstance(group_desc, str):
        raise TypeError(f"group_desc must be a str or None; got {type(group_desc).__name__}")
    return group_desc or ""


def _check_ranks(ranks: Any, world_size: int, name: str) -> list[int]:
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise TypeError(f"{name} must be a list of ints; got {type(ranks).__name__}")
    out = list(ranks)
    for r in out:
        if isinstance(r, bool) or not isinstance(r, int):
            raise ValueError(f"{name} holds {r!r}, which is not a rank in [0, {world_size})")
        if not 0 <= r < world_size:
            raise ValueError(f"Rank {r} is out of range. Valid ranks are 0 to {world_size - 1} "
                             f"(world_size={world_size}): {name} holds {r}, which is not a rank in [0, {world_size})")
    if len(set(out)) != len(out):
        raise ValueError(f"{name} holds duplicate ranks: {out}")
    if not out:
        raise ValueError(f"{name} must not be empty")
    return out


def _ranks_label(ranks: Sequence[int]) -> str:
    """A name for a set of global ranks: the ranks themselves, or for many a digest of them."""
    if len(ranks) <= 8:
        return "_".join(map(str, ranks))
    import hashlib

    return f"{ranks[0]}-{ranks[-1]}x{len(ranks)}-{hashlib.sha1(repr(list(ranks)).encode()).hexdigest()[:16]}"
