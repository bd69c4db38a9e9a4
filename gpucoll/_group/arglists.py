"""A group's checks of argument lists and point-to-point arguments (the same on every
rank, before any backend sees the call): one array per rank laid out like a reference,
chunked arrays, ranks and tags."""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from .. import array as _array
from .._buffer import Buffer
from .checks import _DTYPES_DIFFER, _coalesced_dtypes, _real_view, _row_elems, _same_layout, _size_error, _splits

__all__ = ["TAG_MAX", "_list_like", "_uneven_list", "_check_chunked", "_p2p_check", "_coalesced_lists", "_split_counts",
           "_a2a_lists", "_check_rank"]

TAG_MAX = 2**31 - 1
"""The largest point-to-point tag (torch's tags are C ints; negative ones are refused)."""


def _check_rank(size: int, group_name: str, r: Any, name: str) -> int:
    if isinstance(r, bool) or not isinstance(r, int):
        raise TypeError(f"{name} must be an int (a rank of group {group_name!r}); "
                        f"got {type(r).__name__} {r!r}")
    if not 0 <= r < size:
        raise ValueError(f"{name}={r!r} is out of range for group {group_name!r} of size {size}")
    return r


class _Group(Protocol):
    _rank: int
    _size: int
    group_name: str

    def _check_rank(self, r: Any, name: str) -> int: ...


def _list_like(pg: _Group, arrays: Sequence[Any], name: str, ref: Buffer, ref_name: str,
               writable: bool, views: bool = False) -> list[Buffer]:
    """``arrays`` as Buffers: one per rank, each laid out like ``ref``; with ``views``
    (data movement) complex arrays match, and are returned as, their real views."""
    if isinstance(arrays, (str, bytes)) or not hasattr(arrays, "__len__"):
        raise TypeError(f"{name} must be a list of {pg._size} arrays; got {type(arrays).__name__}")
    if len(arrays) != pg._size:
        raise _size_error(name, f"{name} must have {pg._size} arrays (one per rank of group "
                          f"{pg.group_name!r}); got {len(arrays)}")
    bufs = []
    for i, a in enumerate(arrays):
        b = _array.as_buffer(a, name=f"{name}[{i}]", writable=writable)
        _same_layout(b, ref, f"{name}[{i}]", ref_name, views)
        bufs.append(_real_view(b) if views else b)
    return bufs

def _uneven_list(pg: _Group, arrays: Sequence[Any], name: str, own: Buffer, own_name: str) -> list[Buffer]:
    """One array per rank, all of ``own``'s dtype; ``arrays[rank]`` laid out like ``own``,
    the others of any size (rank i's chunk: the same size on every rank, which the
    backend checks across ranks)."""
    if isinstance(arrays, (str, bytes)) or not hasattr(arrays, "__len__"):
        raise TypeError(f"{name} must be a list of {pg._size} arrays; got {type(arrays).__name__}")
    if len(arrays) != pg._size:
        raise _size_error(name, f"{name} must have {pg._size} arrays (one per rank of group "
                          f"{pg.group_name!r}); got {len(arrays)}")
    bufs = [_array.as_buffer(a, name=f"{name}[{i}]") for i, a in enumerate(arrays)]
    for i, b in enumerate(bufs):
        if b.dtype != own.dtype:
            raise ValueError(f"{_DTYPES_DIFFER}: {name}[{i}] has dtype {b.dtype.name} but {own_name} has "
                             f"{own.dtype.name}; "
                             "they must match")
    _same_layout(bufs[pg._rank], own, f"{name}[{pg._rank}] (this rank's chunk)", own_name)
    return bufs

def _check_chunked(pg: _Group, whole: Buffer, part: Buffer, whole_name: str, part_name: str) -> None:
    if whole.dtype != part.dtype:
        raise ValueError(f"{_DTYPES_DIFFER}: {whole_name} has dtype {whole.dtype.name} but {part_name} has "
                         f"{part.dtype.name}; "
                        "they must match")
    if whole.nbytes != part.nbytes * pg._size:
        raise _size_error(whole_name, f"{whole_name} (shape {whole.shape}) must hold exactly group size x "
                          f"{part_name} = {pg._size} x {part.numel} elements; got {whole.numel}")

def _p2p_check(pg: _Group, tensor: Any, peer: int | None, tag: int, name: str, writable: bool) -> Buffer:
    if peer is not None:
        pg._check_rank(peer, name)
        if peer == pg._rank:
            raise ValueError(f"{name}={peer} is this rank itself; send/recv need another rank")
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"tag must be an int; got {type(tag).__name__} {tag!r}")
    if not 0 <= tag <= TAG_MAX:
        raise ValueError(f"tag={tag} is out of range: a tag must be in [0, {TAG_MAX}] (a C int, as torch's)")
    return _array.as_buffer(tensor, name="tensor", writable=writable)


