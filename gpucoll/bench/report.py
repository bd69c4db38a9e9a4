"""Output of a run: nccl-tests' table on stdout, and the same rows as JSON or CSV.

JSON document (``"schema": "gpucoll-bench/1"``; see docs/benchmark.md)::

    {"schema": ..., "env": {...}, "config": {...}, "ranks": [...], "rows": [...],
     "summary": {"avg_busbw": ..., "wrong_entries": ..., "ok": ...}}

Each row is flat: ``op, size, count, type, redop, root`` and, per variant
(``oop_`` out-of-place, ``ip_`` in-place), ``time_us, algbw_gbs, busbw_gbs,
wrong`` (null where the variant does not exist or was not checked). The CSV has
one line per row with the same row columns, preceded by the environment columns
``hostname, backend, world_size, device, gpucoll_version, date`` on every line.
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import platform
import shlex
import socket
import sys
from dataclasses import asdict
from typing import Any, Sequence

from .._env import BENCH_COMMAND_ENV
from .options import BenchConfig
from .runner import Measurement, RankInfo, Row

__all__ = [
    "SCHEMA", "environment", "header_lines", "float_str", "table_header", "format_row", "footer_lines",
    "avg_busbw", "wrong_entries", "row_dict", "document", "write_json", "read_json", "write_csv",
    "ROW_COLUMNS", "ENV_COLUMNS",
]

SCHEMA = "gpucoll-bench/1"
_VARIANT_FIELDS = ("time_us", "algbw_gbs", "busbw_gbs", "wrong")
ROW_COLUMNS: tuple[str, ...] = ("op", "size", "count", "type", "redop", "root") + tuple(
    f"{p}_{f}" for p in ("oop", "ip") for f in _VARIANT_FIELDS)
ENV_COLUMNS: tuple[str, ...] = ("hostname", "backend", "world_size", "device", "gpucoll_version", "date")


def _version(module: str) -> str | None:
    mod = sys.modules.get(module)
    if mod is None:
        return None
    return str(getattr(mod, "__version__", "unknown"))


def environment(cfg: BenchConfig, world_size: int, device: str, argv: Sequence[str]) -> dict[str, Any]:
    """What the run ran on: versions, host, device, backend, world size, date, command line.

    CuPy and NCCL versions are reported when this process loaded them (the nccl backend).
    """
    import numpy

    from .. import __version__

    env: dict[str, Any] = {
        "gpucoll_version": __version__,
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "backend": cfg.backend,
        "world_size": world_size,
        "device": device,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        # A local job's ranks get extra resolved arguments; the report keeps what was typed.
        "command": os.environ.get(BENCH_COMMAND_ENV) or shlex.join(["gpucoll-bench", *argv]),
    }
    cupy_version = _version("cupy")
    if cupy_version is not None:
        env["cupy"] = cupy_version
        try:
            from cupy.cuda import nccl

            code = int(nccl.get_version())
            env["nccl"] = f"{code // 10000}.{code // 100 % 100}.{code % 100}"
        except Exception as exc:  # a missing NCCL is a fact to record, not a failure of the report
            env["nccl"] = f"unavailable ({type(exc).__name__})"
    return env


_REGISTRATION = {
    1: "local (-R 1): buffers from ncclMemAlloc, registered with ncclCommRegister",
    2: "symmetric (-R 2): buffers from ncclMemAlloc, registered as windows with ncclCommWindowRegister "
       "(NCCL_WIN_COLL_SYMMETRIC)",
}


def _device_line(r: RankInfo) -> str:
    """nccl-tests' rank line (``writeDeviceReport``); a CPU rank names its CPU instead of a GPU."""
    head = "#  Rank %2d Group %2d Pid %6d on %10s device " % (r.rank, 0, r.pid, r.hostname)
    if r.cuda_device >= 0:
        return head + "%2d [%s] %s" % (r.cuda_device, r.pci, r.gpu_name)
    return head + r.device


def header_lines(cfg: BenchConfig, env: dict[str, Any], ranks: Sequence[RankInfo]) -> list[str]:
    """The lines above the table, in nccl-tests' layout: the parameters line
    (``# nThread 1 nGpus 8 minBytes ...``, with ``-t``/``-g`` as given: the local job ran
    that many ranks, one process each) and the "Using devices" list, one line per rank."""
    step = f"{cfg.stepfactor}(factor)" if cfg.stepfactor > 1 else f"{cfg.stepbytes}(bytes)"
    lines = [
        f"# Collective test starting: gpucoll-bench {cfg.op}  backend: {cfg.backend}  world size: "
        f"{env['world_size']}  gpucoll {env['gpucoll_version']}" + (f"  NCCL {env['nccl']}" if "nccl" in env else ""),
        f"# nThread {cfg.nthreads} nGpus {cfg.ngpus} minBytes {cfg.minbytes} maxBytes {cfg.maxbytes} step: {step} "
        f"warmup iters: {cfg.warmup_iters} iters: {cfg.iters} agg iters: {cfg.agg_iters} "
        f"validation: {cfg.check} graph: {cfg.cudagraph} unalign: 0",
    ]
    if cfg.local_register:
        mode = _REGISTRATION[cfg.local_register]
        if cfg.backend != "nccl":
            mode = mode.split(":")[0] + ": host memory on the cpu backend, nothing to register (a no-op)"
        lines.append("# Buffer registration: " + mode)
    if cfg.blocking:
        lines.append("# Blocking Enabled: wait for completion after each collective")
    lines += ["#", "# Using devices"]
    # Group is nccl-tests' MPI colour: 0, one communicator.
    lines += [_device_line(r) for r in ranks]
    return lines + ["#"]


