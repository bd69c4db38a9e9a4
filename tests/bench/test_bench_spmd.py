"""gpucoll-bench on the CPU backend with 1, 2 and 3 ranks: every op, the check, the
corrupting hook, the in-place launch path and the CLI's own local job."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from gpucoll._buffer import dtype_by_name
from gpucoll.bench.ops import OPS
from gpucoll.bench.options import DATATYPES, redop_defined
from gpucoll.testing import run_spmd

_NONE = "none"
_PER_RANK = ("all_gather", "reduce_scatter", "alltoall", "gather", "scatter")


def _sweep_body(plan: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Run every config of ``plan`` on this rank; return each config's rows as dicts."""
    from gpucoll.bench.options import BenchConfig
    from gpucoll.bench.report import row_dict
    from gpucoll.bench.runner import run_rank

    return [[row_dict(r) for r in run_rank(BenchConfig(**kw))] for kw in plan]


def _plan(n: int) -> list[dict[str, Any]]:
    base = dict(iters=2, warmup_iters=1, check=1, backend="cpu", timeout=60.0)
    plan: list[dict[str, Any]] = []
    # Every datatype with every reduction on a small size; every datatype for movement ops.
    every_type: tuple[str, ...] = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double",
                  "bfloat16", "f8e4m3", "f8e5m2")
    for name, spec in OPS.items():
        if name == "sendrecv" and n == 1:
            continue
        types: tuple[str, ...]
        if spec.reduces:
            redops = ("sum", "prod", "max", "min", "avg", "premulsum", "band", "bor", "bxor")
            types = every_type if n == 2 else ("int32", "float", "bfloat16", "f8e5m2")
            plan.append(dict(base, op=name, sizes=(24 * n,), datatypes=types, redops=redops))
        else:
            types = every_type if n == 2 else ("int8", "float", "f8e4m3")
            plan.append(dict(base, op=name, sizes=(24 * n,), datatypes=types))
        # A small sweep in the default datatype, every root for rooted ops, and -z 1.
        plan.append(dict(base, op=name, sizes=(8, 1000, 1 << 16), root=-1 if spec.rooted else 0,
                         blocking=name in ("all_reduce", "gather")))
    # The corrupting hook: every checked variant must report wrong elements.
    for name in OPS:
        if name == "sendrecv" and n == 1:
            continue
        plan.append(dict(base, op=name, sizes=(4096,), datatypes=("float", "int8"), corrupt=True))
    return plan


