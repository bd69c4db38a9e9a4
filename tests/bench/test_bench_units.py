"""gpucoll-bench without collectives: sizes, layouts, bus-bandwidth factors, the result
check against simulated collectives, the table, JSON/CSV and the plot."""

from __future__ import annotations

import re

import csv
import json
from typing import Any

import numpy as np
import pytest

from gpucoll.bench import check, report
from gpucoll.bench.cli import main
from gpucoll.bench.ops import OPS, Layout, OpSpec, get_op
from gpucoll.bench.options import (
    ALL_DATATYPES, ALL_REDOPS, DATATYPES, BenchConfig, parse_size, redop_defined,
    resolve_datatypes, resolve_redops, size_sweep,
)
from gpucoll.bench.runner import Measurement, RankInfo, Row

# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize("text, value", [
    ("8", 8), ("1K", 1024), ("512k", 512 << 10), ("32M", 32 << 20), ("1G", 1 << 30),
    ("0.5M", 1 << 19), ("64MB", 64 << 20), ("64MiB", 64 << 20), (" 2 M ", 2 << 20),
])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-1", "1X", "M", "1.2.3"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def test_size_sweep_factor_and_step() -> None:
    assert size_sweep(8, 64 << 20, 1 << 20, 4) == [8 * 4 ** k for k in range(12)]
    assert size_sweep(1 << 20, 3 << 20, 1 << 20, 1) == [1 << 20, 2 << 20, 3 << 20]
    assert size_sweep(32 << 20, 32 << 20, 1 << 20, 1) == [32 << 20]  # nccl-tests' default
    assert size_sweep(100, 100, 0, 1) == [100]


