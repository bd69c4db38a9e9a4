"""torch 2.13's own store, control-collective, ReduceOp, Backend and debug-level tests,
ported check by check (``_conf_ported_store``), run on gpucoll and on torch
(gloo, torch's stores) through the same adapter as the rest of the conformance suite.

A check that fails on torch is a bug in the port; one that fails on gpucoll is a bug in
gpucoll, unless it is a deliberate difference of docs/torch-differences.md (the check
then asserts gpucoll's behaviour, and says so).

    PYTHONPATH=$PWD python -m pytest tests/conformance/test_ported_store.py -q
    PYTHONPATH=$PWD python tests/conformance/run_against_torch.py --section ported_store \\
        --section ported_control --section ported_c10d --section ported_groups
"""

from __future__ import annotations

import importlib.util

import pytest

from _conf_core import SECTIONS, _load_checks, check_ids
from test_conformance import assert_result

_load_checks()
PORTED = ["ported_store", "ported_control", "ported_c10d", "ported_groups"]
IMPLS = ["gpucoll"] + (["torch"] if importlib.util.find_spec("torch") is not None else [])


def _params() -> list:
    return [pytest.param(sec, check, ws, impl, id=f"{impl}:{sec}/{check}@{ws}")
            for sec in PORTED for check, ws in check_ids(SECTIONS[sec]) for impl in IMPLS]


@pytest.mark.parametrize("section,check,ws,impl", _params())
def test_ported(section: str, check: str, ws: int, impl: str) -> None:
    assert_result(section, impl, check, ws)