def _expected_rows(kw: dict[str, Any], n: int) -> int:
    """How many rows a config yields: per datatype, sizes holding at least one element per
    rank, times the reductions defined for it, times the roots."""
    spec = OPS[kw["op"]]
    roots = n if spec.rooted and kw.get("root", 0) == -1 else 1
    total = 0
    for t in kw.get("datatypes", ("float",)):
        isz = np.dtype(dtype_by_name(DATATYPES[t]).numpy()).itemsize
        sizes = sum(1 for s in kw["sizes"] if (s // isz) // (n if spec.name in _PER_RANK else 1) > 0)
        redops = kw.get("redops", ("sum",)) if spec.reduces else (None,)
        valid = sum(1 for r in redops if r is None or redop_defined(r, t))
        total += sizes * valid * roots
    return total


@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_op_on_cpu_backend(n: int) -> None:
    plan = _plan(n)
    per_rank = run_spmd(_sweep_body, n, args=(plan,), timeout=240)
    assert all(r == per_rank[0] for r in per_rank[1:]), "ranks disagree on the rows"
    for kw, rows in zip(plan, per_rank[0]):
        spec = OPS[kw["op"]]
        want = _expected_rows(kw, n)
        assert len(rows) == want > 0, (kw["op"], len(rows), want)
        for row in rows:
            variants = [p for p in ("oop", "ip") if row[f"{p}_time_us"] is not None]
            assert variants == [p for p, c in (("oop", spec.out_of_place), ("ip", spec.in_place)) if c]
            assert row["redop"] != _NONE if spec.reduces else row["redop"] == _NONE
            assert (row["root"] >= 0) == spec.rooted
            for p in variants:
                t, alg, bus = row[f"{p}_time_us"], row[f"{p}_algbw_gbs"], row[f"{p}_busbw_gbs"]
                assert t > 0
                assert alg == pytest.approx(row["size"] / (t * 1e-6) / 1e9, rel=1e-9)
                assert bus == pytest.approx(alg * spec.busbw_factor(n), rel=1e-9)
                if kw.get("corrupt"):
                    assert row[f"{p}_wrong"] >= 1, row
                else:
                    assert row[f"{p}_wrong"] == 0, row


def _cli_body(argv: list[str]) -> tuple[int, str]:
    """Run the CLI as one rank of a launcher-started job (RANK, WORLD_SIZE in the environment)."""
    from gpucoll.bench import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def test_cli_runs_in_place_under_a_launcher(tmp_path: Any) -> None:
    path = str(tmp_path / "r.json")
    argv = ["reduce_scatter", "-b", "96", "-e", "96K", "-f", "32", "-n", "3", "-w", "1",
            "-d", "half", "-o", "max", "--backend", "cpu", "--json", path]
    results = run_spmd(_cli_body, 3, args=(argv,), init=False, timeout=120)
    assert [code for code, _ in results] == [0, 0, 0]
    table = results[0][1]
    assert results[1][1] == "" and results[2][1] == ""  # only rank 0 reports
    rows = [line.split() for line in table.splitlines() if line and not line.startswith("#")]
    assert [int(r[0]) for r in rows] == [96, 3072, 98304]
    assert [int(r[1]) for r in rows] == [16, 512, 16384]  # elements per rank, as nccl-tests
    assert all(r[2:5] == ["half", "max", "-1"] for r in rows)
    assert "# Out of bounds values : 0 OK" in table
    assert table.count("#  Rank ") == 3
    doc = json.load(open(path))
    assert doc["env"]["world_size"] == 3 and doc["env"]["backend"] == "cpu"
    assert [r["size"] for r in doc["rows"]] == [96, 3072, 98304]
    with pytest.raises(AssertionError, match="--nproc 2 given, but the launcher started 3"):
        run_spmd(_cli_body, 3, args=(argv[:-2] + ["--nproc", "2"],), init=False, timeout=60)


def _run_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    clean.update(env or {})
    return subprocess.run([sys.executable, "-m", "gpucoll.bench", *args], capture_output=True, text=True,
                          timeout=180, env=clean)


def test_cli_starts_its_own_job_and_writes_json_csv_png(tmp_path: Any) -> None:
    j, c, p = (str(tmp_path / f"run.{ext}") for ext in ("json", "csv", "png"))
    proc = _run_cli(["all_reduce", "-b", "8", "-e", "64K", "-f", "8", "-n", "3", "-w", "1",
                     "--backend", "cpu", "--json", j, "--csv", c, "--plot", p])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "world size: 2" in out and "# Avg bus bandwidth" in out and "0 OK" in out
    rows = [line.split() for line in out.splitlines() if line and not line.startswith("#")]
    assert [int(r[0]) for r in rows] == [8, 64, 512, 4096, 32768]
    doc = json.load(open(j))
    assert len(doc["rows"]) == 5 and doc["summary"]["ok"] is True
    assert open(c).read().count("\n") == 6
    assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli_corrupting_hook_makes_the_check_fail(tmp_path: Any) -> None:
    proc = _run_cli(["all_gather", "-b", "3K", "-e", "3K", "-n", "1", "-w", "0", "--nproc", "3",
                     "--backend", "cpu"], env={"GPUCOLL_BENCH_CORRUPT": "1"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    row = [line.split() for line in proc.stdout.splitlines() if line and not line.startswith("#")][0]
    assert int(row[8]) >= 1 and int(row[12]) >= 1  # #wrong, out-of-place and in-place
    assert "FAILED" in proc.stdout
