"""gpucoll-bench: nccl-tests-compatible bandwidth benchmark of gpucoll's collectives.

``gpucoll-bench all_reduce -b 8 -e 64M -f 4`` (or ``python -m gpucoll.bench ...``)
prints nccl-tests' table (size, count, type, redop, root, then time, algbw, busbw
and #wrong for the out-of-place and in-place variants) for a size sweep, on the
GPUs through NCCL or on host arrays through the CPU backend. See docs/benchmark.md.
"""

from __future__ import annotations

from .cli import main as main

__all__ = ["main"]
