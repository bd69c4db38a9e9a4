"""Run the conformance suite on gpucoll and on torch.distributed (gloo) side by side and
print each check's outcome and the totals ("gpucoll passes X of N; torch passes Y of N").

    PYTHONPATH=$PWD python tests/conformance/run_against_torch.py [--impl gpucoll|torch|both]
        [--section NAME ...] [--section-prefix PREFIX] [--failures] [--by-source]

Without torch installed, only the gpucoll column is produced. Exit status 0 always: this
is a report; the pytest files under tests/conformance/ are the pass/fail gate.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _conf_core import SECTIONS, _load_checks, check_ids, run_section  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=("gpucoll", "torch", "both"), default="both")
    ap.add_argument("--section", action="append", help="run only these sections")
    ap.add_argument("--failures", action="store_true", help="print only checks that did not pass")
    ap.add_argument("--section-prefix", help="run only sections whose name starts with this")
    ap.add_argument("--by-source", action="store_true",
                    help="also print the totals per torch source file (the file part of each check's source)")
    args = ap.parse_args(argv)
    _load_checks()
    impls = ["gpucoll", "torch"] if args.impl == "both" else [args.impl]
    if "torch" in impls and importlib.util.find_spec("torch") is None:
        print("torch is not installed: torch column skipped")
        impls.remove("torch")
    totals = {i: {"pass": 0, "fail": 0, "skip": 0} for i in impls}
    t_impl = {i: 0.0 for i in impls}
    by_source: dict[str, dict[str, dict[str, int]]] = {}
    for name, sec in SECTIONS.items():
        if args.section and name not in args.section:
            continue
        if args.section_prefix and not name.startswith(args.section_prefix):
            continue
        sources = {c.name: c.source.split("::")[0].split(" ")[0] for c in sec.checks}
        for ws in sec.world_sizes:
            res = {}
            for impl in impls:
                t0 = time.monotonic()
                res[impl] = run_section(name, impl, ws)
                t_impl[impl] += time.monotonic() - t0
            for check, cws in check_ids(sec):
                if cws != ws:
                    continue
                row = {i: res[i][check] for i in impls}
                for i in impls:
                    totals[i][row[i].status] += 1
                    src = by_source.setdefault(sources[check], {j: {"pass": 0, "fail": 0, "skip": 0} for j in impls})
                    src[i][row[i].status] += 1
                if args.failures and all(r.status == "pass" for r in row.values()):
                    continue
                cells = "  ".join(f"{i}={row[i].status:<4}" for i in impls)
                print(f"{name}/{check}@{ws}: {cells}")
                for i in impls:
                    if row[i].status != "pass":
                        print(f"    {i}: {row[i].msg[:400]}")
    print()
    if args.by_source:
        for src, counts in sorted(by_source.items()):
            cells = "; ".join(f"{i} {c['pass']}/{c['pass'] + c['fail']} pass ({c['skip']} n/a)"
                              for i, c in counts.items())
            print(f"{src}: {cells}")
        print()
    for i in impls:
        t = totals[i]
        n = t["pass"] + t["fail"]
        print(f"{i} passes {t['pass']} of {n} applicable checks ({t['skip']} not applicable), "
              f"{t_impl[i]:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
