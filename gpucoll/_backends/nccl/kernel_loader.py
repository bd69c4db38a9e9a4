"""gpucoll's CUDA kernels (``kernels/*.cu`` beside this module), loaded lazily with ``cupy.RawModule``.

Each source file becomes one RawModule the first time one of its kernels is needed
(CuPy compiles it with NVRTC for the current device and caches the binary on disk);
each kernel is looked up once per device. Importing this module imports no CuPy.

Kernel arguments are described by :data:`SIGNATURES`, one letter per parameter:
``p`` pointer, ``q`` long long, ``i`` int, ``d`` double, so that a launch passes
exactly the C types the kernel declares.
"""

from __future__ import annotations

import functools
import importlib.resources
from importlib.abc import Traversable
from typing import Any

from ...errors import BackendUnavailableError

__all__ = ["KERNEL_DIR", "MODULES", "SIGNATURES", "signature", "source", "get_kernel", "launch",
           "BLOCK", "MAX_GRID"]

KERNEL_DIR: Traversable = importlib.resources.files(__package__) / "kernels"
"""The kernel sources: package data beside this module (``gpucoll/_backends/nccl/kernels/``)."""
MODULES: dict[str, str] = {"reduce": "reduce.cu", "gather": "gather.cu"}
"""Module name -> source file in :data:`KERNEL_DIR`."""

SIGNATURES: dict[str, str] = {
    "gpucoll_reduce_": "ppqiq",        # rows, out, n, nrows, stride
    "gpucoll_avg_trunc_": "pqq",       # x, n, divisor
    "gpucoll_scale_f": "pqd",          # x, n, factor (float types: f16 f32 f64)
    "gpucoll_scale_bf16": "pqd",
    "gpucoll_scale_": "pqq",           # x, n, factor (integer types)
    "gpucoll_gather_": "ppi",          # table, dst, nparts (kernels/gather.cu; a 2-D grid)
}
"""Kernel-name prefix -> parameter types; the first (longest listed first) match wins."""

BLOCK = 256
MAX_GRID = 4096  # enough blocks to fill any current GPU; the loops are grid-stride

_HINT = ("gpucoll compiles its CUDA kernels (bitwise reductions, 16-bit integer reductions, integer "
         "AVG/PREMUL_SUM) with NVRTC: pip install \"gpucoll[cuda12]\" (it brings nvidia-cuda-nvrtc-cu12; "
         "\"gpucoll[cuda13]\" brings nvidia-cuda-nvrtc 13), or install a CUDA toolkit")


def signature(name: str) -> str:
    """The parameter types of kernel ``name`` (see :data:`SIGNATURES`).

    Raises:
        KeyError: ``name`` is not a gpucoll kernel.
    """
    for prefix, sig in SIGNATURES.items():
        if name.startswith(prefix):
            return sig
    raise KeyError(f"unknown gpucoll kernel {name!r}")


def source(module: str = "reduce") -> str:
    """The CUDA source of ``module``."""
    return (KERNEL_DIR / MODULES[module]).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=None)
def _module(module: str, device: int) -> Any:
    import cupy

    return cupy.RawModule(code=source(module))


@functools.lru_cache(maxsize=None)
def get_kernel(name: str, device: int, module: str = "reduce") -> Any:
    """The compiled ``cupy.RawKernel`` named ``name`` for ``device`` (which must be the
    current device), compiling its module on first use.

    Raises:
        BackendUnavailableError: the kernels cannot be compiled here (no NVRTC).
    """
    try:
        kernel = _module(module, device).get_function(name)
        kernel.compile()  # compile and load now, so that failures surface here
    except Exception as exc:
        raise BackendUnavailableError(f"compiling kernel {name} failed ({type(exc).__name__}: {exc}); "
                                      f"{_HINT}") from exc
    return kernel


def launch(name: str, n: int, args: tuple[Any, ...], stream: Any, device: int) -> None:
    """Launch kernel ``name`` over ``n`` elements on ``stream`` (a ``cupy.cuda.Stream``).

    Args:
        name: a kernel of kernels/reduce.cu.
        n: the element count its grid-stride loop covers (no launch when 0).
        args: the kernel's arguments as Python numbers, converted per :func:`signature`.
        stream: where to launch.
        device: the current device.
    """
    if n <= 0:
        return
    import numpy as np

    sig = signature(name)
    if len(sig) != len(args):
        raise ValueError(f"kernel {name} takes {len(sig)} arguments; got {len(args)}")
    conv: dict[str, Any] = {"p": np.uint64, "q": np.int64, "i": np.int32, "d": np.float64}
    cargs = tuple(conv[t](int(a) if t in "pqi" else float(a)) for t, a in zip(sig, args))
    grid = min(MAX_GRID, -(-n // BLOCK))
    kernel = get_kernel(name, device)
    with stream:
        kernel((grid,), (BLOCK,), cargs)
