"""gpucoll-run: configuration, output pump and summary in-process; real jobs as subprocesses.

The launcher's whole point is starting and supervising processes, so its end-to-end
tests run ``python -m gpucoll.run`` itself (not ``gpucoll.testing.run_spmd``) on
small scripts written into ``tmp_path``. Each real run costs about a second.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from gpucoll._launch.errorfile import read_error, write_error
from gpucoll._launch.config import count_gpus, resolve_nproc, resolve_token
from gpucoll._launch.output import OutputPump
from gpucoll._launch.summary import RankExit, describe_code, failure_summary, launcher_exit_code, root_cause
from gpucoll.run import _parser, build_config, main

REPO = Path(__file__).resolve().parents[2]


# -- configuration ---------------------------------------------------------------------

def _config(*argv: str, environ: dict[str, str] | None = None) -> Any:
    return build_config(_parser().parse_args([*argv, "prog.py", "--flag"]), environ or {})


def test_config_defaults_one_node_free_port() -> None:
    cfg = _config("--nproc-per-node", "3")
    assert (cfg.nproc_per_node, cfg.nnodes, cfg.node_rank, cfg.world_size) == (3, 1, 0, 3)
    assert (cfg.master_addr, cfg.master_port, cfg.prefix) == ("127.0.0.1", 0, True)
    assert cfg.program == ("prog.py", "--flag") and len(cfg.token) == 32


def test_config_module_and_torchrun_spellings() -> None:
    cfg = build_config(_parser().parse_args(["--nproc_per_node", "1", "-m", "pkg.mod", "a"]), {})
    assert cfg.program == ("-m", "pkg.mod", "a") and cfg.prefix is False


def test_config_multi_node_needs_address_token_and_port() -> None:
    with pytest.raises(ValueError, match="--master-addr"):
        _config("--nnodes", "2", environ={"GPUCOLL_STORE_TOKEN": "t"})
    with pytest.raises(ValueError, match="GPUCOLL_STORE_TOKEN"):
        _config("--nnodes", "2", "--master-addr", "n0")
    with pytest.raises(ValueError, match="--master-port"):
        _config("--nnodes", "2", "--node-rank", "1", "--master-addr", "n0", environ={"GPUCOLL_STORE_TOKEN": "t"})
    cfg = _config("--nnodes", "2", "--node-rank", "1", "--master-addr", "n0", "--master-port", "29400",
                  "--nproc-per-node", "2", environ={"GPUCOLL_STORE_TOKEN": "t"})
    assert (cfg.world_size, cfg.token, cfg.hosts_store) == (4, "t", False)


@pytest.mark.parametrize("argv, names", [
    (["--nproc-per-node", "0"], "--nproc-per-node"),
    (["--nproc-per-node", "many"], "'many'"),
    (["--nnodes", "0"], "--nnodes"),
    (["--node-rank", "1"], "--node-rank"),
    (["--master-port", "70000"], "--master-port"),
    (["--tee"], "--log-dir"),
    (["--standalone", "--master-port", "5"], "--standalone"),
    (["--grace-period", "0"], "--grace-period"),
])
def test_config_errors_name_the_option(argv: list[str], names: str) -> None:
    with pytest.raises(ValueError, match=names):
        _config(*argv)


def test_main_returns_2_on_a_bad_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--nproc-per-node", "0", "x.py"]) == 2
    assert "--nproc-per-node must be >= 1" in capsys.readouterr().err
    assert main([]) == 2


@pytest.mark.parametrize("visible, count", [
    ("0,1,2", 3), ("", 0), ("-1", 0), ("0,-1,1", 1), ("GPU-8a7c,GPU-11ee", 2), ("MIG-5f2e", 1), ("0,x,1", 1)])
def test_count_gpus_reads_cuda_visible_devices_as_cuda_does(visible: str, count: int) -> None:
    assert count_gpus({"CUDA_VISIBLE_DEVICES": visible})[0] == count


def test_nproc_gpu_auto_cpu() -> None:
    assert resolve_nproc("gpu", {"CUDA_VISIBLE_DEVICES": "0,1"}) == 2
    assert resolve_nproc("auto", {"CUDA_VISIBLE_DEVICES": "3"}) == 1
    assert resolve_nproc("auto", {"CUDA_VISIBLE_DEVICES": ""}) == 1
    assert resolve_nproc("cpu", {}) == len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="no GPU found"):
        resolve_nproc("gpu", {"CUDA_VISIBLE_DEVICES": ""})


def test_token_is_fresh_per_job_unless_given() -> None:
    assert resolve_token({}, 1) != resolve_token({}, 1)
    assert resolve_token({"GPUCOLL_STORE_TOKEN": "abc"}, 3) == "abc"


# -- error files, summary, output pump ---------------------------------------------------

def test_error_file_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "5")
    path = str(tmp_path / "err.json")
    try:
        raise KeyError("missing")
    except KeyError as exc:
        assert write_error(exc, path) == path
    rec = read_error(path)
    assert rec is not None and (rec.exc_type, rec.message, rec.rank, rec.pid) == ("KeyError", "'missing'", 5, os.getpid())
    assert "raise KeyError" in rec.traceback and abs(rec.timestamp - time.time()) < 60
    assert read_error(str(tmp_path / "absent.json")) is None
    (tmp_path / "junk.json").write_text("{not json")
    assert read_error(str(tmp_path / "junk.json")) is None


def test_codes() -> None:
    assert (describe_code(3), describe_code(-9)) == ("exit code 3", "signal SIGKILL (9)")
    assert (launcher_exit_code(3), launcher_exit_code(-15)) == (3, 143)


def _exit(rank: int, code: int, t: float, signalled_at: float | None = None, err_t: float | None = None) -> RankExit:
    from gpucoll._launch.errorfile import ErrorRecord

    err = None if err_t is None else ErrorRecord("RuntimeError", f"r{rank}", "Traceback ...\nRuntimeError: r",
                                                  err_t, 100 + rank, "h", rank)
    return RankExit(rank, rank, 100 + rank, code, t, signalled_at, err)


def test_root_cause_is_the_earliest_own_failure() -> None:
    exits = [
        _exit(0, -15, 10.0, signalled_at=9.0),              # stopped by the launcher
        _exit(1, 1, 9.5, err_t=8.9),                         # raised first, exited late
        _exit(2, 1, 8.95, err_t=8.95),                       # raised second, exited first
        _exit(3, -2, 9.9, signalled_at=9.0, err_t=9.1),      # KeyboardInterrupt after the stop
        _exit(4, -15, 9.2, signalled_at=9.0, err_t=8.99),    # raised, then SIGTERMed while exiting
    ]
    root = root_cause(exits)
    assert root is not None and root.rank == 1 and root.own_code == 1
    text = failure_summary(exits, start=8.0, node_rank=0)
    assert "root cause: rank 1" in text and "also failed: rank 2 (exit code 1;" in text
    assert "also failed: rank 4 (exit code 1;" in text
    assert "stopped by gpucoll-run: ranks 0, 3" in text


def test_output_pump_prefixes_whole_lines_and_logs_raw(tmp_path: Path) -> None:
    out, err = io.BytesIO(), io.BytesIO()
    pump = OutputPump(out, err, prefix=True, log_dir=str(tmp_path), console=True)
    pipes = {}
    for rank in (0, 1):
        o_r, o_w = os.pipe()
        e_r, e_w = os.pipe()
        pump.add(rank, os.fdopen(o_r, "rb", buffering=0), os.fdopen(e_r, "rb", buffering=0))
        pipes[rank] = (o_w, e_w)
    pump.start()
    os.write(pipes[1][0], b"half a ")
    os.write(pipes[0][0], b"zero\n")
    time.sleep(0.05)
    os.write(pipes[1][0], b"line\nno newline at end")
    os.write(pipes[0][1], b"oops\n")
    for o_w, e_w in pipes.values():
        os.close(o_w)
        os.close(e_w)
    pump.join(5.0)
    assert sorted(out.getvalue().splitlines()) == [b"[rank0]: zero", b"[rank1]: half a line",
                                                   b"[rank1]: no newline at end"]
    assert err.getvalue() == b"[rank0]: oops\n"
    assert (tmp_path / "rank1.log").read_bytes() == b"half a line\nno newline at end"
    assert (tmp_path / "rank0.log").read_bytes() == b"zero\noops\n"


# -- real jobs -------------------------------------------------------------------------

def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUCOLL_STORE_TOKEN")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def _launch(tmp_path: Path, *argv: str, timeout: float = 60.0, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpucoll.run", *argv], cwd=tmp_path, env=_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def _script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_gone(pids: list[int], within: float) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


REPORT = """
    import json, os, sys
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
            "MASTER_PORT", "GPUCOLL_STORE_HOSTED", "GPUCOLL_ERROR_FILE", "OMP_NUM_THREADS"]
    info = {k: os.environ.get(k) for k in keys}
    info["argv"] = sys.argv[1:]
    info["name"] = __name__
    info["token_len"] = len(os.environ["GPUCOLL_STORE_TOKEN"])

    # The launcher serves the store: a client with the job's token gets in, one without is refused.
    from gpucoll.store import TCPStore
    from gpucoll.errors import DistError
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = TCPStore(addr, port, timeout=20, token=os.environ["GPUCOLL_STORE_TOKEN"])
    info["count"] = store.add("ranks", 1)
    try:
        TCPStore(addr, port, timeout=5, token="wrong")
        info["intruder"] = "admitted"
    except DistError as e:
        info["intruder"] = "refused"
    print("REPORT " + json.dumps(info))
    print("to stderr", file=sys.stderr)
