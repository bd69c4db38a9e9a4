"""The torch.distributed conformance suite on gpucoll (NumPy arrays, CPU backend).

Each section of checks runs in one world per world size (see _conf_core); each check
is reported here as its own test, so one failure is visible by name and hides nothing.
Checks that fail today are xfail(strict=True) with their catalogue id (_conf_xfail.py,
CATALOGUE.md). ``run_against_torch.py`` runs the same checks on torch for comparison.
"""

from __future__ import annotations

import pytest

from _conf_core import SECTIONS, _load_checks, check_ids, run_section
from _conf_xfail import GPUCOLL, reason

_load_checks()


def _params(impl_table: dict[str, str], sections: list[str] | None = None) -> list:
    params = []
    for name, sec in SECTIONS.items():
        if sections is not None and name not in sections:
            continue
        for check, ws in check_ids(sec):
            why = reason(impl_table, check, ws)
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            params.append(pytest.param(name, check, ws, id=f"{name}/{check}@{ws}", marks=marks))
    return params


def assert_result(section: str, impl: str, check: str, ws: int) -> None:
    res = run_section(section, impl, ws)[check]
    if res.status == "skip":
        pytest.skip(res.msg)
    assert res.status == "pass", res.msg


@pytest.mark.parametrize("section,check,ws", _params(GPUCOLL))
def test_gpucoll(section: str, check: str, ws: int) -> None:
    assert_result(section, "gpucoll", check, ws)
