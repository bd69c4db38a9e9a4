"""The conformance suite's machinery: a registry of checks, an adapter that lets one
check body run on gpucoll (NumPy arrays) and on torch.distributed (gloo, torch
tensors), and a runner that starts one world per section and returns one result per
check.

A check is a function ``fn(T)`` run on every rank; ``T`` is an :class:`Impl`. It
raises on failure (``AssertionError`` or whatever the library raised), calls
``T.skip(reason)`` where the check does not apply to that implementation, and
returns nothing. Ranks run the checks of a section in order, meeting in a FileStore
(not in the group under test) before each one, and append each result to a file as
soon as it is known, so a world that dies or hangs still reports what it finished.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from functools import lru_cache
from typing import Any, Callable, Sequence

import numpy as np

from gpucoll.testing import SPMDError, run_spmd

IMPLS = ("gpucoll", "torch")


class Skip(Exception):
    """Raised by a check that does not apply to this implementation."""


@dataclass
class Check:
    name: str
    fn: Callable[["Impl"], None]
    world_sizes: tuple[int, ...]
    source: str  # the torch test (file::name) whose intent this check ports


@dataclass
class Section:
    """Checks that share one world. ``init`` starts a process group before the checks."""

    name: str
    world_sizes: tuple[int, ...]
    init: bool = True
    pg_timeout: float = 20.0
    timeout: float = 120.0
    env: dict[str, str] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    def check(self, source: str, world_sizes: Sequence[int] | None = None) -> Callable[[Callable[["Impl"], None]], Callable[["Impl"], None]]:
        def register(fn: Callable[["Impl"], None]) -> Callable[["Impl"], None]:
            name = fn.__name__.removeprefix("check_")
            assert all(c.name != name for c in self.checks), f"duplicate check {name} in {self.name}"
            self.checks.append(Check(name, fn, tuple(world_sizes or self.world_sizes), source))
            return fn
        return register


SECTIONS: dict[str, Section] = {}


def section(name: str, world_sizes: Sequence[int], **kw: Any) -> Section:
    # a second section of one name would replace the first, whose checks then never run
    assert name not in SECTIONS, f"duplicate section {name}"
    sec = Section(name, tuple(world_sizes), **kw)
    SECTIONS[name] = sec
    return sec


def check_ids(sec: Section) -> list[tuple[str, int]]:
    """(check name, world size) pairs in a section, in run order."""
    return [(c.name, ws) for ws in sec.world_sizes for c in sec.checks if ws in c.world_sizes]


# ----------------------------------------------------------------------------- adapter

_DTYPES = ("float32", "float64", "float16", "int8", "uint8", "int32", "int64", "bool", "complex64", "complex128")


class Impl:
    """What a check sees: the library under test (``T.dist``), this rank, and array helpers
    that build a NumPy array for gpucoll and a torch tensor for torch."""

    def __init__(self, name: str, rank: int, world_size: int, workdir: str) -> None:
        self.name = name
        self.rank = rank
        self.ws = world_size
        self.workdir = workdir
        if name == "torch":
            import torch
            import torch.distributed as dist

            self.torch: Any = torch
            self.dist: Any = dist
            self.backend = "gloo"
        else:
            import gpucoll

            self.torch = None
            self.dist = gpucoll
            self.backend = "cpu"

    @property
    def is_torch(self) -> bool:
        return self.name == "torch"

    def init(self, pg_timeout: float) -> None:
        if self.is_torch:
            self.dist.init_process_group("gloo", init_method=f"file://{self.workdir}/torch_pg",
                                         rank=self.rank, world_size=self.ws,
                                         timeout=timedelta(seconds=pg_timeout))
        else:
            # env:// from the harness, as a ported script calls it
            self.dist.init_process_group("gloo", rank=self.rank, world_size=self.ws, timeout=pg_timeout)

    def skip(self, reason: str) -> None:
        raise Skip(reason)

    def only_gpucoll(self, reason: str) -> None:
        if self.is_torch:
            raise Skip(reason)

    # arrays
    def dtype(self, name: str) -> Any:
        assert name in _DTYPES, name
        return getattr(self.torch, name) if self.is_torch else np.dtype(name)

    def arr(self, data: Any, dtype: str = "float32") -> Any:
        a = np.array(data, dtype=dtype)
        return self.torch.from_numpy(a.copy()) if self.is_torch else a

    def zeros(self, shape: Any, dtype: str = "float32") -> Any:
        return self.arr(np.zeros(shape, dtype=dtype), dtype)

    def full(self, shape: Any, value: Any, dtype: str = "float32") -> Any:
        return self.arr(np.full(shape, value, dtype=dtype), dtype)

    def np(self, x: Any) -> np.ndarray:
        return x.detach().numpy() if self.is_torch else np.asarray(x)

    def view_as_real(self, x: Any) -> Any:
        if self.is_torch:
            return self.torch.view_as_real(x)
        return x.view(np.float32 if x.dtype == np.complex64 else np.float64).reshape(*x.shape, 2)

    def op(self, name: str) -> Any:
        return getattr(self.dist.ReduceOp, name)


def eq(actual: Any, expected: Any, T: Impl | None = None, what: str = "") -> None:
    a = T.np(actual) if T is not None else np.asarray(actual)
    e = np.asarray(expected)
    if a.shape != e.shape or not np.array_equal(a, e):
        raise AssertionError(f"{what or 'value'}: got {a.tolist()!r} (shape {a.shape}), expected {e.tolist()!r}")


def raises(excs: Any, fn: Callable[[], Any], match: str | None = None) -> BaseException:
    """Call ``fn`` and return the exception it raised; fail when it raises none, another
    type, or a message without ``match`` (case-insensitive)."""
    try:
        fn()
    except excs as exc:
        if match is not None and match.lower() not in str(exc).lower():
            raise AssertionError(f"{type(exc).__name__} message lacks {match!r}: {exc}") from exc
        return exc
    except Exception as exc:
        raise AssertionError(f"expected {excs}, got {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"expected {excs}, nothing was raised")


# ----------------------------------------------------------------------------- ranks

def _describe(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    for fr in reversed(frames):
        if "conformance" in fr.filename:
            where = f" [{os.path.basename(fr.filename)}:{fr.lineno}]"
            break
    text = f"{type(exc).__name__}: {exc}".replace("\n", " | ")
    return text[:700] + where


def _rank_main(section_name: str, impl: str, workdir: str) -> None:
    import gpucoll

    _load_checks()
    sec = SECTIONS[section_name]
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    T = Impl(impl, rank, ws, workdir)
    sync = gpucoll.FileStore(os.path.join(workdir, "sync"), ws)
    out = open(os.path.join(workdir, f"rank{rank}.jsonl"), "a", buffering=1)
    if sec.init:
        T.init(sec.pg_timeout)
    for i, chk in enumerate(c for c in sec.checks if ws in c.world_sizes):
        sync.set(f"in/{i}/{rank}", b"1")
        sync.wait([f"in/{i}/{r}" for r in range(ws)], timeout=2 * sec.pg_timeout + 10)
        t0 = time.monotonic()
        try:
            chk.fn(T)
            status, msg = "pass", ""
        except Skip as exc:
            status, msg = "skip", str(exc)
        except Exception as exc:
            status, msg = "fail", _describe(exc)
        out.write(json.dumps({"check": chk.name, "status": status, "msg": msg,
                              "s": round(time.monotonic() - t0, 3)}) + "\n")
    if sec.init:
        # Every rank finishes the section before any tears its group down (torch's test
        # harness keeps all processes alive until all finish): a rank that ends its last
        # check early must not break a peer still inside it (e.g. still setting up a group).
        sync.set(f"end/{rank}", b"1")
        try:
            sync.wait([f"end/{r}" for r in range(ws)], timeout=2 * sec.pg_timeout + 10)
        except Exception:
            pass  # a peer died or hangs: its checks already report it
        T.dist.destroy_process_group()
    out.close()


@dataclass(frozen=True)
class Result:
    status: str  # pass | fail | skip
    msg: str
    seconds: float


def run_section(section_name: str, impl: str, world_size: int) -> dict[str, Result]:
    """Run one section on one implementation in one world; one Result per check."""
    return dict(_run_section(section_name, impl, world_size))


@lru_cache(maxsize=None)
def _run_section(section_name: str, impl: str, world_size: int) -> tuple[tuple[str, Result], ...]:
    _load_checks()
    sec = SECTIONS[section_name]
    names = [c.name for c in sec.checks if world_size in c.world_sizes]
    env = dict(sec.env)
    with tempfile.TemporaryDirectory(prefix="gpucoll-conf-") as workdir:
        ended = ""
        try:
            run_spmd(_rank_main, world_size, args=(section_name, impl, workdir), init=False,
                     timeout=sec.timeout, env=env)
        except SPMDError as exc:
            ended = str(exc).strip().splitlines()[0][:300]
        per_rank: list[dict[str, dict[str, Any]]] = []
        for r in range(world_size):
            rows: dict[str, dict[str, Any]] = {}
            path = os.path.join(workdir, f"rank{r}.jsonl")
            if os.path.exists(path):
                with open(path) as f:
                    for line in f:
                        if line.strip():
                            row = json.loads(line)
                            rows[row["check"]] = row
            per_rank.append(rows)
    results = []
    for name in names:
        rows = [pr.get(name) for pr in per_rank]
        secs = max((row["s"] for row in rows if row), default=0.0)
        fails = [(r, row["msg"]) for r, row in enumerate(rows) if row and row["status"] == "fail"]
        missing = [r for r, row in enumerate(rows) if row is None]
        if fails:
            r, msg = fails[0]
            res = Result("fail", f"rank {r}: {msg}" + (f" (+{len(fails) - 1} more ranks)" if len(fails) > 1 else ""), secs)
        elif missing:
            res = Result("fail", f"no result from ranks {missing}; the world ended: {ended or 'no error'}", secs)
        elif any(row["status"] == "skip" for row in rows if row):
            res = Result("skip", next(row["msg"] for row in rows if row and row["status"] == "skip"), secs)
        else:
            res = Result("pass", "", secs)
        results.append((name, res))
    return tuple(results)


def _load_checks() -> None:
    # importing the check modules registers their sections
    import _conf_checks_coll  # noqa: F401
    import _conf_checks_groups  # noqa: F401
    import _conf_checks_store  # noqa: F401
    import _conf_ported_store  # noqa: F401
    import _conf_ported_groups  # noqa: F401
    import _conf_tutorial  # noqa: F401
