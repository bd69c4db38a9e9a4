"""The RPC conformance suite's machinery: torch's RPC test classes, ported to NumPy
arrays, run on torch 2.13 (TensorPipe) and on gpucoll.rpc, in one world of 4 ranks per
section and implementation.

Each rank binds one implementation (_rpc_impl), builds the test case torch's
MultiProcessTestCase would (the ported class + that implementation's agent fixture +
unittest's assertions: ``self.rank``, ``self.file_name``, ``self.rpc_backend_options``,
``self.rpc`` and ``self.dist_utils``), then runs the section's tests in order, meeting
the other ranks in a FileStore (not in the library under test) before each. A test
decorated ``@dist_init`` starts and shuts down RPC itself, as in torch. Each result is
appended to a file as soon as it is known, so a world that dies or hangs still reports
what it finished; a test that runs past CHECK_TIMEOUT is recorded as failed (with every
thread's stack in the rank's log), the world is ended, and a new world resumes with the
next test.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import json
import os
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
import unittest
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from gpucoll.testing import SPMDError, run_spmd

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD_SIZE = 4  # torch's RpcAgentTestFixture.world_size
CHECK_TIMEOUT = {"torch": 60.0, "gpucoll": 30.0}  # seconds one test may take on a rank (the slowest passing one takes 15)
BARRIER_TIMEOUT = 90.0
STACK_SIGNAL = signal.SIGUSR1  # run_spmd's ranks dump their stacks on it (faulthandler)
FORK_PER_TEST = {"torch": True, "gpucoll": False}
"""torch's RRef context does not survive a shutdown and a new init_rpc in one process
(RRef tests after the first hang in the agent's join), and torch's own harness never
asks it to: each of its tests runs in a fresh process. So torch's side runs each test in
a process forked from the rank (torch imported once, before); gpucoll's runs every test
in the rank itself, one init_rpc and shutdown after another."""
MAX_WORLDS = 12  # worlds started per section before the rest is reported as not run

# section -> (module, classes, fixture kind); the order is the run order
SECTIONS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "rpc": ("_ported_rpc", ("RpcTest", "TensorPipeAgentRpcTest"), "tensorpipe"),
    "faulty": ("_ported_faulty", ("FaultyAgentRpcTest",), "faulty"),
}


class Asserts(unittest.TestCase):
    """unittest's assertions, with torch's assertEqual for arrays: same shape and values
    (nested lists, tuples and dicts compared element by element)."""

    def __init__(self) -> None:
        unittest.TestCase.__init__(self)

    def runTest(self) -> None:  # unittest wants a test method; the runner calls tests by name
        pass

    def assertEqual(self, first: Any, second: Any, msg: Any = None, **_: Any) -> None:
        if not _equal(first, second):
            raise self.failureException(msg or f"{_short(first)} != {_short(second)}")

    def assertNotEqual(self, first: Any, second: Any, msg: Any = None, **_: Any) -> None:
        if _equal(first, second):
            raise self.failureException(msg or f"{_short(first)} == {_short(second)}")


def _short(x: Any) -> str:
    text = repr(x.tolist()) if isinstance(x, np.ndarray) else repr(x)
    return text[:300]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) or _is_torch_tensor(a) or _is_torch_tensor(b):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def _is_torch_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "numpy")


def fixture_class(impl: str, kind: str) -> type:
    """The implementation's agent fixture (torch's own for torch)."""
    if impl == "torch":
        if kind == "faulty":
            from torch.testing._internal.distributed.rpc.faulty_rpc_agent_test_fixture import (
                FaultyRpcAgentTestFixture as fixture)
        else:
            from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
                TensorPipeRpcAgentTestFixture as fixture)
    else:
        from gpucoll.testing import dist_utils

        fixture = (dist_utils.FaultyRpcAgentTestFixture if kind == "faulty"
                   else dist_utils.TensorPipeRpcAgentTestFixture)
    return fixture


def make_case(cls: type, impl: str, kind: str, rank: int, file_name: str) -> Any:
    from _rpc_impl import module

    case_cls = type(cls.__name__, (cls, fixture_class(impl, kind), Asserts), {})
    case = case_cls()
    case.rank = rank
    case.file_name = file_name
    case.impl = impl
    case.rpc = module("rpc")
    case.dist_utils = module("dist_utils")
    return case


def list_tests(section: str, only: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(class name, test name) in run order (only those named in ``only``, if given);
    test names are unique within a section."""
    modname, classes, _ = SECTIONS[section]
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    mod = __import__(modname)
    out: list[tuple[str, str]] = []
    for cname in classes:
        cls = getattr(mod, cname)
        names = [n for n in cls.__dict__ if n.startswith("test_") and callable(cls.__dict__[n])]
        out += [(cname, n) for n in names]
    seen = [n for _, n in out]
    assert len(seen) == len(set(seen)), f"duplicate test names in section {section}"
    return [t for t in out if not only or t[1] in only]


