"""gpucoll-bench takes nccl-tests' command lines: its flags, its header and rank lines;
--plot draws both variants; usage, --version and the recorded command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpucoll.bench.cli import build_parser, config_from_args, main

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.mark.parametrize("argv, flag, why", [
    (["-g", "0"], "-g/--ngpus must be >= 1", "got 0"),
    (["-t", "0"], "-t/--nthreads must be >= 1", "got 0"),
    (["-m", "0"], "-m/--agg_iters must be >= 1", "got 0"),
    (["-p", "1"], "-p/--parallel_init 1", "nothing to initialise in parallel"),
    (["-N", "0"], "-N/--run_cycles 0", "finite"),
    (["-T", "0"], "-T 0", "must be > 0"),
])
def test_nccl_tests_flags_refused_with_reason(argv: list[str], flag: str, why: str) -> None:
    args = build_parser().parse_args(["all_reduce", *argv])
    with pytest.raises(ValueError) as info:
        config_from_args(args, "cpu")
    assert flag in str(info.value) and why in str(info.value)


def test_nccl_tests_flags_accepted() -> None:
    args = build_parser().parse_args(["all_reduce", "-g", "1", "-t", "1", "-a", "1", "-m", "1", "-p", "0",
                                      "-N", "2", "-C", "1", "-T", "42", "-R", "0"])
    cfg = config_from_args(args, "cpu")
    assert (cfg.average, cfg.run_cycles, cfg.report_cputime, cfg.timeout) == (1, 2, True, 42.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["all_reduce", "-a", "4"])  # nccl-tests' modes are 0..3


def test_no_arguments_prints_usage_and_examples(capsys: Any) -> None:
    assert main([]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: gpucoll-bench") and "gpucoll-bench all_reduce" in out and "all_gather" in out


@pytest.mark.parametrize("module, prog", [("gpucoll.bench", "gpucoll-bench"), ("gpucoll.run", "gpucoll-run")])
def test_version(module: str, prog: str) -> None:
    import gpucoll

    done = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True,
                          timeout=60, env=_env())
    assert done.returncode == 0 and done.stdout.strip() == f"{prog} {gpucoll.__version__}"


def test_run_checks_the_script_before_starting_ranks(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "gpucoll.run", "--nproc-per-node", "2", "nosuch.py"],
                          capture_output=True, text=True, timeout=60, env=_env(), cwd=tmp_path)
    assert done.returncode == 2
    assert "script 'nosuch.py' does not exist" in done.stderr and "[rank" not in done.stderr + done.stdout


def test_pasted_nccl_tests_line_header_json_and_plot(tmp_path: Path) -> None:
    """One local job of -t 1 x -g 2 ranks: the nccl-tests header, rank lines with Group, -N 2 cycles, the typed
    command in the JSON, and a plot with both variants."""
    argv = ["all_reduce", "-b", "8", "-e", "128", "-f", "4", "-n", "2", "-w", "1", "-g", "2", "-t", "1",
            "-N", "2", "-a", "0", "--json", "r.json", "--plot", "r.png"]
    done = subprocess.run([sys.executable, "-m", "gpucoll.bench", *argv], capture_output=True, text=True,
                          timeout=120, env=_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert re.search(r"^# nThread 1 nGpus 2 minBytes 8 maxBytes 128 step: 4\(factor\) warmup iters: 1 "
                     r"iters: 2 agg iters: 1 validation: 1 graph: 0 unalign: 0$", out, re.M), out
    ranks = re.findall(r"^#  Rank +(\d+) Group +0 Pid +\d+ on +\S+ device ", out, re.M)
    assert ranks == ["0", "1"]
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["env"]["command"] == "gpucoll-bench " + " ".join(argv)  # no added --backend
    assert len(doc["rows"]) == 2 * 3  # sizes 8, 32, 128, twice (-N 2)
    assert doc["config"]["average"] == 0 and doc["config"]["run_cycles"] == 2

    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the bench extra)")
    assert (tmp_path / "r.png").stat().st_size > 0


def test_plot_draws_and_labels_both_variants(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the bench extra)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gpucoll.bench import plot

    row = {"op": "all_reduce", "type": "float", "redop": "sum", "root": -1}
    rows = [{**row, "size": s, "oop_time_us": 2.0 * s, "oop_busbw_gbs": 1.0, "ip_time_us": 1.0 * s,
             "ip_busbw_gbs": 2.0} for s in (8, 64)]
    rows.append({**row, "op": "broadcast", "size": 8, "oop_time_us": None, "oop_busbw_gbs": None,
                 "ip_time_us": 3.0, "ip_busbw_gbs": 0.5})
    doc = {"env": {"hostname": "h", "backend": "cpu", "world_size": 2}, "rows": rows}
    saved: list[Any] = []
    real = plt.close
    plt.close = lambda fig=None: saved.append(fig)  # type: ignore[assignment]
    try:
        plot.plot_runs([("run", doc)], str(tmp_path / "p.png"))
    finally:
        plt.close = real  # type: ignore[assignment]
    fig = saved[-1]
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["run | all_reduce float sum | out-of-place", "run | all_reduce float sum | in-place",
                      "run | broadcast float sum | in-place"]
    styles = [line.get_linestyle() for line in fig.axes[0].get_lines()]
    assert styles == ["-", "--", "--"]
    ip = fig.axes[0].get_lines()[1]
    assert list(ip.get_xdata()) == [8, 64] and list(ip.get_ydata()) == [2.0, 2.0]
    real(fig)
