"""torch's group, mesh, fake-backend and object-collective tests, ported check for check
(_conf_ported_groups.py), run on gpucoll and on torch 2.13 (gloo and torch's fake
backend) through the one adapter of _conf_core. The torch column is the evidence that
each check states torch's behaviour; it is skipped, with the reason, when torch is not
installed.

    PYTHONPATH=$PWD python tests/conformance/run_against_torch.py --section ported_fake ...
"""

from __future__ import annotations

import importlib.util

import pytest

from _conf_core import SECTIONS, _load_checks, check_ids
from _conf_xfail import GPUCOLL, reason
from test_conformance import assert_result

_load_checks()

PORTED = [name for name in SECTIONS if name.startswith("ported_")]

GPUCOLL_XFAIL = GPUCOLL
"""Ported checks gpucoll fails today, by check name (or "name@ws"), with the cause: the
one table of _conf_xfail.py, which test_conformance.py reads too."""


def _params(impl: str) -> list:
    params = []
    for name in PORTED:
        for check, ws in check_ids(SECTIONS[name]):
            key = f"{name}/{check}@{ws}"
            why = reason(GPUCOLL_XFAIL, check, ws) if impl == "gpucoll" else None
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            params.append(pytest.param(name, check, ws, id=key, marks=marks))
    return params


@pytest.mark.parametrize("section,check,ws", _params("gpucoll"))
def test_ported_gpucoll(section: str, check: str, ws: int) -> None:
    assert_result(section, "gpucoll", check, ws)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch (test-only dependency) is not installed")
@pytest.mark.parametrize("section,check,ws", _params("torch"))
def test_ported_torch(section: str, check: str, ws: int) -> None:
    assert_result(section, "torch", check, ws)