# ----------------------------------------------------------------------------- ranks

def _describe(exc: BaseException) -> str:
    where = ""
    for fr in reversed(traceback.extract_tb(exc.__traceback__)):
        if "rpc_conformance" in fr.filename:
            where = f" [{os.path.basename(fr.filename)}:{fr.lineno}]"
            break
    return (f"{type(exc).__name__}: {exc}".replace("\n", " | "))[:700] + where


def _cleanup(impl: str) -> None:
    """After a failed test: leave no agent and no process group for the next one."""
    from _rpc_impl import module

    try:
        module("rpc").shutdown(graceful=True, timeout=10)
    except Exception:
        pass
    _destroy_pg()


def _shutdown_if_up() -> None:
    from _rpc_impl import module

    rpc = module("rpc")
    try:
        rpc._get_current_rpc_agent()
    except Exception:
        return  # no agent: the test shut RPC down itself
    try:
        rpc.shutdown(graceful=True, timeout=10)
    except Exception:
        rpc.shutdown(graceful=False)


def _destroy_pg() -> None:
    from _rpc_impl import module

    dist = module("dist")
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def _run_one(cls: type, name: str, impl: str, kind: str, rank: int, init_file: str) -> tuple[str, str]:
    case = make_case(cls, impl, kind, rank, init_file)
    try:
        getattr(case, name)()
        status, msg = "pass", ""
    except unittest.SkipTest as exc:
        status, msg = "skip", str(exc)
    except Exception as exc:
        status, msg = "fail", _describe(exc)
        print(f"[rank {rank}] {name} failed:\n{traceback.format_exc()}", file=sys.stderr)
        _cleanup(impl)
    else:
        # a few of torch's tests end with RPC still up (torch's harness ends the process)
        _shutdown_if_up()
        _destroy_pg()
    # the test's objects (RRefs held by a traceback, say) must not outlive its agent
    del case
    gc.collect()
    return status, msg


def _run_forked(run: Any, rank: int) -> tuple[str, str]:
    """Run one test in a child forked from this rank (a fresh process per test, as torch's
    MultiProcessTestCase gives its tests); past CHECK_TIMEOUT the child dumps its stacks
    into the rank's log and is killed, and the world goes on with the next test."""
    rfd, wfd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        try:
            result = run()
        except BaseException as exc:  # the harness itself failed in the child
            result = ("fail", _describe(exc))
        os.write(wfd, json.dumps(result).encode())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    os.close(wfd)
    deadline = time.monotonic() + CHECK_TIMEOUT["torch"]
    data = b""
    with os.fdopen(rfd, "rb") as pipe:
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([pipe], [], [], max(left, 0))
            if not ready:
                os.kill(pid, STACK_SIGNAL)
                time.sleep(1.0)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return "timeout", f"no result after {CHECK_TIMEOUT['torch']:.0f} s (stacks in rank {rank}'s log)"
            chunk = os.read(pipe.fileno(), 65536)
            if not chunk:
                break
            data += chunk
    _, code = os.waitpid(pid, 0)
    if not data:
        return "fail", f"the test's process died (wait status {code})"
    status, msg = json.loads(data)
    return str(status), str(msg)


def _rank_main(section: str, workdir: str, start: int, attempt: int, only: tuple[str, ...] = ()) -> None:
    import gpucoll
    from _rpc_impl import IMPL

    assert IMPL is not None
    rank = int(os.environ["RANK"])
    ws = int(os.environ["WORLD_SIZE"])
    _, classes, kind = SECTIONS[section]
    modname = SECTIONS[section][0]
    mod = __import__(modname)
    tests = list_tests(section, only)
    sync = gpucoll.FileStore(os.path.join(workdir, f"sync{attempt}"), ws)
    out = open(os.path.join(workdir, f"rank{rank}.jsonl"), "a", buffering=1)
    lock = threading.Lock()

    def record(name: str, status: str, msg: str, secs: float) -> None:
        with lock:
            out.write(json.dumps({"check": name, "status": status, "msg": msg, "s": round(secs, 3)}) + "\n")
            out.flush()

    if FORK_PER_TEST[IMPL]:
        fixture_class(IMPL, kind)  # import the library once, before the forks
    for i in range(start, len(tests)):
        cname, name = tests[i]
        sync.set(f"in/{i}/{rank}", b"1")
        sync.wait([f"in/{i}/{r}" for r in range(ws)], timeout=BARRIER_TIMEOUT)
        t0 = time.monotonic()
        init_file = os.path.join(workdir, f"init{attempt}_{i}")
        if FORK_PER_TEST[IMPL]:
            status, msg = _run_forked(lambda: _run_one(getattr(mod, cname), name, IMPL, kind, rank, init_file),
                                      rank)
            record(name, status, msg, time.monotonic() - t0)
            continue

        def on_timeout(name: str = name, t0: float = t0) -> None:
            record(name, "timeout", f"no result after {CHECK_TIMEOUT[IMPL]:.0f} s (stacks in rank {rank}'s log)",
                   time.monotonic() - t0)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            os._exit(3)

        watchdog = threading.Timer(CHECK_TIMEOUT[IMPL], on_timeout)
        watchdog.daemon = True
        watchdog.start()
        status, msg = _run_one(getattr(mod, cname), name, IMPL, kind, rank, init_file)
        # torch's tests may change their module (delete a function, set a one-shot
        # future) as a fresh process per test allows; the next test gets it afresh
        mod = importlib.reload(mod)
        watchdog.cancel()
        record(name, status, msg, time.monotonic() - t0)
    out.close()


