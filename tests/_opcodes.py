"""The Python bytecode that gpucoll's own files run, counted (``sys.settrace`` with opcode
events, in frames of gpucoll's code only: a caller's, NumPy's or a fake's frames are not
counted, the gpucoll functions they call are). The per-op ceilings of
tests/nccl/test_nccl_per_op_counts.py, tests/cpu/test_small_opcodes.py and
tests/rpc/test_rpc_remote_counts.py count with it.

    counter = Opcodes()
    with counter:
        call()
    counter.count  # instructions so far, over every ``with`` block
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

import gpucoll

PACKAGE = os.path.dirname(os.path.abspath(gpucoll.__file__)) + os.sep


class Opcodes:
    """A running count of the bytecode instructions run in gpucoll's files on this thread
    while a ``with`` block of it is open."""

    def __init__(self) -> None:
        self.count = 0

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            self.count += 1
        return self._local

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None  # (not this frame's instructions; the functions it calls are looked at again)
        frame.f_trace_opcodes = True
        return self._local

    def __enter__(self) -> "Opcodes":
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)
