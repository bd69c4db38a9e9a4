"""The one backoff of every poll loop (gpucoll._timeouts.Backoff), on a clock of its own."""

from __future__ import annotations

import math
import time

import pytest

from gpucoll import _timeouts
from gpucoll._timeouts import Backoff


class FakeClock:
    """time.monotonic and time.sleep for _timeouts: sleeping advances the clock."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(_timeouts, "time", fake)
    return fake


def test_sleeps_double_up_to_the_cap_and_stop_at_the_deadline(clock: FakeClock) -> None:
    wait = Backoff(1.0, first=0.01, cap=0.16)
    rounds = 0
    while wait.sleep():
        rounds += 1
        assert rounds < 100, "never gave up"
    assert clock.sleeps[:6] == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.16, 0.16])
    assert max(clock.sleeps) == pytest.approx(0.16)  # capped
    assert sum(clock.sleeps) == pytest.approx(1.0)  # the last sleep is cut at the deadline, not past it
    assert clock.now == pytest.approx(101.0) and wait.left() <= 0


def test_no_sleep_once_the_deadline_passed(clock: FakeClock) -> None:
    wait = Backoff(0.5, first=0.1, cap=1.0)
    clock.now += 0.6  # the caller's own work used the time up
    assert wait.sleep() is False and clock.sleeps == []


def test_without_a_deadline_it_never_gives_up(clock: FakeClock) -> None:
    wait = Backoff(None, first=1e-3, cap=1e-2)
    assert all(wait.sleep() for _ in range(1000))
    assert wait.left() == math.inf and max(clock.sleeps) == pytest.approx(1e-2)


def test_bad_delays_are_refused() -> None:
    for first, cap in ((0.0, 1.0), (0.2, 0.1), (-1.0, 1.0)):
        with pytest.raises(ValueError, match="first"):
            Backoff(1.0, first=first, cap=cap)


def test_a_real_wait_ends_near_its_deadline() -> None:
    start = time.monotonic()
    wait = Backoff(0.2, first=0.001, cap=0.05)
    while wait.sleep():
        pass
    assert 0.2 <= time.monotonic() - start < 1.0


def test_the_poll_loops_use_it_and_none_rolls_its_own() -> None:
    """Every sleep-and-retry loop of the package goes through Backoff: no module doubles a
    delay by hand any more (the spin budget of the store client is a count, not a sleep)."""
    import pathlib
    import re

    import gpucoll

    pkg = pathlib.Path(gpucoll.__file__).parent
    rolled = [f"{p.relative_to(pkg)}:{i}" for p in pkg.rglob("*.py") if p.name != "_timeouts.py"
              for i, line in enumerate(p.read_text().splitlines(), 1)
              if re.search(r"(delay|pause)\s*=\s*min\(\s*(2\s*\*\s*(delay|pause)|(delay|pause)\s*\*\s*2)", line)]
    assert not rolled, f"hand-rolled backoff loops: {rolled}"
