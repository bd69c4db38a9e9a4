"""gpucoll-bench's header, rows and footer against a stored nccl-tests output
(tests/bench/data/nccl_tests_all_reduce_perf_g8.txt, written from nccl-tests' format
strings), and the sizing of the local job from nccl-tests' -t/-g and --nproc."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpucoll.bench import report
from gpucoll.bench.cli import build_parser, config_from_args, local_job_size
from gpucoll.bench.options import BenchConfig, size_sweep
from gpucoll.bench.runner import Measurement, RankInfo, Row

SAMPLE = Path(__file__).parent / "data" / "nccl_tests_all_reduce_perf_g8.txt"


def _sample() -> list[str]:
    return [line for line in SAMPLE.read_text().splitlines() if not line.startswith("##")]


def _sample_rank(line: str) -> RankInfo:
    m = re.match(r"^#  Rank +(\d+) Group +0 Pid +(\d+) on +(\S+) device +(\d+) \[([0-9a-f:]+)\] (.+)$", line)
    assert m, line
    rank, pid, host, dev, pci, name = m.groups()
    return RankInfo(int(rank), int(pid), host, f"cuda:{dev} ({name})", int(dev), pci, name)


def _sample_row(line: str) -> Row:
    f = line.split()
    size, count, dtype, redop, root = int(f[0]), int(f[1]), f[2], f[3], int(f[4])
    oop = Measurement(float(f[5]), float(f[6]), float(f[7]), int(f[8]))
    ip = Measurement(float(f[9]), float(f[10]), float(f[11]), int(f[12]))
    return Row("all_reduce", size, count, dtype, redop, root, oop, ip)


def test_header_rows_and_footer_are_nccl_tests_lines() -> None:
    """Given the sample's values, gpucoll-bench prints the sample's lines: the parameter
    line (``-g 8``), every rank line with its device, the three table-header lines, each
    row, and the footer's two lines."""
    lines = _sample()
    params = next(line for line in lines if line.startswith("# nThread"))
    rank_lines = [line for line in lines if line.startswith("#  Rank")]
    head_at = lines.index(next(line for line in lines if "out-of-place" in line))
    rows = [line for line in lines if line and not line.startswith("#")]
    cfg = BenchConfig("all_reduce", tuple(size_sweep(8, 128 << 20, 1 << 20, 2)), minbytes=8,
                      maxbytes=128 << 20, stepfactor=2, iters=20, warmup_iters=1, backend="nccl", ngpus=8)
    env = {"world_size": 8, "gpucoll_version": "0", "nccl": "2.28.3"}
    ranks = [_sample_rank(line) for line in rank_lines]
    assert len(ranks) == 8

    ours = report.header_lines(cfg, env, ranks)
    assert ours[1] == params
    assert ours[ours.index("# Using devices") + 1:-1] == rank_lines
    assert ours[-1] == "#" and lines[head_at - 1] == "#"
    assert report.table_header() == lines[head_at:head_at + 3]
    parsed = [_sample_row(line) for line in rows]
    assert [report.format_row(r) for r in parsed] == rows
    foot = report.footer_lines(parsed)
    want = lines[lines.index(next(line for line in lines if line.startswith("# Out of bounds"))):][:3]
    assert foot[0] == want[0] and foot[2] == want[2]
    # The average is ours, over the sample's printed (rounded) busbw values: same line shape.
    assert re.fullmatch(r"# Avg bus bandwidth    : [0-9.e+-]+ ", foot[1]) and re.fullmatch(
        r"# Avg bus bandwidth    : [0-9.e+-]+ ", want[1])


def test_float_columns_follow_nccl_tests_get_float_str() -> None:
    assert report.float_str(12.3456, 7) == "  12.35"
    assert report.float_str(12345.67, 7) == "12345.7"
    assert report.float_str(1234567.0, 7) == "1234567"
    assert report.float_str(123456789.0, 7) == "1.2e+08"
    assert report.float_str(0.004, 6) == "  0.00"
    assert report.float_str(1234.5, 6) == "1234.5"


def test_registration_is_named_in_the_header() -> None:
    env = {"world_size": 2, "gpucoll_version": "0"}
    ranks = [RankInfo(0, 1, "h", "cpu"), RankInfo(1, 2, "h", "cpu")]
    for mode, words in ((1, "local (-R 1)"), (2, "symmetric (-R 2)")):
        cfg = BenchConfig("all_reduce", (8,), local_register=mode, agg_iters=4, backend="nccl")
        head = report.header_lines(cfg, env, ranks)
        assert any(line.startswith("# Buffer registration: " + words) for line in head), head
        assert " agg iters: 4 " in head[1]
    assert not any("registration" in line for line in report.header_lines(BenchConfig("all_reduce", (8,)), env, ranks))


def _args(*argv: str) -> object:
    return build_parser().parse_args(["all_reduce", *argv])


@pytest.mark.parametrize("argv, backend, gpus, ranks", [
    ((), "nccl", 4, 4),                      # every visible GPU
    ((), "cpu", 0, 2),
    (("-g", "8"), "nccl", 8, 8),
    (("-t", "2", "-g", "4"), "nccl", 8, 8),
    (("-t", "8", "-g", "1"), "nccl", 8, 8),
    (("-t", "2", "-g", "3"), "cpu", 0, 6),   # the CPU backend runs -t x -g ranks too
    (("-g", "2", "--nproc", "2"), "cpu", 0, 2),
    (("--nproc", "2"), "nccl", 1, 2),        # --nproc alone may place ranks on one GPU
])
def test_local_job_size(argv: tuple[str, ...], backend: str, gpus: int, ranks: int) -> None:
    assert local_job_size(_args(*argv), backend, gpus) == ranks  # type: ignore[arg-type]


def test_too_few_gpus_and_disagreeing_nproc_are_named() -> None:
    with pytest.raises(ValueError, match=r"-t 1 -g 8 runs 8 ranks, one per GPU, but this machine has 2 GPUs"):
        local_job_size(_args("-g", "8"), "nccl", 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"has 1 GPU visible"):
        local_job_size(_args("-t", "2", "-g", "1"), "nccl", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"--nproc 3 and -t 1 -g 2 disagree: -t x -g is 2 ranks"):
        local_job_size(_args("-g", "2", "--nproc", "3"), "cpu", 0)  # type: ignore[arg-type]


def test_the_config_keeps_t_g_m() -> None:
    cfg = config_from_args(_args("-t", "2", "-g", "4", "-m", "3"), "cpu")  # type: ignore[arg-type]
    assert (cfg.nthreads, cfg.ngpus, cfg.agg_iters) == (2, 4, 3)
    for bad in (("-g", "0"), ("-t", "0"), ("-m", "0")):
        with pytest.raises(ValueError, match="must be >= 1"):
            config_from_args(_args(*bad), "cpu")  # type: ignore[arg-type]
