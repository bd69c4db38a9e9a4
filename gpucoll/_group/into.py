"""ProcessGroup's out-of-place all_reduce (``ProcessGroup._all_reduce_into``), kept
apart so that group.py stays a readable size."""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from .. import array as _array
from .._reduce_op import ReduceOp
from .._work import Work
from .checks import _check_op
from .core import Issuer
from .dispatch import backend_for_all

__all__ = ["all_reduce_into"]


def all_reduce_into(pg: Any, output: Any, input: Any, op: Any = ReduceOp.SUM,
                    async_op: bool = False) -> Work | None:
    """``output`` = the reduction of every rank's ``input`` on ``pg``, a ProcessGroup
    (see ``ProcessGroup._all_reduce_into``; typed Any: group.py imports this module)."""
    # Two NumPy arrays of a kind with a host runner (its backend does not reduce out of place):
    # the copy, then all_reduce's lean path, on its conditions. Anything else: the checks below.
    if type(output) is np.ndarray and type(input) is np.ndarray and type(op) is ReduceOp:
        fast = pg._host_runs.get((output.dtype, output.shape, op._name_))
        if fast is not None and (fast.inline or not async_op) and output.shape == input.shape \
                and output.dtype == input.dtype and pg._coalescing is None and not pg._destroyed:
            flags, issuer = output.flags, cast(Issuer, pg._issuer)
            if flags.c_contiguous and flags.writeable and input.flags.c_contiguous and not issuer.hooks \
                    and not issuer.debug_detail:
                output[...] = input  # same dtype and shape: a plain copy (np.copyto costs 3x)
                return issuer.run_now(fast.backend, fast.run, fast.start,
                                      (output if output.ndim == 1 else output.reshape(-1), fast.reducer),
                                      fast.desc, "all_reduce", [output], -1, async_op)
    pg._check_usable()
    out = _array.as_buffer(output, name="output", writable=True)
    inp = _array.as_buffer(input, name="input")
    if out.dtype != inp.dtype or out.numel != inp.numel:  # ValueError for both, as torch
        raise ValueError(f"output ({out.dtype.name} x {out.numel}) must match input "
                         f"({inp.dtype.name} x {inp.numel})")
    red = _check_op(op, out.dtype)
    into = None
    if pg._coalescing is None:
        backend = backend_for_all(pg, [out, inp], ["output", "input"])
        into = getattr(backend, "all_reduce_into", None)
    if into is None:
        _array.copy_buffer(out, inp)
        done: Work | None = pg.all_reduce(output if type(output) is np.ndarray else out, op, async_op)  # (a runner)
        return done
    done = pg._collective(backend, lambda: into(out, inp, red), out, [output], op="all_reduce", red=red,
                          async_op=async_op)
    return done