"""


def _reports(text: str) -> dict[int, dict[str, Any]]:
    found = {}
    for line in text.splitlines():
        if "REPORT " in line:
            prefix, _, payload = line.partition("REPORT ")
            info = json.loads(payload)
            info["prefix"] = prefix
            found[int(info["RANK"])] = info
    return found


def test_one_rank_runs_the_script_as_main(tmp_path: Path) -> None:
    script = _script(tmp_path, "report.py", REPORT)
    res = _launch(tmp_path, "--nproc-per-node", "1", script, "--lr", "0.1")
    assert res.returncode == 0, res.stderr
    info = _reports(res.stdout)[0]
    assert info["prefix"] == "" and res.stderr == "to stderr\n"
    assert (info["name"], info["argv"], info["WORLD_SIZE"], info["LOCAL_WORLD_SIZE"]) == \
        ("__main__", ["--lr", "0.1"], "1", "1")
    assert info["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS")  # left alone with one rank
    assert (info["intruder"], info["token_len"]) == ("refused", 32)


def test_two_ranks_as_a_module_with_log_dir_and_tee(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text(textwrap.dedent(REPORT))
    logs = tmp_path / "logs"
    res = _launch(tmp_path, "--nproc-per-node", "2", "--log-dir", str(logs), "--tee", "-m", "mypkg.job", "x")
    assert res.returncode == 0, res.stderr
    reports = _reports(res.stdout)
    assert sorted(reports) == [0, 1]
    ports = {r["MASTER_PORT"] for r in reports.values()}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for rank, info in reports.items():
        assert info["prefix"] == f"[rank{rank}]: "
        assert (info["LOCAL_RANK"], info["WORLD_SIZE"], info["LOCAL_WORLD_SIZE"], info["GROUP_RANK"]) == \
            (str(rank), "2", "2", "0")
        assert (info["GPUCOLL_STORE_HOSTED"], info["OMP_NUM_THREADS"], info["argv"]) == ("1", "1", ["x"])
        assert info["intruder"] == "refused"
        assert info["GPUCOLL_ERROR_FILE"] == str(logs / f"error-rank{rank}.json")
        log = (logs / f"rank{rank}.log").read_text()
        assert log.startswith("REPORT ") and "to stderr\n" in log and "[rank" not in log
    assert sorted(r["count"] for r in reports.values()) == [1, 2]  # both used the one store
    assert res.stderr.count("to stderr") == 2


def test_log_dir_without_tee_keeps_the_console_quiet(tmp_path: Path) -> None:
    script = _script(tmp_path, "hi.py", "print('hi')\n")
    res = _launch(tmp_path, "--nproc-per-node", "2", "--log-dir", str(tmp_path / "l"), script)
    assert res.returncode == 0 and res.stdout == "" and res.stderr == ""
    assert (tmp_path / "l" / "rank1.log").read_text() == "hi\n"


FAILING = """
    import os, signal, subprocess, sys, time
    rank = int(os.environ["RANK"])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(f"pids.{rank}", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    while len([n for n in os.listdir(".") if n.startswith("pids.")]) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.02)
    mode = sys.argv[1]
    if rank == 1 and mode == "raise":
        def load(name):
            raise FileNotFoundError(f"no checkpoint named {name!r}")
        load("step-100")
    if rank == 1 and mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    print("waiting", flush=True)
    time.sleep(120)