def table_header() -> list[str]:
    """nccl-tests' three header lines (``writeResultHeader`` without timestamps)."""
    return [
        "# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          "
        % ("", "", "", "", ""),
        "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %*s"
        % ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
           "time", "algbw", "busbw", "#wrong", 0, ""),
        "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %*s"
        % ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", 0, ""),
    ]


def float_str(value: float, width: int) -> str:
    """nccl-tests' ``getFloatStr``: two decimals if they fit ``width``, else one, else none,
    else exponent notation."""
    for fmt in ("%*.2f", "%*.1f", "%*.0f"):
        text = fmt % (width, value)
        if len(text) <= width:
            return text
    return ("%*.1e" if width >= 7 else "%*.0e") % (width, value)


def _variant(m: Measurement | None) -> str:
    if m is None:
        return "  %7s  %6s  %6s  %6s" % ("N/A", "N/A", "N/A", "N/A")
    body = "  %7s  %6s  %6s" % (float_str(m.time_us, 7), float_str(m.algbw, 6), float_str(m.busbw, 6))
    return body + ("    N/A" if m.wrong is None else "  %6g" % m.wrong)


# The table's redop column is nccl-tests' six characters wide: its names there.
_TABLE_REDOP = {"premulsum": "mulsum"}


def format_row(row: Row) -> str:
    """One table line, in nccl-tests' columns (``premulsum`` is shown as nccl-tests' ``mulsum``,
    which fits the column; the JSON and CSV keep gpucoll's name)."""
    redop = _TABLE_REDOP.get(row.redop, row.redop)
    return ("%12d  %12d  %8s  %6s  %6s" % (row.size, row.count, row.datatype, redop, "%6i" % row.root)
            + _variant(row.out_of_place) + _variant(row.in_place))


def _measurements(rows: Sequence[Row]) -> list[Measurement]:
    return [m for r in rows for m in (r.out_of_place, r.in_place) if m is not None]


def avg_busbw(rows: Sequence[Row]) -> float:
    """Mean bus bandwidth over every measured variant of every row (nccl-tests' footer)."""
    ms = _measurements(rows)
    return sum(m.busbw for m in ms) / len(ms) if ms else 0.0


def wrong_entries(rows: Sequence[Row]) -> int:
    """How many measured variants had wrong elements."""
    return sum(1 for m in _measurements(rows) if m.wrong)


def footer_lines(rows: Sequence[Row]) -> list[str]:
    """nccl-tests' footer: the count of failed checks and the average bus bandwidth."""
    bad = wrong_entries(rows)
    return ["# %-20s : %d %s" % ("Out of bounds values", bad, "FAILED" if bad else "OK"),
            "# %-20s : %g " % ("Avg bus bandwidth", avg_busbw(rows)), "#"]


def row_dict(row: Row) -> dict[str, Any]:
    """A row as a flat dict with the keys of :data:`ROW_COLUMNS`."""
    d: dict[str, Any] = {"op": row.op, "size": row.size, "count": row.count, "type": row.datatype,
                         "redop": row.redop, "root": row.root}
    for prefix, m in (("oop", row.out_of_place), ("ip", row.in_place)):
        values = (None,) * 4 if m is None else (m.time_us, m.algbw, m.busbw, m.wrong)
        d.update({f"{prefix}_{f}": v for f, v in zip(_VARIANT_FIELDS, values)})
    return d


def document(cfg: BenchConfig, env: dict[str, Any], ranks: Sequence[RankInfo],
             rows: Sequence[Row]) -> dict[str, Any]:
    """The JSON document of a run."""
    config = asdict(cfg)
    config.pop("corrupt")
    for key in ("sizes", "datatypes", "redops"):
        config[key] = list(config[key])
    bad = wrong_entries(rows)
    return {
        "schema": SCHEMA, "env": env, "config": config,
        "ranks": [asdict(r) for r in ranks],
        "rows": [row_dict(r) for r in rows],
        "summary": {"avg_busbw": avg_busbw(rows), "wrong_entries": bad, "ok": bad == 0},
    }


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Write a run's document to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def read_json(path: str) -> dict[str, Any]:
    """Read a document written by :func:`write_json`.

    Raises:
        ValueError: the file is not a gpucoll-bench document.
    """
    with open(path, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("rows"), list):
        raise ValueError(f"{path} is not a gpucoll-bench result (expected \"schema\": \"{SCHEMA}\" and rows)")
    return doc


def write_csv(path: str, doc: dict[str, Any]) -> None:
    """Write a run's rows to ``path`` as CSV, each line with the environment columns first."""
    env = doc["env"]
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(ENV_COLUMNS + ROW_COLUMNS)
        for row in doc["rows"]:
            w.writerow([env.get(k, "") for k in ENV_COLUMNS] + ["" if row[k] is None else row[k]
                                                                 for k in ROW_COLUMNS])