@pytest.mark.parametrize("args, match", [
    ((64, 8, 1, 2), "minbytes and maxbytes"), ((8, 64, 1, 0), "stepfactor"),
    ((8, 64, 0, 1), "stepbytes"), ((0, 64, 1, 2), "minbytes must be > 0"),
    ((1, 10 ** 9, 1, 1), "more than"),
])
def test_size_sweep_rejects(args: tuple[int, int, int, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        size_sweep(*args)


def test_names_resolve() -> None:
    assert resolve_datatypes("float") == ("float",)
    assert resolve_datatypes("fp16") == ("half",)
    assert resolve_datatypes("ALL") == ALL_DATATYPES
    assert resolve_redops("mulsum") == ("premulsum",)
    assert resolve_redops("all") == ALL_REDOPS
    with pytest.raises(ValueError, match="unknown datatype 'complex'"):
        resolve_datatypes("complex")
    with pytest.raises(ValueError, match="unknown reduction 'xor'"):
        resolve_redops("xor")
    with pytest.raises(ValueError, match="iters"):
        BenchConfig(op="all_reduce", sizes=(8,), iters=0)


# ---------------------------------------------------------------- layouts and factors

# nccl-tests' getCollByteCount for count=10 elements and 3 ranks, written out by hand:
# (send, recv, count column, in-place send offset, in-place recv offset)
_NCCL_TESTS_LAYOUT_10_3 = {
    "all_reduce": (10, 10, 10, 0, 0), "broadcast": (10, 10, 10, 0, 0), "reduce": (10, 10, 10, 0, 0),
    "sendrecv": (10, 10, 10, 0, 0), "all_gather": (3, 9, 3, 3, 0), "gather": (3, 9, 3, 3, 0),
    "reduce_scatter": (9, 3, 3, 0, 3), "scatter": (9, 3, 3, 0, 3), "alltoall": (9, 9, 3, 0, 0),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_layout_matches_nccl_tests(name: str) -> None:
    lay = OPS[name].layout(10, 3)
    assert (lay.send_count, lay.recv_count, lay.param_count, lay.send_inplace_offset,
            lay.recv_inplace_offset) == _NCCL_TESTS_LAYOUT_10_3[name]


@pytest.mark.parametrize("name, n, factor", [
    ("all_reduce", 4, 1.5), ("all_reduce", 2, 1.0), ("all_reduce", 1, 0.0),
    ("all_gather", 4, 0.75), ("reduce_scatter", 3, 2 / 3), ("alltoall", 8, 7 / 8),
    ("gather", 2, 0.5), ("scatter", 2, 0.5), ("broadcast", 8, 1.0), ("reduce", 8, 1.0),
    ("sendrecv", 8, 1.0),
])
def test_busbw_factor(name: str, n: int, factor: float) -> None:
    assert OPS[name].busbw_factor(n) == pytest.approx(factor)


def test_get_op_aliases() -> None:
    assert get_op("all_to_all").name == "alltoall"
    with pytest.raises(ValueError, match="unknown op 'allfoo'"):
        get_op("allfoo")


# ---------------------------------------------------------------- the check, against simulated collectives

_UFUNC = {"sum": np.add, "avg": np.add, "premulsum": np.add, "prod": np.multiply, "max": np.maximum,
          "min": np.minimum, "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


def _reduce(xs: list[np.ndarray[Any, Any]], redop: str, n: int) -> np.ndarray[Any, Any]:
    """Reduce in the datatype's own arithmetic, one rank at a time (as a ring does)."""
    dt = xs[0].dtype
    if redop == "premulsum":
        xs = [(x * np.array(2, dtype=dt)).astype(dt) for x in xs]
    acc: np.ndarray[Any, Any] = xs[0].copy()
    for x in xs[1:]:
        acc = _UFUNC[redop](acc, x).astype(dt)
    if redop == "avg":
        acc = (acc // n).astype(dt) if np.issubdtype(dt, np.integer) else (acc.astype(np.float64) / n).astype(dt)
    return acc


def _simulate(spec: OpSpec, dtype: str, redop: str | None, n: int, root: int, lay: Layout,
              seed: int) -> list[np.ndarray[Any, Any]]:
    """What each rank's output holds after a correct collective (the reference)."""
    xs = [check.make_input(spec, dtype, redop, r, n, lay, seed) for r in range(n)]
    per, outs = lay.param_count, []
    for rank in range(n):
        if spec.name in ("all_reduce", "reduce"):
            out = _reduce(xs, redop or "", n)
        elif spec.name == "reduce_scatter":
            out = _reduce([x[rank * per:(rank + 1) * per] for x in xs], redop or "", n)
        elif spec.name in ("all_gather", "gather"):
            out = np.concatenate(xs)
        elif spec.name == "alltoall":
            out = np.concatenate([x[rank * per:(rank + 1) * per] for x in xs])
        elif spec.name == "broadcast":
            out = xs[root].copy()
        elif spec.name == "scatter":
            out = xs[root][rank * per:(rank + 1) * per].copy()
        else:
            out = xs[(rank - 1) % n].copy()
        outs.append(out)
    return outs


def _cases() -> list[tuple[str, str, str | None]]:
    cases: list[tuple[str, str, str | None]] = []
    for name, spec in OPS.items():
        for dt in ALL_DATATYPES:
            for redop in (ALL_REDOPS if spec.reduces else (None,)):
                if redop is not None and not redop_defined(redop, dt):
                    continue
                cases.append((name, dt, redop))
    return cases


@pytest.mark.parametrize("name, datatype, redop", _cases())
def test_check_accepts_correct_and_rejects_corrupt(name: str, datatype: str, redop: str | None) -> None:
    spec, dtype = OPS[name], DATATYPES[datatype]
    # 40 ranks: more than float8's exact integers, so sums take the 0/1 inputs.
    for n in (1, 2, 3, 5) + ((40,) if redop in ("sum", "avg", "premulsum") else ()):
        lay = spec.layout(97 * n, n)
        root = n - 1
        outs = _simulate(spec, dtype, redop, n, root, lay, seed=3)
        for rank in range(n):
            if not spec.checked(rank, root):
                continue
            exp = check.make_expected(spec, dtype, redop, rank, n, root, lay, seed=3)
            assert check.count_wrong(outs[rank], exp) == 0, (n, rank)
            bad = outs[rank].copy()
            check.corrupt(bad.view(np.uint8), bad.dtype.itemsize)
            assert check.count_wrong(bad, exp) == 1, (n, rank)


def test_check_inputs_differ_by_rank_and_seed() -> None:
    spec, lay = OPS["all_gather"], OPS["all_gather"].layout(64, 2)
    a = check.make_input(spec, "float32", None, 0, 2, lay, 1)
    assert not np.array_equal(a.view(np.uint32), check.make_input(spec, "float32", None, 1, 2, lay, 1).view(np.uint32))
    assert not np.array_equal(a.view(np.uint32), check.make_input(spec, "float32", None, 0, 2, lay, 2).view(np.uint32))
    assert np.isfinite(a).all()


def test_check_detects_a_wrong_reduction_and_a_misplaced_chunk() -> None:
    spec = OPS["all_reduce"]
    lay = spec.layout(1000, 3)
    xs = [check.make_input(spec, "float32", "sum", r, 3, lay, 1) for r in range(3)]
    exp = check.make_expected(spec, "float32", "sum", 0, 3, 0, lay, 1)
    assert check.count_wrong(np.maximum(np.maximum(xs[0], xs[1]), xs[2]), exp) > 100
    assert check.count_wrong(xs[0] + xs[1], exp) > 100  # one rank's contribution missing
    ag = OPS["all_gather"]
    lay = ag.layout(30, 3)
    ys = [check.make_input(ag, "int8", None, r, 3, lay, 1) for r in range(3)]
    exp = check.make_expected(ag, "int8", None, 0, 3, 0, lay, 1)
    assert check.count_wrong(np.concatenate([ys[1], ys[0], ys[2]]), exp) >= 15


def test_exact_limits() -> None:
    import ml_dtypes

    for name, limit in (("float16", 2048), ("bfloat16", 256), ("float8_e4m3fn", 16), ("float8_e5m2", 8)):
        npd = np.dtype(getattr(ml_dtypes, name, name))
        ints = np.arange(limit + 1, dtype=np.float64)
        assert np.array_equal(ints.astype(npd).astype(np.float64), ints), name
        assert float(np.float64(limit + 1).astype(npd)) != limit + 1, name
        assert check.exact_limit(name) == limit
    assert check.exact_limit("int8") == 127


# ---------------------------------------------------------------- the table, JSON, CSV, plot

def _rows() -> list[Row]:
    m1 = Measurement(12.345, 0.65, 0.65, 0)
    m2 = Measurement(123456.0, 1.5, 2.25, None)
    return [
        Row("all_reduce", 8, 2, "float", "sum", -1, None, m1),
        Row("all_reduce", 1 << 20, 1 << 18, "float", "sum", -1, None, m2),
    ]


def _config() -> BenchConfig:
    return BenchConfig(op="all_reduce", sizes=(8, 1 << 20), minbytes=8, maxbytes=1 << 20, stepfactor=2)


def _env() -> dict[str, Any]:
    return report.environment(_config(), 2, "cpu (test)", ["all_reduce", "-b", "8"])


def test_table_layout_matches_nccl_tests() -> None:
    head = report.table_header()
    assert head[1].split() == ["#", "size", "count", "type", "redop", "root", "time", "algbw", "busbw",
                               "#wrong", "time", "algbw", "busbw", "#wrong"]
    line = report.format_row(_rows()[0])
    # nccl-tests' writeBenchmarkLinePreamble and writeBenchmarkLineBody (src/util.cu)
    assert line == "%12d  %12d  %8s  %6s  %6s" % (8, 2, "float", "sum", "%6i" % -1) + \
        "  %7s  %6s  %6s  %6s" % (("N/A",) * 4) + "  %7s  %6s  %6s  %6g" % ("  12.35", "  0.65", "  0.65", 0)
    assert report.format_row(_rows()[1]).split()[-4:] == ["123456", "1.50", "2.25", "N/A"]
    assert report.avg_busbw(_rows()) == pytest.approx((0.65 + 2.25) / 2)
    foot = report.footer_lines(_rows())
    assert foot[0] == "# Out of bounds values : 0 OK"
    assert foot[1].startswith("# Avg bus bandwidth    : 1.45")
    bad = [Row("all_reduce", 8, 2, "float", "sum", -1, None, Measurement(1.0, 1.0, 1.0, 3))]
    assert report.footer_lines(bad)[0] == "# Out of bounds values : 1 FAILED"


def test_json_and_csv_schema(tmp_path: Any) -> None:
    env = _env()
    for key in ("gpucoll_version", "python", "numpy", "hostname", "backend", "world_size", "device",
                "date", "command"):
        assert key in env, key
    ranks = [RankInfo(0, 10, "h", "cpu"), RankInfo(1, 11, "h", "cpu")]
    doc = report.document(_config(), env, ranks, _rows())
    path = str(tmp_path / "run.json")
    report.write_json(path, doc)
    back = report.read_json(path)
    assert back["schema"] == report.SCHEMA
    assert set(back) == {"schema", "env", "config", "ranks", "rows", "summary"}
    assert back["config"]["sizes"] == [8, 1 << 20] and "corrupt" not in back["config"]
    assert [set(r) for r in back["rows"]] == [set(report.ROW_COLUMNS)] * 2
    assert back["rows"][0]["oop_time_us"] is None and back["rows"][0]["ip_wrong"] == 0
    assert back["rows"][1]["ip_busbw_gbs"] == 2.25 and back["rows"][1]["ip_wrong"] is None
    assert back["summary"] == {"avg_busbw": pytest.approx(1.45), "wrong_entries": 0, "ok": True}
    assert back["ranks"][1] == {"rank": 1, "pid": 11, "hostname": "h", "device": "cpu", "cuda_device": -1,
                                "pci": "", "gpu_name": ""}
    cpath = str(tmp_path / "run.csv")
    report.write_csv(cpath, doc)
    with open(cpath, newline="") as f:
        lines = list(csv.DictReader(f))
    assert list(lines[0]) == list(report.ENV_COLUMNS + report.ROW_COLUMNS)
    assert len(lines) == 2
    assert lines[1]["size"] == str(1 << 20) and lines[1]["backend"] == "cpu" and lines[1]["world_size"] == "2"
    assert lines[0]["oop_time_us"] == ""
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not a gpucoll-bench result"):
        report.read_json(str(tmp_path / "other.json"))


def test_plot_writes_png_of_several_runs(tmp_path: Any) -> None:
    from gpucoll.bench.plot import plot_runs

    doc = report.document(_config(), _env(), [], _rows())
    other = json.loads(json.dumps(doc))
    for row in other["rows"]:
        row["ip_busbw_gbs"] *= 2
    out = tmp_path / "cmp.png"
    plot_runs([("a", doc), ("b", other)], str(out))
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_runs([("empty", {**doc, "rows": []})], str(tmp_path / "empty.png"))


def test_plot_command_reads_saved_runs(tmp_path: Any, capsys: Any) -> None:
    doc = report.document(_config(), _env(), [], _rows())
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    report.write_json(str(a), doc)
    report.write_json(str(b), doc)
    assert main(["plot", str(a), str(b), "--plot", str(tmp_path / "ab.png")]) == 0
    assert (tmp_path / "ab.png").read_bytes()[:4] == b"\x89PNG"
    assert "2 runs" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["all_reduce", "-G", "1"], "cudagraph"),
    (["all_reduce", "-d", "float128"], "unknown datatype"),
    (["all_reduce", "-o", "foo"], "unknown reduction"),
    (["all_reduce", "-b", "1M", "-e", "8"], "minbytes and maxbytes"),
    (["all_reduce", "-z", "2"], "blocking"),
    (["all_reduce", "--nproc", "0"], "--nproc"),
    (["all_reduce", "--json", "/nonexistent/dir/x.json"], "does not exist"),
    (["plot", "--plot", "x.png"], "RUN.json"),
    (["all_reduce", "extra.json"], "only 'plot' takes files"),
    (["sendrecv", "--nproc", "1", "--backend", "cpu"], "at least 2 ranks"),
    (["scatter", "--nproc", "2", "-r", "5", "--backend", "cpu"], "below the world size 2; got 5"),
    (["all_reduce", "-o", "band", "--backend", "cpu"], "band is not defined on float"),
    (["all_reduce", "-d", "int8", "-o", "premulsum", "--backend", "cpu"], "not defined on int8"),
])
def test_cli_rejects_bad_arguments(argv: list[str], message: str, capsys: Any) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_imports_nothing_heavy_before_running() -> None:
    import subprocess
    import sys

    code = ("import sys; from gpucoll.bench.cli import build_parser, config_from_args; "
            "a = build_parser().parse_args(['all_reduce', '-b', '8', '-e', '1M', '-f', '2', '--plot', 'x.png']); "
            "config_from_args(a, 'cpu'); "
            "print(sorted(m for m in ('matplotlib', 'cupy', 'ml_dtypes') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_progress_line_only_on_a_terminal() -> None:
    import io

    from gpucoll.bench.session import _Progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        p = _Progress(stream)
        p.update("all_reduce float sum 8 B in-place")
        p.clear()
        p.clear()
    assert pipe.getvalue() == ""
    text = tty.getvalue()
    assert text.startswith("\r\033[K# [") and "running all_reduce float sum 8 B in-place" in text
    assert text.endswith("in-place\r\033[K")  # cleared once, before the row is printed


def test_device_wrapper_reads_as_its_dtype_in_the_array_layer() -> None:
    """bfloat16/float8 device buffers (CuPy bytes underneath) present the right dtype and slices."""
    from gpucoll.array import as_buffer
    from gpucoll.bench.arrays import _ExoticDeviceArray

    class FakeCupyBytes:  # the parts of a CuPy uint8 array the wrapper uses, on host memory
        def __init__(self, a: np.ndarray[Any, Any]) -> None:
            self.a, self.size = a, a.size

        def __getitem__(self, key: slice) -> FakeCupyBytes:
            return FakeCupyBytes(self.a[key])

        @property
        def device(self) -> Any:
            return type("Device", (), {"id": 0})()

        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            return {"data": (self.a.ctypes.data, False), "shape": self.a.shape, "typestr": "|u1",
                    "version": 3, "strides": None, "stream": 1}

    mem = np.arange(64, dtype=np.uint8)
    for name, isz in (("bfloat16", 2), ("float8_e4m3fn", 1), ("float8_e5m2", 1)):
        arr = _ExoticDeviceArray(FakeCupyBytes(mem), name, check.np_dtype(name))
        assert len(arr) == 64 // isz
        part = arr[3:7]
        buf = as_buffer(part, writable=True)
        assert (buf.dtype.name, buf.shape, buf.nbytes) == (name, (4,), 4 * isz)
        assert buf.ptr == mem.ctypes.data + 3 * isz and str(buf.device) == "cuda:0"
        with pytest.raises(ValueError, match="contiguous"):
            arr[::2]


def test_every_redop_keeps_the_table_columns() -> None:
    """Each row's fields end at the header's column edges, whatever the reduction's name."""
    from gpucoll.bench.options import REDOPS

    head = report.table_header()[1]
    edges = [f.end() for f in re.finditer(r"\S+", head)]  # nccl-tests' header ends with a space
    m = Measurement(12.345, 0.65, 0.65, 0)
    for redop in REDOPS:
        line = "#" + report.format_row(Row("all_reduce", 8, 2, "float", redop, -1, m, m))[1:]
        ends = [f.end() for f in re.finditer(r"\S+", line)]
        assert ends == edges, (redop, line, head)


def test_the_docs_flag_table_matches_the_parser() -> None:
    """Every short/long flag pair in docs/benchmark.md's tables is the parser's own."""
    import re
    from pathlib import Path

    from gpucoll.bench.cli import build_parser

    docs = (Path(__file__).resolve().parents[2] / "docs" / "benchmark.md").read_text()
    pairs = re.findall(r"^\| `(-\w)/(--\w+)`", docs, flags=re.M)
    assert len(pairs) > 10
    actions = {s: a for a in build_parser()._actions for s in a.option_strings}
    for short, long in pairs:
        assert short in actions and long in actions, (short, long)
        assert actions[short] is actions[long], f"{short} and {long} are different flags"


def test_cudagraph_on_the_command_line_is_judged_against_the_backend_the_run_gets(
        capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """-G on the command line: refused by name on the cpu backend (asked for, or what
    "auto" finds without a GPU); with --backend nccl it is the GPU that is missing, not
    the backend; and with a GPU the run starts with -G and the nccl backend."""
    from gpucoll.bench import cli

    gpu = cli._gpu_count()[0] > 0
    for argv in (["all_reduce", "-G", "2", "--backend", "cpu"], ["all_reduce", "-G", "2", "--nproc", "1"]):
        if argv[-1] == "1" and gpu:
            continue  # "auto" finds the GPU here
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert "CUDA graphs need the nccl backend" in capsys.readouterr().err
    if not gpu:
        assert main(["all_reduce", "-G", "2", "--backend", "nccl", "--nproc", "1"]) == 1
        err = capsys.readouterr().err
        assert "--backend nccl needs a usable CUDA GPU" in err and "'cpu'" not in err, err
    # With a GPU (pretended here): validation passes and the ranks start with -G and nccl.
    started: list[list[str]] = []

    def run_local(nproc: int, argv: list[str], **kw: Any) -> int:
        started.append([str(nproc), *argv])
        return 0
    monkeypatch.setattr(cli, "_gpu_count", lambda: (1, ""))
    monkeypatch.setattr("gpucoll.bench.spawn.run_local", run_local)
    for backend in ("nccl", "auto"):
        assert main(["all_reduce", "-G", "4", "--backend", backend, "-b", "1K", "-e", "1K"]) == 0
        assert started[-1] == ["1", "all_reduce", "-G", "4", "--backend", backend, "-b", "1K", "-e", "1K",
                               "--backend", "nccl"]
    with pytest.raises(SystemExit):
        main(["all_reduce", "-G", "4", "-z", "1", "--backend", "nccl"])
    assert "-z 1" in capsys.readouterr().err


def test_cudagraph_takes_nccl_tests_meaning() -> None:
    """-G N: the timed ops are captured once and the graph launched N times (nccl-tests'
    BenchTime); refused on the CPU backend and with -z 1."""
    from gpucoll.bench.cli import build_parser, config_from_args
    from gpucoll.bench.runner import _Case, _Variant

    cfg = config_from_args(build_parser().parse_args(["all_reduce", "-G", "3", "-n", "5"]), "nccl")
    assert cfg.cudagraph == 3
    for argv, backend, message in ((["all_reduce", "-G", "1"], "cpu", "nccl backend"),
                                   (["all_reduce", "-G", "1", "-z", "1"], "nccl", "-z 1")):
        with pytest.raises(ValueError, match=message):
            config_from_args(build_parser().parse_args(argv), backend)

    events: list[str] = []

    class Kit:
        def capture(self, issue: Any) -> str:
            events.append("capture")
            issue()
            events.append("captured")
            return "graph"

        def launch(self, graph: str, times: int) -> None:
            events.append(f"launch {graph} x{times}")

        def synchronize(self) -> None:
            events.append("sync")

    def caller(call: Any) -> list[Any]:
        assert call.async_op is False  # synchronous ops: inside a capture, nothing to wait for
        events.append("op")
        return []

    case = _Case(cfg, get_op("all_reduce"), Kit(), "float", "sum", 0, 0, 1)  # type: ignore[arg-type]
    t0, issued, end = case._graph_loop(caller, _Variant(None, None, None), 5, lambda: events.append("barrier"))
    assert events == ["capture", "op", "op", "op", "op", "op", "captured", "barrier", "launch graph x3", "sync"]
    assert t0 <= issued <= end
