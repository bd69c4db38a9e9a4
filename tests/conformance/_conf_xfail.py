"""Checks that fail today, keyed by check name (all world sizes) or "name@ws", with the
catalogue id of tests/conformance/CATALOGUE.md and a short cause. The pytest files mark
them ``xfail(strict=True)``: a fix that makes one pass turns the suite red until its
entry is removed here.
"""

from __future__ import annotations

_ASYNC_INLINE = ("the CPU backend runs a small async_op=True op inline on the caller's thread when nothing is "
                 "queued, so the rank that issues the lagging all_reduce alone blocks until the group's timeout "
                 "instead of returning its Work at once (the async path of gpucoll/_backends/cpu/backend.py)")

GPUCOLL: dict[str, str] = {
    "common_sequence_num_incremented_subgroup@4": _ASYNC_INLINE,
    "common_sequence_num_incremented_default@3": _ASYNC_INLINE,
}
"""Every catalogue entry (C01-C17) is fixed or, for C09 and C17, asserts gpucoll's
documented behaviour (docs/torch-differences.md). What fails: two ported
sequence-number tests of test_c10d_common.py, for the cause above."""

# torch.distributed 2.13 (gloo) failing a ported check; none at present.
TORCH: dict[str, str] = {}


def reason(table: dict[str, str], check: str, ws: int) -> str | None:
    return table.get(f"{check}@{ws}") or table.get(check)
