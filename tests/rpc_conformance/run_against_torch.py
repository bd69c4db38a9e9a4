"""Run torch's RPC tests, as ported here, on gpucoll.rpc and on torch.distributed.rpc
(TensorPipe) side by side; print each test that did not pass on both, with why, and the
totals ("gpucoll passes X of N; torch passes Y of N").

    PYTHONPATH=$PWD python tests/rpc_conformance/run_against_torch.py [--impl gpucoll|torch|both]
        [--section rpc|faulty ...] [--all]

Every section runs in one world of 4 ranks per implementation (a test that hangs ends
its world; the next world resumes after it). Exit status 0 always: this is a report;
tests/rpc_conformance/test_rpc_conformance.py is the pass/fail gate.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _rpc_core import SECTIONS, list_tests, run_section  # noqa: E402
from _rpc_xfail import GPUCOLL, TORCH  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--impl", choices=("gpucoll", "torch", "both"), default="both")
    ap.add_argument("--section", action="append", choices=sorted(SECTIONS), help="run only these sections")
    ap.add_argument("--test", action="append", default=[], help="run only these tests (names)")
    ap.add_argument("--all", action="store_true", help="print every test, passed ones too")
    args = ap.parse_args(argv)
    impls = ["gpucoll", "torch"] if args.impl == "both" else [args.impl]
    if "torch" in impls and importlib.util.find_spec("torch") is None:
        print("torch is not installed: torch column skipped")
        impls.remove("torch")
    totals = {i: {"pass": 0, "fail": 0, "skip": 0} for i in impls}
    unexpected = {i: 0 for i in impls}
    seconds = {i: 0.0 for i in impls}
    for section in SECTIONS:
        if args.section and section not in args.section:
            continue
        res = {}
        for impl in impls:
            t0 = time.monotonic()
            res[impl] = run_section(section, impl, tuple(args.test))
            seconds[impl] += time.monotonic() - t0
        for _, name in list_tests(section, tuple(args.test)):
            row = {i: res[i][name] for i in impls}
            for i in impls:
                totals[i][row[i].status] += 1
                listed = name in (GPUCOLL if i == "gpucoll" else TORCH)
                if (row[i].status == "fail") != listed and row[i].status != "skip":
                    unexpected[i] += 1
            if not args.all and all(r.status == "pass" for r in row.values()):
                continue
            cells = "  ".join(f"{i}={row[i].status:<4}" for i in impls)
            print(f"{section}/{name}: {cells}  ({max(r.seconds for r in row.values()):.1f} s)")
            for i in impls:
                if row[i].status != "pass":
                    print(f"    {i}: {row[i].msg[:500]}")
    print()
    for i in impls:
        t = totals[i]
        print(f"{i} passes {t['pass']} of {t['pass'] + t['fail']} tests ({t['skip']} skipped), "
              f"{unexpected[i]} differ from the xfail table, {seconds[i]:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