"""


def _pids(tmp_path: Path, n: int, within: float = 30.0) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        files = sorted(tmp_path.glob("pids.*"))
        if len(files) == n and all(f.read_text().strip().count(" ") == 1 for f in files):
            return [int(p) for f in files for p in f.read_text().split()]
        time.sleep(0.05)
    raise AssertionError(f"the ranks did not all start within {within} s")


@pytest.mark.parametrize("mode, code, what", [
    ("raise", 1, "exit code 1"),
    ("kill", 128 + signal.SIGKILL, "signal SIGKILL (9)"),
])
def test_a_failing_rank_stops_the_job(tmp_path: Path, mode: str, code: int, what: str) -> None:
    script = _script(tmp_path, "failing.py", FAILING)
    start = time.monotonic()
    res = _launch(tmp_path, "--nproc-per-node", "3", "--grace-period", "2", script, mode)
    elapsed = time.monotonic() - start
    pids = _pids(tmp_path, 3)
    assert res.returncode == code, res.stderr
    assert elapsed < 15, f"the launcher took {elapsed:.1f} s to stop the job"
    assert _wait_gone(pids, 5.0) == [], "ranks or their children outlived the launcher"
    summary = res.stderr[res.stderr.index("gpucoll-run: job failed"):]
    assert "root cause: rank 1 (local rank 1 on node 0" in summary
    assert f"  {what}\n" in summary
    assert "stopped by gpucoll-run: ranks 0, 2" in summary
    if mode == "raise":
        assert "error: FileNotFoundError: no checkpoint named 'step-100'" in summary
        assert "load(\"step-100\")" in summary and "gpucoll/_launch_worker.py" not in summary
        assert "[rank1]: FileNotFoundError" in res.stderr  # the rank's own traceback, prefixed
    else:
        assert "no Python exception was recorded" in summary


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_to_the_launcher_reaches_every_rank(tmp_path: Path, sig: signal.Signals) -> None:
    script = _script(tmp_path, "failing.py", FAILING)
    proc = subprocess.Popen([sys.executable, "-m", "gpucoll.run", "--nproc-per-node", "2", script, "wait"],
                            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = _pids(tmp_path, 2)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # Ranks and the processes they started, all gone: by the launcher's SIGTERM/SIGKILL
    # of their process groups, or (launcher SIGKILLed) by the kernel and the reaper.
    assert _wait_gone(pids, 10.0) == []
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM
        assert "gpucoll-run: interrupted by SIGTERM" in err and "stopped by gpucoll-run: ranks 0, 1" in err
    else:
        assert proc.returncode == -signal.SIGKILL


ALL_REDUCE = """
    import numpy as np
    import gpucoll

    gpucoll.init_process_group()
    rank, size = gpucoll.get_rank(), gpucoll.get_world_size()
    x = np.arange(5, dtype=np.float64) * (rank + 1)
    gpucoll.all_reduce(x)
    expected = np.arange(5, dtype=np.float64) * sum(r + 1 for r in range(size))
    assert np.array_equal(x, expected), (x, expected)
    print(f"OK rank={rank} size={size}")
    gpucoll.destroy_process_group()