# ----------------------------------------------------------------------------- parent

@dataclass(frozen=True)
class Result:
    status: str  # pass | fail | skip
    msg: str
    seconds: float


def run_section(section: str, impl: str, only: tuple[str, ...] = ()) -> dict[str, Result]:
    """Run one section (the tests named in ``only``, if given) on one implementation;
    one Result per test, by test name."""
    return dict(_run_section(section, impl, tuple(only)))


@lru_cache(maxsize=None)
def _run_section(section: str, impl: str, only: tuple[str, ...]) -> tuple[tuple[str, Result], ...]:
    names = [n for _, n in list_tests(section, only)]
    results: dict[str, Result] = {}
    with tempfile.TemporaryDirectory(prefix="gpucoll-rpcconf-") as workdir:
        start, attempt = 0, 0
        while start < len(names):
            if attempt == MAX_WORLDS:
                for n in names[start:]:
                    results[n] = Result("fail", f"not run: {MAX_WORLDS} worlds ended early", 0.0)
                break
            ended = ""
            try:
                run_spmd(_rank_main, WORLD_SIZE, args=(section, workdir, start, attempt, only), init=False,
                         timeout=60.0 + len(names) * CHECK_TIMEOUT[impl], env={"RPC_CONFORMANCE_IMPL": impl})
            except SPMDError as exc:
                ended = str(exc).strip().splitlines()[0][:300]
                # The ranks' log tails (stacks of a hung test), for a person to read: into
                # RPC_CONFORMANCE_LOGS when set, else on stderr (pytest shows it with the
                # failing test, so that a failure in CI can be read afterwards).
                text = str(exc) + "".join(f"\n===== rank {failure.rank}\n{failure.traceback}\n{failure.log_tail}"
                                          for failure in exc.failures)
                logs = os.environ.get("RPC_CONFORMANCE_LOGS")
                if logs:
                    with open(os.path.join(logs, f"{section}-{impl}-world{attempt}.txt"), "w") as f:
                        f.write(text)
                else:
                    sys.stderr.write(f"[{section}/{impl}] world {attempt} ended early:\n{text[-30000:]}\n")
            rows = _read_rows(workdir)
            for i in range(start, len(names)):
                res = _combine(names[i], rows, ended)
                if res is None:  # the world ended inside (or before) this test
                    results[names[i]] = Result(
                        "fail", f"the world ended during this test: {ended or 'no error'}; ran on ranks "
                        f"{[r for r in range(WORLD_SIZE) if names[i] in rows[r]]}", 0.0)
                    start, attempt = i + 1, attempt + 1
                    break
                results[names[i]] = res
                if res.status == "fail" and res.msg.startswith("timeout"):
                    start, attempt = i + 1, attempt + 1
                    break
            else:
                start = len(names)
    return tuple((n, results[n]) for n in names)


def _read_rows(workdir: str) -> list[dict[str, dict[str, Any]]]:
    per_rank: list[dict[str, dict[str, Any]]] = []
    for r in range(WORLD_SIZE):
        rows: dict[str, dict[str, Any]] = {}
        path = os.path.join(workdir, f"rank{r}.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    if line.strip():
                        row = json.loads(line)
                        rows.setdefault(row["check"], row)
        per_rank.append(rows)
    return per_rank


def _combine(name: str, per_rank: list[dict[str, dict[str, Any]]], ended: str) -> Result | None:
    rows = [pr.get(name) for pr in per_rank]
    secs = max((row["s"] for row in rows if row), default=0.0)
    timeouts = [r for r, row in enumerate(rows) if row and row["status"] == "timeout"]
    if timeouts:
        return Result("fail", f"timeout on ranks {timeouts}: {rows[timeouts[0]]['msg']}", secs)  # type: ignore[index]
    if any(row is None for row in rows):
        return None
    fails = [(r, row["msg"]) for r, row in enumerate(rows) if row and row["status"] == "fail"]
    if fails:
        r, msg = fails[0]
        return Result("fail", f"rank {r}: {msg}" + (f" (+{len(fails) - 1} more ranks)" if len(fails) > 1 else ""), secs)
    if any(row["status"] == "skip" for row in rows if row):
        return Result("skip", next(row["msg"] for row in rows if row and row["status"] == "skip"), secs)
    return Result("pass", "", secs)
