"""A rank that dies: run as a script by a test rank (``python _victim.py MODE STEPS DIE_AT TIMEOUT``).

It joins the job from the environment the test harness gave its parent and runs the
same all_reduce loop as the survivors until step DIE_AT, where it SIGKILLs itself:

- ``loop``: before that step's all_reduce (its peers are left waiting on it);
- ``recovery``: the loop runs until its first DistError; then it calls shrink_group
  and dies as soon as the survivors have agreed on a group that includes it (a
  second death, during the rebuild).
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

import gpucoll
from gpucoll._group import shrink as _shrink


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main(mode: str, steps: int, die_at: int, timeout: float) -> None:
    gpucoll.init_process_group("cpu", timeout=timeout)
    orig = gpucoll.get_rank()
    for step in range(steps):
        if mode == "loop" and step == die_at:
            _die()
        x = np.full(4, float((orig + 1) * (step + 1)), np.float64)
        try:
            gpucoll.all_reduce(x)
        except gpucoll.DistError:
            if mode != "recovery":
                raise
            agree = _shrink._agree_members

            def agree_then_die(*args: object, **kwargs: object) -> list[int]:
                members = agree(*args, **kwargs)  # type: ignore[arg-type]
                _die()
                return members

            _shrink._agree_members = agree_then_die  # type: ignore[assignment]
            gpucoll.shrink_group(timeout=timeout)
    raise SystemExit("the victim was meant to die")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