"""


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_init_process_group_without_arguments(tmp_path: Path, nproc: int) -> None:
    script = _script(tmp_path, "allreduce.py", ALL_REDUCE)
    res = _launch(tmp_path, "--nproc-per-node", str(nproc), script, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = sorted(line for line in res.stdout.splitlines() if "OK rank=" in line)
    tag = "[rank{}]: " if nproc > 1 else ""
    assert lines == sorted(f"{tag.format(r)}OK rank={r} size={nproc}" for r in range(nproc))


def test_two_nodes_share_one_store_and_fail_together(tmp_path: Path) -> None:
    """Two launchers on this host, as node 0 and node 1: node 0 serves the store on a
    free port it prints; a rank failing on node 1 stops node 0's rank too."""
    script = _script(tmp_path, "nodes.py", """
        import os, sys, time
        from gpucoll.store import TCPStore
        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=30,
                         token=os.environ["GPUCOLL_STORE_TOKEN"])
        rank = int(os.environ["RANK"])
        store.set(f"hello/{rank}", os.environ["GROUP_RANK"])
        peers = [store.get(f"hello/{r}").decode() for r in range(int(os.environ["WORLD_SIZE"]))]
        print("PEERS", rank, peers, flush=True)
        if sys.argv[1] == "fail" and rank == 1:
            raise RuntimeError("node 1 gives up")
        if sys.argv[1] == "fail":
            time.sleep(120)
    """)
    env = _env(GPUCOLL_STORE_TOKEN="two-node-secret")
    for mode in ("ok", "fail"):
        node0 = subprocess.Popen(
            [sys.executable, "-m", "gpucoll.run", "--nnodes", "2", "--node-rank", "0", "--master-addr",
             "127.0.0.1", "--master-port", "0", "--grace-period", "2", script, mode],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert node0.stderr is not None
            line = node0.stderr.readline()
            assert "--master-port" in line, line
            port = line.rsplit("--master-port", 1)[1].strip()
            node1 = subprocess.run(
                [sys.executable, "-m", "gpucoll.run", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                 "127.0.0.1", "--master-port", port, script, mode],
                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
            out0, err0 = node0.communicate(timeout=60)
        finally:
            if node0.poll() is None:
                node0.kill()
                node0.communicate()
        assert "PEERS 0 ['0', '1']" in out0 and "PEERS 1 ['0', '1']" in node1.stdout, (out0, node1.stdout)
        if mode == "ok":
            assert (node0.returncode, node1.returncode) == (0, 0), err0 + node1.stderr
        else:
            assert node1.returncode == 1 and "RuntimeError: node 1 gives up" in node1.stderr
            assert node0.returncode == 1, err0
            assert "rank 1 on node 1" in err0 and "stopped by gpucoll-run: rank 0" in err0


def test_cli_help_is_the_documented_entry_point() -> None:
    parser = _parser()
    assert parser.prog == "gpucoll-run"
    args = parser.parse_args(["--standalone", "s.py"])
    assert isinstance(args, argparse.Namespace) and build_config(args, {}).master_port == 0


def test_store_problems_fail_before_any_rank_starts(tmp_path: Path) -> None:
    import socket

    script = _script(tmp_path, "never.py", "open('started', 'w').close()\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        res = _launch(tmp_path, "--nproc-per-node", "2", "--master-port", port, script)
        assert res.returncode == 1 and f"cannot serve the job's store at 127.0.0.1:{port}" in res.stderr
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = str(closed.getsockname()[1])  # bound, never listening: connections are refused
        res = _launch(tmp_path, "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                      "--master-port", port, "--join-timeout", "1", script, GPUCOLL_STORE_TOKEN="t")
        assert res.returncode == 1 and f"cannot reach the job's store at 127.0.0.1:{port}" in res.stderr
    assert not (tmp_path / "started").exists()


@pytest.mark.gpu
def test_count_gpus_agrees_with_cuda() -> None:
    probe = subprocess.run([sys.executable, "-c", "import cupy; print(cupy.cuda.runtime.getDeviceCount())"],
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert count_gpus()[0] == int(probe.stdout.strip())
    assert resolve_nproc("gpu") == resolve_nproc("auto") == int(probe.stdout.strip())


def test_a_launcher_store_too_big_for_the_open_file_limit_is_refused_before_any_rank(tmp_path: Path) -> None:
    """The store gpucoll-run hosts knows its clients (every rank and node link): with a
    hard open-file limit that cannot hold them, the job fails at once naming the limit
    and the count, and no rank starts (instead of ranks timing out on a full server)."""
    import resource

    marker = tmp_path / "ran"
    script = _script(tmp_path, "s.py", f"open({str(marker)!r}, 'a').write('x')\n")

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))

    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "gpucoll.run", "--nproc-per-node", "400", script], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=60, preexec_fn=low_limit)
    assert proc.returncode != 0
    assert "open-file limit" in proc.stderr and "401 clients" in proc.stderr and "200" in proc.stderr, proc.stderr
    assert not marker.exists(), "a rank ran although the store could not hold the job"
    assert time.monotonic() - t0 < 30
