"""Ported tests that fail today, by test name, with the reason: the pytest file marks
them ``xfail(strict=True)``, so a fix that makes one pass turns the suite red until its
entry is removed here. docs/torch-differences.md (RPC) lists the GPUCOLL entries.
"""

from __future__ import annotations

HANG = "hangs: no result within the 30 s a test may take"
_HANG = HANG

GPUCOLL: dict[str, str] = {}

# torch.distributed.rpc 2.13 (TensorPipe) failing a ported test with NumPy arguments
TORCH: dict[str, str] = {}
