"""Several "hosts" on one machine: one network namespace per host, joined by a bridge.

Each test makes its own namespaces (a switch namespace holding a bridge, and one
namespace per host with a veth into it), with addresses 10.200.X.0/24 that exist only
inside them, and removes them afterwards. One ``gpucoll-run --nnodes N`` launcher
runs per host namespace, in its own UTS namespace (its own hostname). Faults: a rank
killed, a link cut in the middle of a collective (``ip link set down``) and packet
loss (``tc ... netem``). Needs root and iproute2 (``ip``; ``tc`` and the sch_netem
module for the loss test); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from _launch_jobs import (first_stderr_line, job_env, kill_tree, pids_printed, root_cause_rank, scratch_left,
                          shm_left, store_port, wait_gone, write_script)

PG_TIMEOUT = 4.0
TOKEN = "netns-job-secret"


def _why_not() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install -y iproute2 util-linux)"
    probe = f"gpucoll-probe-{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=20)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
    if res.returncode != 0:
        return f"`ip netns add` is not permitted here: {res.stderr.strip()}"
    return None


_REASON = _why_not()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")


class Hosts:
    def __init__(self, n: int) -> None:
        tag = f"{os.getpid() % 10000}-{time.monotonic_ns() % 10000}"
        self.subnet = 10 + os.getpid() % 240
        self.switch = f"gcsw-{tag}"
        self.names = [f"gch{i}-{tag}" for i in range(n)]
        self.addrs = [f"10.200.{self.subnet}.{10 + i}" for i in range(n)]

    def up(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.names, self.addrs)):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"port{i}",
                "netns", self.switch)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"port{i}", "up")

    def down(self) -> None:
        for ns in [*self.names, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)

    def cmd(self, i: int, hostname: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', hostname, *argv]


@contextmanager
def hosts(n: int) -> Iterator[Hosts]:
    h = Hosts(n)
    try:
        h.up()
        yield h
    finally:
        h.down()


def _run_job(h: Hosts, tmp_path: Path, script: str, args: list[str], *, nproc: int = 1,
             same_hostname: bool = False, during: object = None, timeout: float = 90.0
             ) -> tuple[list[int], list[str], str]:
    """One launcher per host; returns their exit codes, their stderr and all ranks' stdout.
    ``during(h)`` is called once every launcher runs (to inject a fault)."""
    env = job_env(tmp_path / "tmp", GPUCOLL_STORE_TOKEN=TOKEN)
    n = len(h.names)
    common = ["--nnodes", str(n), "--nproc-per-node", str(nproc), "--master-addr", h.addrs[0],
              "--grace-period", "2", "--join-timeout", "20"]
    py = [sys.executable, "-m", "gpucoll.run"]
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(subprocess.Popen(
            h.cmd(0, "node" if same_hostname else "node0", [*py, *common, "--node-rank", "0", "--master-port",
                                                             "0", script, *args]),
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True))
        line, rest0 = first_stderr_line(procs[0], 30)
        port = store_port(line)
        for i in range(1, n):
            procs.append(subprocess.Popen(
                h.cmd(i, "node" if same_hostname else f"node{i}", [*py, *common, "--node-rank", str(i),
                                                                   "--master-port", port, script, *args]),
                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True))
        if callable(during):
            during(h)
        deadline = time.monotonic() + timeout
        outs, errs = [], []
        for i, p in enumerate(procs):
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(out)
            errs.append((rest0 if i == 0 else "") + err)
        return [p.returncode for p in procs], errs, "".join(outs)
    finally:
        for p in procs:
            kill_tree(p)


JOB = """
    import json, os, sys, time
    import numpy as np
    import gpucoll

    mode = sys.argv[1]
    gpucoll.init_process_group("cpu", timeout=float(sys.argv[2]))
    rank, size = gpucoll.get_rank(), gpucoll.get_world_size()
    print(f"PID {rank} {os.getpid()}", flush=True)
    x = np.arange(6, dtype=np.float64) * (rank + 1)
    gpucoll.all_reduce(x)
    assert np.array_equal(x, np.arange(6) * sum(r + 1 for r in range(size))), x
    out = [None] * size
    gpucoll.all_gather_object(out, (rank, os.uname().nodename))
    assert [o[0] for o in out] == list(range(size)), out
    print(f"OK {rank} {size}", flush=True)
    if mode == "ok":
        gpucoll.destroy_process_group()
        sys.exit(0)
    if mode == "kill":
        victim = size - 1
        if rank == victim:
            time.sleep(0.5)
            os.kill(os.getpid(), 9)
        gpucoll.all_reduce(np.ones(4))
        raise AssertionError("all_reduce returned although a peer was killed")
    # "fault": all_reduce until the network fault makes one fail; record it.
    # "lossy": 30 all_reduces under packet loss; they finish right or fail in time.
    open(f"ready.{rank}", "w").close()
    t0 = time.time()
    for i in range(30 if mode == "lossy" else 1 << 40):
        if mode == "lossy":
            time.sleep(0.05)
        try:
            y = np.ones(1 << 16)
            gpucoll.all_reduce(y)
            assert (y == size).all(), "wrong all_reduce result"
        except gpucoll.DistError as exc:
            with open(f"result.{rank}.json", "w") as f:
                json.dump({"time": time.time(), "msg": str(exc), "type": type(exc).__name__}, f)
            raise
        if time.time() - t0 > 120:
            raise AssertionError("no error within 120 s of the fault")
    print("LOSSY-OK", flush=True)
    gpucoll.destroy_process_group()
