"""Whether this machine has NVIDIA devices at all, asked without loading CUDA."""

from __future__ import annotations

import glob
import sys

__all__ = ["no_gpu_reason"]


def no_gpu_reason() -> str | None:
    """"no /dev/nvidia* device" on a Linux machine without NVIDIA device nodes, else None.
    Loads nothing (no CuPy, no CUDA driver)."""
    if sys.platform.startswith("linux") and not glob.glob("/dev/nvidia[0-9]*"):
        return "this machine has no /dev/nvidia* device (no NVIDIA GPU, or none passed into this container)"
    return None
