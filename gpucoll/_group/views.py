"""Non-contiguous arrays in the module-level collectives, as torch accepts them: copies
of non-contiguous inputs, and contiguous stand-ins for the non-contiguous arrays of output
lists, copied into the caller's arrays when the op completes (for ``async_op=True``,
inside the Work's completion, before anyone can see it complete).

A single array written in place stays refused (``NotContiguousError``): torch's gloo
writes such an output as if it were contiguous, leaving wrong values.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .._work import Work
from ..array import NotContiguousError, is_device_array

__all__ = ["contiguous_input", "with_views"]


def _non_contiguous(x: Any) -> bool:
    """A NumPy/CuPy array or torch tensor that is not C-contiguous (other arrays: the
    array layer decides)."""
    flags = getattr(x, "flags", None)
    if flags is not None:
        return getattr(flags, "c_contiguous", True) is False
    is_contiguous = getattr(x, "is_contiguous", None)
    return callable(is_contiguous) and is_contiguous() is False


def _contiguous_copy(x: Any) -> Any:
    return x.contiguous() if callable(getattr(x, "contiguous", None)) else x.copy()  # NumPy's/CuPy's copy(): C order


def contiguous_input(x: Any) -> Any:
    """``x``, or a C-contiguous copy of it where it is a non-contiguous NumPy/CuPy array or
    torch tensor: torch accepts non-contiguous inputs of all_gather and gather and the
    arrays of input lists. (A single output written in place must be contiguous: torch's
    gloo writes such an output as if it were contiguous, leaving garbage.)"""
    if type(x) is np.ndarray and x.flags.c_contiguous:
        return x  # the common case, first
    return _contiguous_copy(x) if _non_contiguous(x) else x


def _contiguous_list(arrays: Any) -> Any:
    """An input list with its non-contiguous arrays replaced by contiguous copies."""
    if isinstance(arrays, (list, tuple)) and any(_non_contiguous(a) for a in arrays):
        return [contiguous_input(a) for a in arrays]
    return arrays


_Staged = list[tuple[Any, Any]]
"""(the caller's non-contiguous output array, its contiguous stand-in) pairs."""


def _staged_outputs(arrays: Any, name: str, async_op: bool, staged: _Staged) -> Any:
    """An output list with each non-contiguous array replaced by a contiguous copy (the
    copy's data is the array's, so slots an op leaves alone stay as they were), the pairs
    appended to ``staged`` for :func:`_done`."""
    if not isinstance(arrays, (list, tuple)):
        return arrays
    out: list[Any] | None = None
    for i, a in enumerate(arrays):
        if not _non_contiguous(a):
            continue
        if async_op and is_device_array(a):
            raise NotContiguousError(
                f"{name}[{i}] is a non-contiguous device array; with async_op=True device outputs must be "
                "contiguous (a synchronous call accepts it: the result is copied in on the caller's stream)")
        if out is None:
            out = list(arrays)
        out[i] = _contiguous_copy(a)
        staged.append((a, out[i]))
    return arrays if out is None else out


def _copy_back(staged: _Staged) -> None:
    for view, filled in staged:
        copy_ = getattr(view, "copy_", None)
        if callable(copy_):
            copy_(filled)  # torch
        else:
            view[...] = filled  # NumPy; CuPy (on the current stream, after the op)


def with_views(run: Callable[[Any, Any], Work | None], outputs: Any, inputs: Any, name: str, async_op: bool,
                rows: bool = False) -> Work | None:
    """``run(outputs, inputs)``: an op with an output list (``rows``: a list of such lists)
    and an input list (or None). Where the array layer refuses a non-contiguous array of
    either (a check made before anything is issued), the op runs again on contiguous
    stand-ins: copies of the inputs, and outputs that :func:`_done` copies back. Contiguous
    arrays pay nothing for this."""
    try:
        return run(outputs, inputs)
    except NotContiguousError as exc:
        refused = exc
    staged: _Staged = []
    if rows and isinstance(outputs, (list, tuple)):
        outs = [_staged_outputs(row, f"{name}[{r}]", async_op, staged) for r, row in enumerate(outputs)]
    else:
        outs = _staged_outputs(outputs, name, async_op, staged)
    ins = _contiguous_list(inputs)
    if not staged and ins is inputs:
        raise refused  # not one of ours (a single array, another framework's): as refused
    return _done(run(outs, ins), staged)


def _done(work: Work | None, staged: _Staged) -> Work | None:
    """The op's result, once stand-ins of ``staged`` are (or will be) copied into the
    caller's arrays: now for a synchronous op, before the Work is seen complete otherwise
    (and the Work's results name the caller's arrays, not the stand-ins)."""
    if staged:
        if work is None:
            _copy_back(staged)
        else:
            def finish(results: list[Any]) -> None:
                _copy_back(staged)
                _swap(results, {id(filled): view for view, filled in staged})

            work._before_done(finish)
    return work


def _swap(results: list[Any], views: dict[int, Any]) -> None:
    for i, x in enumerate(results):
        if isinstance(x, list):
            _swap(x, views)
        elif id(x) in views:
            results[i] = views[id(x)]