"""


def _assert_clean(tmp_path: Path, out: str, nranks: int) -> None:
    pids = pids_printed(out)
    assert len(pids) == nranks, out
    assert wait_gone(pids.values(), 10.0) == [], "ranks outlived their launchers"
    assert shm_left(pids.values()) == []
    assert scratch_left(tmp_path / "tmp") == []


@pytest.mark.parametrize("n, nproc", [(2, 1), (3, 1), (2, 2)])
def test_hosts_run_a_job(tmp_path: Path, n: int, nproc: int) -> None:
    script = write_script(tmp_path, "job.py", JOB)
    with hosts(n) as h:
        codes, errs, out = _run_job(h, tmp_path, script, ["ok", str(PG_TIMEOUT)], nproc=nproc)
    assert codes == [0] * n, errs
    assert sorted(line for line in out.splitlines() if "OK " in line) == \
        sorted(f"{'[rank%d]: ' % r if n * nproc > 1 else ''}OK {r} {n * nproc}" for r in range(n * nproc))
    _assert_clean(tmp_path, out, n * nproc)


def test_hosts_with_the_same_hostname_run_a_job(tmp_path: Path) -> None:
    script = write_script(tmp_path, "job.py", JOB)
    with hosts(2) as h:
        codes, errs, out = _run_job(h, tmp_path, script, ["ok", str(PG_TIMEOUT)], same_hostname=True, timeout=60)
    assert codes == [0, 0], errs
    _assert_clean(tmp_path, out, 2)


def test_a_killed_rank_on_another_host_is_the_root_cause_everywhere(tmp_path: Path) -> None:
    script = write_script(tmp_path, "job.py", JOB)
    with hosts(3) as h:
        codes, errs, out = _run_job(h, tmp_path, script, ["kill", str(PG_TIMEOUT)])
    assert codes == [128 + signal.SIGKILL] * 3, errs
    for err in errs:
        assert root_cause_rank(err) == 2, err[-3000:]
    _assert_clean(tmp_path, out, 3)


def _when_ready(n: int, tmp_path: Path, fault: list[str], at: list[float], in_ns: bool = True) -> object:
    def during(h: Hosts) -> None:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("ready.*"))) < n:
            assert time.monotonic() < deadline, "the ranks never got going"
            time.sleep(0.05)
        time.sleep(0.3)  # in the middle of the all_reduce loop
        at.append(time.time())
        _ip(*(["-n", h.names[1]] if in_ns else []), *fault)
    return during


def _check_fault_results(tmp_path: Path, codes: list[int], errs: list[str], at: float, n: int) -> list[float]:
    delays = []
    for r in range(n):
        path = tmp_path / f"result.{r}.json"
        assert path.exists(), f"rank {r} recorded no error; launchers said: {errs}"
        res = json.loads(path.read_text())
        delay = res["time"] - at
        delays.append(delay)
        assert delay < PG_TIMEOUT + 5, f"rank {r} failed {delay:.1f} s after the fault: {res['msg']}"
        assert "all_reduce" in res["msg"], res["msg"]
        peers = [p for p in range(n) if p != r]
        assert any(f"rank {p}" in res["msg"] for p in peers), f"rank {r}: no peer named: {res['msg']}"
    for code, err in zip(codes, errs):
        assert code == 1, err[-3000:]
        assert "root cause: rank" in err or "lost the job's store" in err, err[-3000:]
    return delays


def test_a_link_cut_mid_collective(tmp_path: Path) -> None:
    script = write_script(tmp_path, "job.py", JOB)
    at: list[float] = []
    with hosts(2) as h:
        codes, errs, out = _run_job(h, tmp_path, script, ["fault", str(PG_TIMEOUT)],
                                    during=_when_ready(2, tmp_path, ["link", "set", "eth0", "down"], at))
    delays = _check_fault_results(tmp_path, codes, errs, at[0], 2)
    print(f"time to error after the link cut: {', '.join(f'{d:.2f} s' for d in delays)}")
    _assert_clean(tmp_path, out, 2)


def _netem_reason() -> str | None:
    if _REASON is not None:
        return _REASON
    if shutil.which("tc") is None:
        return "`tc` is not installed (apt-get install -y iproute2)"
    probe = f"gpucoll-netem-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        res = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                              "loss", "30%"], capture_output=True, text=True, timeout=20)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
    if res.returncode != 0:
        return f"tc netem is unavailable (the sch_netem kernel module?): {res.stderr.strip()}"
    return None


def test_packet_loss_mid_collective(tmp_path: Path) -> None:
    """30% loss on one host's link: TCP retransmits, so the job may finish (then with
    right results) or fail (then with DistErrors in time); it must not hang."""
    reason = _netem_reason()
    if reason is not None:
        pytest.skip(reason)
    script = write_script(tmp_path, "job.py", JOB)
    at: list[float] = []
    loss = ["netem", "loss", "30%"]
    with hosts(2) as h:
        codes, errs, out = _run_job(
            h, tmp_path, script, ["lossy", str(PG_TIMEOUT)], timeout=120,
            during=_when_ready(2, tmp_path, ["netns", "exec", h.names[1], "tc", "qdisc", "add", "dev", "eth0",
                                             "root", *loss], at, in_ns=False))
    if codes == [0, 0]:
        assert sum("LOSSY-OK" in line for line in out.splitlines()) == 2, out
    else:
        _check_fault_results(tmp_path, codes, errs, at[0], 2)
    _assert_clean(tmp_path, out, 2)
