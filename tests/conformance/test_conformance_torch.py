"""The same checks on torch.distributed 2.13 (gloo, torch tensors): evidence that each
check states torch's behaviour. CI runs the sections in TORCH_SECTIONS (set
GPUCOLL_CONFORMANCE_TORCH=all for every section, or run run_against_torch.py for the
side-by-side counts). Skipped, with the reason, when torch is not installed.
"""

from __future__ import annotations

import os

import pytest

from _conf_core import SECTIONS
from _conf_xfail import TORCH
from test_conformance import _params, assert_result

torch = pytest.importorskip("torch", reason="torch (test-only dependency) is not installed")

# a meaningful subset within CI's time: stores, collectives at 3 ranks, the tutorial
TORCH_SECTIONS = ["store", "coll", "tutorial"]
_ALL = os.environ.get("GPUCOLL_CONFORMANCE_TORCH") == "all"
_WS = {"coll": (3,), "tutorial": (2,)}


def _torch_params() -> list:
    params = _params(TORCH, None if _ALL else TORCH_SECTIONS)
    if _ALL:
        return params
    return [p for p in params if p.values[2] in _WS.get(p.values[0], SECTIONS[p.values[0]].world_sizes)]


@pytest.mark.parametrize("section,check,ws", _torch_params())
def test_torch(section: str, check: str, ws: int) -> None:
    assert_result(section, "torch", check, ws)
