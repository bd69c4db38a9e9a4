"""A communicator from several roots' unique ids (ncclCommInitRankScalable) past a
threshold of ranks, on the fake GPU: the ids travel through the store, the fake holds
every rank to NCCL's contract (same ids, same order), and the communicator works; the
single-root path where the loaded NCCL lacks it; the settings' parsing; and the real
libnccl's symbol without a GPU."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np
import pytest

from gpucoll._backends.nccl import bootstrap
from gpucoll._backends.nccl.lib import Features
from gpucoll._env import NCCL_RANKS_PER_ROOT_ENV, NCCL_SCALABLE_INIT_ENV
from gpucoll._reduce_op import ReduceOp

from _fake_gpu_world import DEFAULT_FEATURES, OLD_FEATURES, dev, run_world
from _nccl_fake import FakeError, FakeFabric, FakeRuntime, read

SCALABLE = dataclasses.replace(DEFAULT_FEATURES, init_scalable=True)


def _all_reduce_and_record(be: Any, rt: FakeRuntime, rank: int) -> dict[str, Any]:
    buf = dev(rt, np.full(5, rank + 1, np.float32))
    be.all_reduce(buf, ReduceOp.SUM).synchronize()  # the host waits for the op itself
    return {"sum": read(rt, buf, np.float32).tolist(), "scalable": list(rt.scalable_inits),
            "inits": [kind for kind, _ in rt.configs]}


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_past_the_threshold_every_root_publishes_an_id_and_the_communicator_works(
        size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NCCL_SCALABLE_INIT_ENV, "1")
    monkeypatch.setenv(NCCL_RANKS_PER_ROOT_ENV, "2")
    roots = -(-size // 2)
    results = run_world(size, _all_reduce_and_record, features=SCALABLE)
    want = float(sum(range(1, size + 1)))
    for r in results:
        assert r["sum"] == [want] * 5
        assert r["scalable"] == [roots] and r["inits"] == ["init_scalable"]


def test_below_the_threshold_or_without_the_call_one_root_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NCCL_SCALABLE_INIT_ENV, "4")
    below = run_world(3, _all_reduce_and_record, features=SCALABLE)
    assert all(r["scalable"] == [] and r["inits"] == ["init"] and r["sum"] == [6.0] * 5 for r in below)
    monkeypatch.setenv(NCCL_SCALABLE_INIT_ENV, "1")
    old = run_world(3, _all_reduce_and_record, features=OLD_FEATURES)  # NCCL 2.19: no scalable init
    assert all(r["scalable"] == [] and r["inits"] == ["init"] and r["sum"] == [6.0] * 5 for r in old)
    monkeypatch.setenv(NCCL_SCALABLE_INIT_ENV, "off")
    off = run_world(2, _all_reduce_and_record, features=SCALABLE)
    assert all(r["scalable"] == [] for r in off)


def test_roots_are_spread_evenly_and_the_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NCCL_SCALABLE_INIT_ENV, raising=False)
    monkeypatch.delenv(NCCL_RANKS_PER_ROOT_ENV, raising=False)
    assert bootstrap.scalable_roots(bootstrap.DEFAULT_SCALABLE_FROM - 1) is None
    roots = bootstrap.scalable_roots(4096)
    assert roots is not None and len(roots) == 4096 // bootstrap.DEFAULT_RANKS_PER_ROOT
    assert roots[0] == 0 and all(b - a == bootstrap.DEFAULT_RANKS_PER_ROOT for a, b in zip(roots, roots[1:]))
    monkeypatch.setenv(NCCL_SCALABLE_INIT_ENV, "10")
    monkeypatch.setenv(NCCL_RANKS_PER_ROOT_ENV, "4")
    assert bootstrap.scalable_roots(10) == [0, 4, 7]  # ceil(10 / 4) = 3 roots: 4, 3 and 3 ranks
    assert bootstrap.scalable_roots(9) is None
    # Root i is the first rank that NCCL's bootstrap sends to id i (src/bootstrap.cc,
    # rootIdFromRank, ported as it is).
    def root_id_from_rank(rank: int, n_ranks: int, n_roots: int) -> int:
        rmr, rpr = n_ranks % n_roots, n_ranks // n_roots
        d = rmr * (rpr + 1)
        return rank // (rpr + 1) if rank < d else (rank - d) // rpr + rmr
    for per_root in ("1", "3", "4", "7"):
        monkeypatch.setenv(NCCL_RANKS_PER_ROOT_ENV, per_root)
        for size in (10, 11, 13, 23, 50):
            roots = bootstrap.scalable_roots(size)
            assert roots is not None and len(roots) == -(-size // int(per_root))
            ids = [root_id_from_rank(r, size, len(roots)) for r in range(size)]
            assert roots == [ids.index(i) for i in range(len(roots))], (per_root, size)
    monkeypatch.setenv(NCCL_RANKS_PER_ROOT_ENV, "4")
    for name, bad in ((NCCL_SCALABLE_INIT_ENV, "many"), (NCCL_SCALABLE_INIT_ENV, "-5"),
                      (NCCL_RANKS_PER_ROOT_ENV, "0"), (NCCL_RANKS_PER_ROOT_ENV, "off")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            bootstrap.scalable_roots(100)
        monkeypatch.setenv(name, "4")


def test_the_fake_holds_ranks_to_the_same_ids_in_the_same_order() -> None:
    """What NCCL requires of ncclCommInitRankScalable's callers, enforced: a rank that
    passes the ids in another order is an error, not a communicator."""
    fabric = FakeFabric(hang_limit=5.0)
    ids = [bytes([i]) * 128 for i in (1, 2, 3)]
    errors: list[str] = []

    def rank(r: int, mine: list[bytes]) -> None:
        rt = FakeRuntime(fabric, features=SCALABLE)
        try:
            rt.new_comm_scalable(2, mine, r)
        except FakeError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=rank, args=(0, ids[:2])),
               threading.Thread(target=rank, args=(1, [ids[1], ids[0]]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert any("same ids in the same order" in e for e in errors), errors
    rt = FakeRuntime(FakeFabric(hang_limit=1.0), features=SCALABLE)
    with pytest.raises(FakeError, match="nId=3 for nranks=2"):
        rt.new_comm_scalable(2, ids, 0)
    with pytest.raises(FakeError, match="not in this NCCL"):
        FakeRuntime(FakeFabric(), features=DEFAULT_FEATURES).new_comm_scalable(1, ids[:1], 0)


def test_the_real_library_binds_the_call_where_its_version_has_it() -> None:
    """Without a GPU: the libnccl CuPy's wheels bring has ncclCommInitRankScalable from
    2.23 on, and the shim binds it (and the raw calls a RawComm needs) exactly then."""
    from gpucoll._backends.nccl import lib as nccl_lib

    path = nccl_lib._find_library_path()
    if path is None:
        pytest.skip("no libnccl here (pip install nvidia-nccl-cu12)")
    shim = nccl_lib.NcclShim(path)
    version = nccl_lib.version_tuple(shim.version())
    has = shim.init_rank_scalable_fn is not None
    assert has == (version >= (2, 23, 0)), (version, has)
    features = nccl_lib.features_of(shim.version(), shim, None)
    assert features.init_scalable == (has and all(fn is not None for fn in shim.raw.values()))
    if has:
        assert all(fn is not None for fn in shim.raw.values()), {k for k, f in shim.raw.items() if f is None}


def test_features_describe_the_new_capability() -> None:
    assert "init_scalable" in Features(version=(2, 23, 0), init_scalable=True).describe()
    assert "init_scalable" not in OLD_FEATURES.describe()


class _RecordingShim:
    """A shim whose raw calls record their arguments (nccl.h's order) and return ``code``."""

    def __init__(self, code: int = 0) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.code = code
        names = ["all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "send", "recv", "abort",
                 "destroy", "user_rank", "count"]
        self.raw = {n: self._recorder(n) for n in names}
        self.all_to_all_fn = self.gather_fn = self.scatter_fn = None

    def _recorder(self, name: str) -> Any:
        def call(*args: Any) -> int:
            self.calls.append((name, args))
            return self.code
        return call

    def last_error(self, handle: int) -> str:
        return "remote process exited"

    def error_string(self, code: int) -> str:
        return "unhandled system error"


def test_a_raw_communicator_passes_the_arguments_in_ncclh_order() -> None:
    """The plan steps give CuPy's order (buffers, count, dtype, [op], [root|peer]) and
    the stream last; nccl.h wants the communicator before the stream."""
    from gpucoll._backends.nccl.rawcomm import RawComm
    from gpucoll._backends.nccl.runtime import NcclCallError

    shim = _RecordingShim()
    lib = type("Lib", (), {"shim": shim, "version": (2, 32, 3)})()
    comm = RawComm(lib, 0xC0FFEE, 1, 4)  # type: ignore[arg-type]
    comm.all_reduce(0x10, 0x20, 8, 7, 0, 0x5)
    comm.reduce(0x10, 0x20, 8, 7, 0, 2, 0x5)
    comm.broadcast(0x10, 0x20, 8, 7, 3, 0x5)
    comm.all_gather(0x10, 0x20, 8, 7, 0x5)
    comm.reduce_scatter(0x10, 0x20, 2, 7, 1, 0x5)
    comm.send(0x10, 8, 7, 2, 0x5)
    comm.recv(0x20, 8, 7, 0, 0x5)
    assert shim.calls == [
        ("all_reduce", (0x10, 0x20, 8, 7, 0, 0xC0FFEE, 0x5)),
        ("reduce", (0x10, 0x20, 8, 7, 0, 2, 0xC0FFEE, 0x5)),
        ("broadcast", (0x10, 0x20, 8, 7, 3, 0xC0FFEE, 0x5)),
        ("all_gather", (0x10, 0x20, 8, 7, 0xC0FFEE, 0x5)),
        ("reduce_scatter", (0x10, 0x20, 2, 7, 1, 0xC0FFEE, 0x5)),
        ("send", (0x10, 8, 7, 2, 0xC0FFEE, 0x5)),
        ("recv", (0x20, 8, 7, 0, 0xC0FFEE, 0x5)),
    ]
    with pytest.raises(NcclCallError, match="ncclAlltoAll"):
        comm.all_to_all(0x10, 0x20, 2, 7, 0x5)  # not in this (fake) library: named, not a crash
    comm.destroy()
    comm.destroy()  # once only
    assert [c for c in shim.calls if c[0] == "destroy"] == [("destroy", (0xC0FFEE,))] and comm.handle == 0
    failing = RawComm(type("Lib", (), {"shim": _RecordingShim(code=2), "version": (2, 32, 3)})(), 0xBEEF, 0, 2)  # type: ignore[arg-type]
    with pytest.raises(NcclCallError, match="ncclAllReduce.*remote process exited"):
        failing.all_reduce(0x10, 0x10, 1, 7, 0, 0x5)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_the_gpu_suites_scalable_body_on_the_fake_gpu(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/gpu/test_nccl_gpu_scalable.py's body and checks (every rank a root) on the
    fake GPU, world sizes 1 to 3, every send waiting for its receive: ncclSend/ncclRecv
    are "blocking for the GPU", and only a group lets them progress together (nccl.h);
    the small-message buffering that often lets an ungrouped exchange through is not
    promised, and two ranks sharing one GPU may not get it."""
    from _fake_gpu_world import FakeDeviceArray, run_fake_gpu_worlds
    from _shared_bodies import check_scalable_ops, scalable_ops_body

    monkeypatch.setenv(NCCL_SCALABLE_INIT_ENV, "1")
    monkeypatch.setenv(NCCL_RANKS_PER_ROOT_ENV, "1")

    def body(w: Any, rt: FakeRuntime, rank: int) -> dict[str, Any]:
        out = scalable_ops_body(rank, size, lambda v: FakeDeviceArray(rt, v), lambda a: a.get().tolist())
        out["comm"] = "RawComm" if rt.scalable_inits == [size] else "one root"
        return out
    check_scalable_ops(run_fake_gpu_worlds(size, body, monkeypatch, features=SCALABLE,
                                           fabric_kw={"eager_bytes": 0, "hang_limit": 8.0}))


def test_a_failed_scalable_init_is_an_error_naming_the_call_and_its_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """ncclCommInitRankScalable failing (as on a GPU) is a DistBackendError naming the
    call, nranks, nId and the ranks whose ids were passed, in order; ids NCCL would
    refuse or hang on never reach it."""
    from gpucoll._backends.nccl.lib import NcclCallError
    from gpucoll.errors import DistBackendError

    monkeypatch.setenv(NCCL_SCALABLE_INIT_ENV, "1")
    monkeypatch.setenv(NCCL_RANKS_PER_ROOT_ENV, "1")

    def refuse(self: FakeRuntime, size: int, uids: Any, rank: int, config: Any = None) -> Any:
        raise NcclCallError("ncclCommInitRankScalable", 3, "injected: internal error")
    monkeypatch.setattr(FakeRuntime, "new_comm_scalable", refuse)

    def body(be: Any, rt: FakeRuntime, rank: int) -> str:
        with pytest.raises(DistBackendError) as info:
            be.all_reduce(dev(rt, np.ones(3, np.float32)), ReduceOp.SUM)
        return str(info.value)
    for msg in run_world(2, body, features=SCALABLE, eager=False, shutdown=False):
        assert "ncclCommInitRankScalable with nranks=2, nId=2, the ids made by ranks [0, 1]" in msg, msg
        assert "injected: internal error" in msg and "group 'g'" in msg, msg
    with pytest.raises(ValueError, match="nId=3 ids for nranks=2"):
        bootstrap._check_scalable_ids([bytes([i]) * 128 for i in range(3)], 2)
    with pytest.raises(ValueError, match="not distinct"):
        bootstrap._check_scalable_ids([b"x" * 128] * 2, 2)