def _coalesced_lists(pg: _Group, output_lists: Sequence[Sequence[Any]],
                     input_list: Sequence[Any]) -> tuple[list[Buffer], list[list[Buffer]]]:
    """all_gather_coalesced's inputs as Buffers, and its outputs per input (``outs[k][r]``:
    the transpose of torch's layout), every one checked."""
    if isinstance(input_list, (str, bytes)) or not hasattr(input_list, "__len__") or not input_list:
        raise ValueError("input_tensor_list must be a non-empty list of arrays")
    _coalesced_dtypes(output_lists, input_list)
    if isinstance(output_lists, (str, bytes)) or not hasattr(output_lists, "__len__") \
            or len(output_lists) != pg._size:
        got = len(output_lists) if hasattr(output_lists, "__len__") else type(output_lists).__name__
        raise ValueError(f"output_tensor_lists must have {pg._size} lists (one per rank of group "
                         f"{pg.group_name!r}), each with one array per input; got {got}")
    ins = [_array.as_buffer(t, name=f"input_tensor_list[{k}]") for k, t in enumerate(input_list)]
    for r, row in enumerate(output_lists):
        if isinstance(row, (str, bytes)) or not hasattr(row, "__len__") or len(row) != len(ins):
            got = len(row) if hasattr(row, "__len__") else type(row).__name__
            raise _size_error("output_tensor_lists",
                              f"output_tensor_lists[{r}] must have {len(ins)} arrays (one per input); got {got}")
    # The backends take the outputs per input (outs[k][r]): the transpose of torch's layout.
    outs = [_list_like(pg, [output_lists[r][k] for r in range(pg._size)],
                       f"output_tensor_lists[*][{k}]", ins[k], f"input_tensor_list[{k}]",
                       writable=True, views=True) for k in range(len(ins))]
    return ins, outs


def _split_counts(pg: _Group, output: Any, input: Any, output_split_sizes: Sequence[int] | None,
                  input_split_sizes: Sequence[int] | None) -> tuple[Buffer, Buffer, list[int], list[int]]:
    """all_to_all_single's arrays and the element counts it receives from / sends to each rank."""
    out = _array.as_buffer(output, name="output", writable=True)
    inp = _array.as_buffer(input, name="input")
    if out.dtype != inp.dtype:
        raise ValueError(f"{_DTYPES_DIFFER}: output has dtype {out.dtype.name} but input has {inp.dtype.name}; "
                         "they must match")
    row_out, row_in = _row_elems(out, "output"), _row_elems(inp, "input")
    if row_out != row_in:
        raise ValueError(f"output rows (shape {out.shape}) and input rows (shape {inp.shape}) must have "
                         "the same number of elements")
    out_rows = _splits(output_split_sizes, out.shape[0], pg._size, "output_split_sizes", "output")
    in_rows = _splits(input_split_sizes, inp.shape[0], pg._size, "input_split_sizes", "input")
    out_counts = [r * row_out for r in out_rows]
    in_counts = [r * row_in for r in in_rows]
    return out, inp, out_counts, in_counts


def _a2a_lists(pg: _Group, output_list: Sequence[Any],
               input_list: Sequence[Any]) -> tuple[list[Buffer], list[Buffer], list[str]]:
    """all_to_all's outputs and inputs as Buffers (one per rank each, one dtype), and their names."""
    for lst, name in ((output_list, "output_tensor_list"), (input_list, "input_tensor_list")):
        if len(lst) != pg._size:
            raise _size_error(name, f"{name} must have {pg._size} arrays (one per rank); got {len(lst)}")
    outs = [_array.as_buffer(t, name=f"output_tensor_list[{i}]", writable=True) for i, t in enumerate(output_list)]
    ins = [_array.as_buffer(t, name=f"input_tensor_list[{i}]") for i, t in enumerate(input_list)]
    for i, b in enumerate(outs + ins):
        if b.dtype != ins[0].dtype:
            raise ValueError(f"{_DTYPES_DIFFER}: all arrays of all_to_all must share one dtype; got "
                             f"{b.dtype.name} and {ins[0].dtype.name}")
    names = [f"output_tensor_list[{i}]" for i in range(len(outs))] + \
            [f"input_tensor_list[{i}]" for i in range(len(ins))]
    return outs, ins, names
