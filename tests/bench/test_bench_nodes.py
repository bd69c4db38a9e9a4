"""nccl-tests' one-node command lines: ``-g 8`` on a fake machine of 8 GPUs (the NCCL
backend on the fake GPU, tests/_nccl_fake.py), ``-m`` aggregation through one group call,
and ``-t``/``-g``/``-m`` on the CPU backend as a real local job."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from _fake_gpu_bench import run_bench
from _nccl_fake import FakeComm, FakeRuntime

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = Path(__file__).parent / "data" / "nccl_tests_all_reduce_perf_g8.txt"


def _rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line and not line.startswith("#")]


def _edges(line: str) -> list[int]:
    """Where each whitespace-separated field ends (nccl-tests right-aligns every column)."""
    return [m.end() for m in re.finditer(r"\S+", line)]


def test_g8_on_eight_fake_gpus_prints_nccl_tests_table(monkeypatch: pytest.MonkeyPatch) -> None:
    codes, out = run_bench(["all_reduce", "-b", "8", "-e", "1M", "-f", "2", "-g", "8", "-n", "2", "-w", "1"],
                           monkeypatch, devices=8)
    assert codes == [0] * 8
    sample = [line for line in SAMPLE.read_text().splitlines() if not line.startswith("##")]
    assert re.search(r"^# nThread 1 nGpus 8 minBytes 8 maxBytes 1048576 step: 2\(factor\) warmup iters: 1 "
                     r"iters: 2 agg iters: 1 validation: 1 graph: 0 unalign: 0$", out, re.M), out
    # Every rank, on its own device, in nccl-tests' rank-line format.
    rank_re = r"^#  Rank +(\d+) Group +0 Pid +\d+ on +\S+ device +(\d+) \[[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\] \S.*$"
    ours = re.findall(rank_re, out, re.M)
    assert ours == [(str(r), str(r)) for r in range(8)]
    assert len(re.findall(rank_re, "\n".join(sample), re.M)) == 8
    # The three table-header lines are the sample's; each row's columns end where the sample's do.
    head = [line for line in out.splitlines() if line.startswith("#  ") and ("size" in line or "(B)" in line
                                                                            or "out-of-place" in line)]
    assert head == [line for line in sample if line.startswith("#  ") and ("size" in line or "(B)" in line
                                                                            or "out-of-place" in line)]
    rows = _rows(out)
    assert [int(r.split()[0]) for r in rows] == [8 << i for i in range(18)]
    sample_rows = {int(r.split()[0]): r for r in _rows("\n".join(sample))}
    for row in rows:
        assert _edges(row) == _edges(sample_rows[int(row.split()[0])]), row
        f = row.split()
        assert f[2:5] == ["float", "sum", "-1"] and f[8] == "0" and f[12] == "0"  # checked, no wrong element
    assert "# Out of bounds values : 0 OK" in out
    assert re.search(r"^# Avg bus bandwidth    : [0-9.e+-]+ $", out, re.M)


def test_m4_is_one_group_call_of_four_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """-m 4: every timed (and warm-up) iteration is one ncclGroupStart/End holding 4
    all_reduces; the checked runs are single ops; the values check."""
    groups: list[tuple[str, int]] = []
    real_start, real_end = FakeRuntime.group_start, FakeRuntime.group_end

    def end(self: FakeRuntime) -> None:
        if self._depth == 1 and self.fabric.current_device() == 0:
            groups.append(("end", len(self._group or [])))
        real_end(self)
    monkeypatch.setattr(FakeRuntime, "group_end", end)
    monkeypatch.setattr(FakeRuntime, "group_start", real_start)
    w, n, sizes = 1, 2, 3  # -b 8K -e 128K -f 4: 8K, 32K, 128K
    codes, out = run_bench(["all_reduce", "-b", "8K", "-e", "128K", "-f", "4", "-g", "4", "-n", str(n),
                            "-w", str(w), "-m", "4"], monkeypatch, devices=4)
    assert codes == [0] * 4
    assert " agg iters: 4 " in out and "# Out of bounds values : 0 OK" in out
    assert all(r.split()[8] == "0" and r.split()[12] == "0" for r in _rows(out))
    # warm-ups at the largest and smallest size, one unreported measurement, then every
    # size in both variants: (w + n) aggregated iterations each.
    want = 2 * w + (w + n) + sizes * 2 * (w + n)
    assert [size for _, size in groups].count(4) == want, groups


@pytest.mark.parametrize("mode, extra", [(1, []), (2, ["-m", "2"])])
def test_R_registers_pool_buffers(monkeypatch: pytest.MonkeyPatch, mode: int, extra: list[str]) -> None:
    """-R 1 / -R 2: each rank's two buffers come from ncclMemAlloc (the pool) and are registered
    (ncclCommRegister / ncclCommWindowRegister) before the sweep and deregistered after it;
    the fake refuses anything NCCL would (a window on other memory, unequal sizes); values check."""
    seen: list[tuple[str, bool]] = []
    lock = __import__("threading").Lock()

    def spy(name: str) -> None:
        real = getattr(FakeComm, name)

        def call(self: FakeComm, *a: Any) -> Any:
            if name.endswith("register") and not name.endswith("deregister"):
                with lock:
                    seen.append((name, self._rt.fabric.nccl_base(a[0], a[1]) is not None))
            else:
                with lock:
                    seen.append((name, True))
            return real(self, *a)
        monkeypatch.setattr(FakeComm, name, call)
    for name in ("register", "deregister", "window_register", "window_deregister"):
        spy(name)
    codes, out = run_bench(["all_reduce", "-b", "8", "-e", "64K", "-f", "8", "-g", "4", "-n", "2", "-w", "1",
                            "-R", str(mode), *extra], monkeypatch, devices=4)
    assert codes == [0] * 4
    words = "local (-R 1)" if mode == 1 else "symmetric (-R 2)"
    assert re.search(r"^# Buffer registration: " + re.escape(words) + r": buffers from ncclMemAlloc", out, re.M)
    assert all(r.split()[8] == "0" and r.split()[12] == "0" for r in _rows(out)) and len(_rows(out)) == 5
    reg = "register" if mode == 1 else "window_register"
    assert sorted(seen) == sorted([(reg, True)] * 8 + [(reg.replace("register", "deregister"), True)] * 8)


def test_g_beyond_the_fake_machine_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"-t 1 -g 8 runs 8 ranks, one per GPU, but this machine has 4 GPUs"):
        run_bench(["all_reduce", "-g", "8"], monkeypatch, devices=4)
    with pytest.raises(ValueError, match=r"broadcast cannot be aggregated"):
        run_bench(["broadcast", "-g", "2", "-m", "2"], monkeypatch, devices=2)


def _env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**clean, "PYTHONPATH": str(ROOT)}


def test_cpu_backend_runs_t_x_g_ranks_with_m_and_R(tmp_path: Path) -> None:
    """The same command line without GPUs: -g 2 runs 2 ranks, -m 4 aggregates, -R 1 registers
    (the CPU backend's no-op), values check."""
    done = subprocess.run([sys.executable, "-m", "gpucoll.bench", "all_reduce", "--backend", "cpu", "-b", "8",
                           "-e", "1M", "-f", "4", "-g", "2", "-m", "4", "-R", "1", "-n", "2", "-w", "1"],
                          capture_output=True, text=True, timeout=120, env=_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert re.findall(r"^#  Rank +(\d+) Group +0 Pid", out, re.M) == ["0", "1"]
    assert re.search(r"^# nThread 1 nGpus 2 .* agg iters: 4 ", out, re.M)
    assert re.search(r"^# Buffer registration: local \(-R 1\): host memory on the cpu backend, nothing to "
                     r"register \(a no-op\)$", out, re.M)
    rows = _rows(out)
    assert [int(r.split()[0]) for r in rows] == [8, 32, 128, 512, 2048, 8192, 32768, 131072, 524288]
    assert all(r.split()[8] == "0" and r.split()[12] == "0" for r in rows)
    assert "# Out of bounds values : 0 OK" in out
    bad = subprocess.run([sys.executable, "-m", "gpucoll.bench", "all_reduce", "--backend", "cpu", "-g", "2",
                          "--nproc", "3"], capture_output=True, text=True, timeout=60, env=_env(), cwd=tmp_path)
    assert bad.returncode == 2 and "--nproc 3 and -t 1 -g 2 disagree" in bad.stderr


def _coalesced_body() -> int:
    """-m 3 on the CPU backend: how many coalescing blocks the run opened (the values check)."""
    import gpucoll
    from gpucoll.bench.options import BenchConfig
    from gpucoll.bench.runner import run_rank

    blocks = [0]
    real = gpucoll.coalescing

    def counted(*a: Any, **kw: Any) -> Any:
        blocks[0] += 1
        return real(*a, **kw)
    gpucoll.coalescing = counted  # type: ignore[assignment]
    try:
        rows = run_rank(BenchConfig("all_reduce", (64,), iters=2, warmup_iters=1, agg_iters=3, backend="cpu",
                                    timeout=60.0))
    finally:
        gpucoll.coalescing = real  # type: ignore[assignment]
    assert [(r.out_of_place.wrong, r.in_place.wrong) for r in rows if r.out_of_place and r.in_place] == [(0, 0)]
    return blocks[0]


def test_cpu_m_goes_through_the_coalescing_context() -> None:
    from gpucoll.testing import run_spmd

    w, n = 1, 2
    # warm-ups (largest and smallest size), the unreported measurement, both variants of one size
    assert run_spmd(_coalesced_body, 2, timeout=120) == [2 * w + (w + n) + 2 * (w + n)] * 2


def test_g_without_any_gpu_names_the_count(tmp_path: Path) -> None:
    from _fake_gpu_world import has_gpu

    if has_gpu():
        pytest.skip("a GPU is usable here")
    done = subprocess.run([sys.executable, "-m", "gpucoll.bench", "all_reduce", "--backend", "nccl", "-g", "2"],
                          capture_output=True, text=True, timeout=60, env=_env(), cwd=tmp_path)
    assert done.returncode == 1
    assert "(-t x -g asks for 2, one rank per GPU); this machine has 0" in done.stderr, done.stderr
