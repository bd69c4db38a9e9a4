"""gpucoll-run's store relays (``--store-relay``): the flag, a real job through a relay,
and 3 "hosts" in network namespaces where the store's host counts its connections.

The job's ranks count the store's connections themselves, from the kernel's table of
TCP sockets (/proc/net/tcp*): established sockets whose local port is the store's.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from _launch_jobs import first_stderr_line, job_env, kill_tree, store_port, write_script
from gpucoll._launch.config import RELAY_MIN_RANKS_PER_NODE, resolve_relay
from gpucoll.run import _parser, build_config

REPO = Path(__file__).resolve().parents[2]
TOKEN = "relay-job-secret"


def _config(*argv: str) -> Any:
    return build_config(_parser().parse_args([*argv, "prog.py"]), {"GPUCOLL_STORE_TOKEN": TOKEN})


def test_the_flag_and_its_threshold() -> None:
    many = str(RELAY_MIN_RANKS_PER_NODE)
    multi = ("--nnodes", "2", "--master-addr", "n0")
    assert _config("--nproc-per-node", "2").store_relay is False
    assert _config("--nproc-per-node", "2", "--store-relay", "on").store_relay is True
    assert _config("--nproc-per-node", many, *multi).store_relay is True
    assert _config("--nproc-per-node", str(RELAY_MIN_RANKS_PER_NODE - 1), *multi).store_relay is False
    assert _config("--nproc-per-node", many, *multi, "--store-relay", "off").store_relay is False
    # One node: the store is in the same launcher, auto leaves the relay off.
    assert _config("--nproc-per-node", many).store_relay is False
    with pytest.raises(ValueError, match="--store-relay must be auto, on or off; got 'yes'"):
        resolve_relay("yes", 2, 64)
    with pytest.raises(SystemExit):
        _parser().parse_args(["--store-relay", "yes", "prog.py"])


# A rank's view: its store goes through the relay (or not), the job works, and the
# first rank of the store's host counts the store's TCP connections.
JOB = """
    import os, sys, time
    import numpy as np
    import gpucoll

    gpucoll.init_process_group("cpu", timeout=20.0)
    rank, size = gpucoll.get_rank(), gpucoll.get_world_size()
    relay = os.environ.get("GPUCOLL_STORE_RELAY")
    x = np.arange(5, dtype=np.float64) * (rank + 1)
    gpucoll.all_reduce(x)
    assert np.array_equal(x, np.arange(5) * sum(r + 1 for r in range(size))), x
    out = [None] * size
    gpucoll.all_gather_object(out, (rank, relay))
    assert [o[0] for o in out] == list(range(size)), out
    gpucoll.barrier()

    def established(port):
        n = 0
        for name in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                lines = open(name).read().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                local, state = line.split()[1], line.split()[3]
                n += state == "01" and int(local.rsplit(":", 1)[1], 16) == port
        return n

    if rank == 0:
        print(f"ROOT_TCP {established(int(os.environ['MASTER_PORT']))}", flush=True)
    print(f"RELAY {rank} {relay}", flush=True)
    gpucoll.barrier()
    gpucoll.destroy_process_group()
"""


def _lines(text: str, tag: str) -> list[list[str]]:
    """The words after ``tag`` on each line that has it (lines are prefixed ``[rank<N>]: ``)."""
    return [m.group(1).split() for m in re.finditer(rf"(?:^|: ){tag} (.*)$", text, re.M)]


def test_a_job_through_a_relay_on_one_node(tmp_path: Path) -> None:
    script = write_script(tmp_path, "job.py", JOB)
    env = job_env(tmp_path / "tmp", GPUCOLL_STORE_TOKEN=TOKEN)
    for mode, nproc in (("on", 3), ("off", 2)):
        res = subprocess.run([sys.executable, "-m", "gpucoll.run", "--nproc-per-node", str(nproc),
                              "--store-relay", mode, script], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        relays = {r[1] for r in _lines(res.stdout, "RELAY")}
        assert len(_lines(res.stdout, "RELAY")) == nproc
        if mode == "on":
            # One relay for the node, on loopback, and the store sees one TCP connection:
            # the relay's (the ranks would otherwise use the store's Unix socket).
            assert len(relays) == 1 and re.fullmatch(r"127\.0\.0\.1:\d+", relays.pop()), res.stdout
            assert _lines(res.stdout, "ROOT_TCP") == [["1"]], res.stdout
        else:
            assert relays == {"None"}, res.stdout


def _netns_module() -> ModuleType:
    path = REPO / "tests" / "faults" / "test_multihost_netns.py"
    spec = importlib.util.spec_from_file_location("multihost_netns_for_relay", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_ns = _netns_module()


@pytest.mark.skipif(_ns._REASON is not None, reason=_ns._REASON or "")
@pytest.mark.parametrize("relay", ["on", "off"])
def test_three_hosts_the_store_holds_one_connection_per_node(tmp_path: Path, relay: str) -> None:
    nodes, nproc = 3, 2
    script = write_script(tmp_path, "job.py", JOB)
    env = job_env(tmp_path / "tmp", GPUCOLL_STORE_TOKEN=TOKEN)
    with _ns.hosts(nodes) as h:
        common = ["--nnodes", str(nodes), "--nproc-per-node", str(nproc), "--master-addr", h.addrs[0],
                  "--grace-period", "2", "--join-timeout", "30", "--store-relay", relay]
        py = [sys.executable, "-m", "gpucoll.run"]
        procs: list[subprocess.Popen[str]] = []
        try:
            procs.append(subprocess.Popen(
                h.cmd(0, "node0", [*py, *common, "--node-rank", "0", "--master-port", "0", script]),
                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True))
            line, rest0 = first_stderr_line(procs[0], 30)
            port = store_port(line)
            for i in range(1, nodes):
                procs.append(subprocess.Popen(
                    h.cmd(i, f"node{i}", [*py, *common, "--node-rank", str(i), "--master-port", port, script]),
                    cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    start_new_session=True))
            deadline = time.monotonic() + 120
            outs, errs = [], []
            for p in procs:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                outs.append(out)
                errs.append(err)
        finally:
            for p in procs:
                kill_tree(p)
    assert [p.returncode for p in procs] == [0] * nodes, errs
    stdout = "".join(outs)
    assert len(_lines(stdout, "RELAY")) == nodes * nproc
    (count,) = _lines(stdout, "ROOT_TCP")
    if relay == "on":
        # One relay per node: node 0's over loopback, the others' across the bridge.
        assert int(count[0]) == nodes, stdout
        assert len({r[1] for r in _lines(stdout, "RELAY")}) >= 1
        assert "None" not in {r[1] for r in _lines(stdout, "RELAY")}
    else:
        # Directly: at least one connection for each of the other nodes' ranks and for
        # their launchers' links, by TCP (node 0's own use the store's Unix socket; a
        # rank may hold more than one).
        assert int(count[0]) >= (nodes - 1) * (nproc + 1), stdout
