"""Checks that fail today, keyed by check name (all world sizes) or "name@ws", with the
catalogue id of tests/conformance/CATALOGUE.md and a short cause. The pytest files mark
them ``xfail(strict=True)``: a fix that makes one pass turns the suite red until its
entry is removed here.
"""

from __future__ import annotations

GPUCOLL: dict[str, str] = {}
"""Every catalogue entry (C01-C17) is fixed or, for C09 and C17, asserts gpucoll's
documented behaviour (docs/torch-differences.md); no check fails at present."""

# torch.distributed 2.13 (gloo) failing a ported check; none at present.
TORCH: dict[str, str] = {}


def reason(table: dict[str, str], check: str, ws: int) -> str | None:
    return table.get(f"{check}@{ws}") or table.get(check)
