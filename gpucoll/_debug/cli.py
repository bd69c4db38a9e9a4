"""``gpucoll-debug``: which rank a hung job waits for.

``gpucoll-debug trace DIR`` reads every flight-recorder dump in DIR (written by each
rank's watchdog when an op times out, or by ``group.dump_flight_recorder(path)``).
``gpucoll-debug status HOST:PORT`` asks every live rank of a running job for the same
data through its control-plane server (see gpucoll._debug.control_plane), without stopping
it. Both print, per group: the first op not reached by every rank and which ranks are
missing, what each rank is doing instead (its last op, that op's state and call site,
the stack of its main thread), and the first sequence number at which ranks disagree
on op, dtype or size.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from typing import Any, Sequence

from .._env import STORE_TOKEN_ENV
from . import package_dir

__all__ = ["main", "analyse", "load_dumps"]

_SIZES_MAY_DIFFER = ("all_to_all", "all_to_all_single", "send", "recv", "batch_p2p")


def load_dumps(directory: str) -> list[dict[str, Any]]:
    """Every flight-recorder dump (``*.json``) under ``directory``.

    Raises:
        FileNotFoundError: ``directory`` does not exist.
    """
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no such directory: {directory!r}")
    dumps = []
    for path in sorted(glob.glob(os.path.join(directory, "**", "*.json"), recursive=True)):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "entries" in data and "group" in data:
            data.setdefault("_path", path)
            dumps.append(data)
    return dumps


def _describe(e: dict[str, Any] | None) -> str:
    if e is None:
        return "no op recorded"
    parts = [f"{e['op_type']} (seq {e['seq']})"]
    if e.get("dtype"):
        parts.append(f"{e['dtype']} {tuple(e['shape']) if e.get('shape') is not None else ''}".strip())
    if e.get("peer") is not None:
        parts.append(f"peer/root {e['peer']}")
    parts.append(f"[{e['state']}]")
    if e.get("where"):
        parts.append(f"at {e['where']}")
    return " ".join(parts)


def _main_stack(dump: dict[str, Any], lines: int = 3) -> str:
    """The main thread's innermost frames outside gpucoll (where the program is), innermost first."""
    stacks = dump.get("stacks") or {}
    for name, text in stacks.items():
        if not name.startswith("MainThread"):
            continue
        frames = []
        for ln in text.splitlines():
            found = re.match(r'\s*File "([^"]+)", line (\d+), in (.+)', ln)
            if found:
                frames.append(found.groups())
        # The library's frames are those under the dumping rank's own gpucoll package (recorded
        # in the dump); older dumps fall back to this reader's package location.
        package = str(dump.get("package_dir") or package_dir())
        inner = [f for f in frames if not f[0].startswith(package)]
        shown = [f"{func} ({os.path.basename(path)}:{line})" for path, line, func in reversed(inner[-lines:])]
        inside = frames and frames[-1][0].startswith(package)
        return ("in gpucoll <- " if inside else "") + " <- ".join(shown)
    return ""


def _signature(e: dict[str, Any]) -> tuple[Any, ...]:
    if e["op_type"] in _SIZES_MAY_DIFFER:
        return (e["op_type"],)
    return (e["op_type"], e.get("dtype"), e.get("nbytes"))


