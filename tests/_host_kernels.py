"""gpucoll's CUDA kernel sources compiled as host C++ (the files include no headers for
this), and a launcher that runs a kernel's grid as sequential 'threads': how the CPU
suite checks what the kernels compute."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from typing import Any

import pytest

PRELUDE = """struct gc_dim3 { unsigned int x, y, z; };
extern "C" { gc_dim3 threadIdx, blockIdx, blockDim, gridDim; }
#define __global__
#define __device__
#define __forceinline__ inline
#define __align__(n) alignas(n)
"""

_LIBS: dict[str, ctypes.CDLL] = {}


def host_library(module: str) -> ctypes.CDLL:
    """kernels/<module>.cu built as a shared library (once per process); skips the test
    where there is no C++ compiler."""
    if module in _LIBS:
        return _LIBS[module]
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the kernels as host code")
    from gpucoll._backends.nccl import kernel_loader as _kernels

    tmp = tempfile.mkdtemp(prefix=f"gpucoll-{module}-")
    prelude = os.path.join(tmp, "prelude.h")
    with open(prelude, "w") as f:
        f.write(PRELUDE)
    out = os.path.join(tmp, f"lib{module}.so")
    proc = subprocess.run([cxx, "-O1", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror", "-x", "c++", "-include",
                           prelude, str(_kernels.KERNEL_DIR / _kernels.MODULES[module]), "-o", out],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    _LIBS[module] = ctypes.CDLL(out)
    return _LIBS[module]


def run_grid(lib: ctypes.CDLL, fn: Any, args: tuple[Any, ...], grid: tuple[int, int], block: int) -> None:
    """Run ``fn(*args)`` once per thread of a ``grid`` (x, y) of 1-D blocks of ``block``."""
    for var, value in (("gridDim", (grid[0], grid[1], 1)), ("blockDim", (block, 1, 1))):
        arr = (ctypes.c_uint * 3).in_dll(lib, var)
        arr[0], arr[1], arr[2] = value
    bid = (ctypes.c_uint * 3).in_dll(lib, "blockIdx")
    tid = (ctypes.c_uint * 3).in_dll(lib, "threadIdx")
    for by in range(grid[1]):
        for bx in range(grid[0]):
            for t in range(block):
                bid[0], bid[1], tid[0] = bx, by, t
                fn(*args)