def analyse(dumps: Sequence[dict[str, Any]]) -> str:
    """The hang analysis of ``dumps`` (flight-recorder snapshots of any ranks and groups), as text."""
    if not dumps:
        return "no flight-recorder dumps found\n"
    out: list[str] = []
    groups: dict[str, dict[int, dict[str, Any]]] = {}
    for d in dumps:  # the newest dump of each (group, rank)
        ranks = groups.setdefault(d["group"], {})
        old = ranks.get(d["rank"])
        if old is None or d.get("time", 0) >= old.get("time", 0):
            ranks[d["rank"]] = d
    for name in sorted(groups, key=lambda g: (g != "default", g)):
        ranks = groups[name]
        any_dump = next(iter(ranks.values()))
        size = int(any_dump["size"])
        desc = any_dump.get("group_desc") or ""
        out.append(f"group {name!r}{f' ({desc})' if desc else ''}: {size} rank(s), dumps from "
                   f"{len(ranks)}: {sorted(ranks)}")
        last: dict[int, dict[str, Any] | None] = {}
        by_seq: dict[int, dict[int, dict[str, Any]]] = {}
        for r, d in ranks.items():
            entries = d["entries"]
            last[r] = entries[-1] if entries else None
            for e in entries:
                by_seq.setdefault(int(e["seq"]), {})[r] = e
        no_dump = [r for r in range(size) if r not in ranks]
        reached = {r: (int(e["seq"]) if e is not None else 0) for r, e in last.items()}
        top = max(reached.values(), default=0)
        # the first op that some dumped rank has issued and another has not
        behind = sorted(r for r, s in reached.items() if s < top)
        first_missing = min((reached[r] + 1 for r in behind), default=None)
        if first_missing is not None:
            holders = by_seq.get(first_missing, {})
            example = next(iter(holders.values()), None)
            missing = sorted([r for r, s in reached.items() if s < first_missing] + no_dump)
            out.append(f"  first op not reached by every rank: {_describe(example).rsplit(' [', 1)[0]} -- "
                       f"reached by ranks {sorted(holders)}, MISSING on ranks {missing}")
        else:
            stuck = [r for r, e in last.items() if e is not None and e["state"] != "completed"]
            if stuck and no_dump:
                # A rank that had entered this op would have timed out and dumped too.
                e = last[stuck[0]]
                out.append(f"  first op not reached by every rank: {_describe(e).rsplit(' [', 1)[0]} -- ranks "
                           f"{stuck} wait in it, MISSING on ranks {no_dump} (no dump: they never entered it, "
                           "or died)")
            elif stuck:
                e = last[stuck[0]]
                out.append(f"  every rank reached seq {top}; not completed on ranks {stuck}: "
                           f"{_describe(e).rsplit(' [', 1)[0]} (all ranks are in it: look at the transport, "
                           "or at another group these ranks wait on)")
            elif no_dump:
                out.append(f"  every dumped rank completed seq {top}; no dump from ranks {no_dump} "
                           "(they never timed out in this group: stuck outside its collectives, or dead)")
            else:
                out.append(f"  every rank completed seq {top}: no hang recorded in this group")
        for r in no_dump:
            out.append(f"  rank {r}: no dump (it did not time out in this group: stuck before its next "
                       "collective, in another group, or dead)")
        for r in sorted(ranks):
            d = ranks[r]
            where = f"{d.get('host', '?')} pid {d.get('pid', '?')}"
            out.append(f"  rank {r} (global {d.get('global_rank', '?')}, {where}): last op {_describe(last[r])}")
            stack = _main_stack(d)
            if stack:
                out.append(f"      main thread: {stack}")
        for seq in sorted(by_seq):
            seen = by_seq[seq]
            if len({_signature(e) for e in seen.values()}) > 1:
                listing = "; ".join(f"rank {r}: {_describe(e).rsplit(' [', 1)[0]}" for r, e in sorted(seen.items()))
                out.append(f"  ranks DISAGREE at seq {seq} (op/dtype/size): {listing}")
                break
    return "\n".join(out) + "\n"


def _status(address: str, token: str | None, timeout: float) -> str:
    from .control_plane import collect_job

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT of the job's store; got {address!r}")
    answers, problems = collect_job(host, int(port), token=token, timeout=timeout)
    dumps = [d for a in answers for d in a.get("dumps", [])]
    lines = [f"asked {len(answers) + len(problems)} rank(s) through the store at {address}; "
             f"{len(answers)} answered"]
    lines += [f"  rank {r}: {why}" for r, why in problems]
    return "\n".join(lines) + "\n" + analyse(dumps)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gpucoll-debug``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="gpucoll-debug", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_trace = sub.add_parser("trace", help="analyse the flight-recorder dumps in DIR")
    p_trace.add_argument("dir")
    p_status = sub.add_parser("status", help="ask every live rank of a job (through its store at HOST:PORT)")
    p_status.add_argument("address", metavar="HOST:PORT")
    p_status.add_argument("--token", default=os.environ.get(STORE_TOKEN_ENV) or None,
                          help="the store's token (default: $GPUCOLL_STORE_TOKEN)")
    p_status.add_argument("--timeout", type=float, default=10.0, help="seconds per request (default 10)")
    args = parser.parse_args(argv)
    try:
        if args.command == "trace":
            text = analyse(load_dumps(args.dir))
        else:
            text = _status(args.address, args.token, args.timeout)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"gpucoll-debug: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
