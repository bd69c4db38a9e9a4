"""pg_options: NCCLOptions reach the communicator's init, split and shrink on the fake GPU
(tests/_nccl_fake.py records the config each communicator was made with); fields too new
for the loaded NCCL, or that the runtime cannot apply, are refused by name; the ctypes
ncclConfig_t mirror matches the wheel's nccl.h; CPUOptions pick the CPU transport and
timeout in real multi-process worlds."""

from __future__ import annotations

import ctypes
import os
import re
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import gpucoll
from gpucoll._backends.nccl import config as nccl_config
from gpucoll._backends.nccl.lib import Features
from gpucoll._group.options import coerce_options
from gpucoll.errors import BackendUnavailableError
from gpucoll.testing import run_spmd

from _fake_gpu_world import FakeDeviceArray, run_fake_gpu_worlds

NEW = Features(version=(2, 32, 3), all_to_all=True, gather=True, scatter=True, comm_shrink=True)
NO_SPLIT = Features(version=(2, 32, 3), all_to_all=True, gather=True, scatter=True, comm_split=False)
OLD = Features(version=(2, 26, 0), comm_shrink=False)


# ----- the options themselves -----

@pytest.mark.parametrize("kwargs, exc, words", [
    ({"min_ctas": "4"}, TypeError, ["min_ctas", "int"]),
    ({"max_ctas": -1}, ValueError, ["max_ctas", "-1"]),
    ({"cga_cluster_size": True}, TypeError, ["cga_cluster_size"]),
    ({"net_name": 5}, TypeError, ["net_name", "str"]),
    ({"comm_name": ""}, ValueError, ["comm_name"]),
    ({"comm_name": "a\0b"}, ValueError, ["comm_name", "NUL"]),
    ({"blocking": "yes"}, TypeError, ["blocking", "bool"]),
    ({"split_share": 2}, TypeError, ["split_share"]),
    ({"is_high_priority_stream": 1}, TypeError, ["is_high_priority_stream"]),
    ({"timeout": -3}, ValueError, ["pg_options.timeout"]),
    ({"timeout": "10"}, TypeError, ["pg_options.timeout"]),
])
def test_bad_nccl_options_are_refused_naming_the_field(kwargs: dict[str, Any], exc: type, words: list[str]) -> None:
    with pytest.raises(exc) as info:
        gpucoll.NCCLOptions(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_nccl_options_normalise_and_report_the_set_fields() -> None:
    opts = gpucoll.NCCLOptions(split_share=1, max_ctas=8, comm_name="tp", timeout=timedelta(seconds=7))
    assert opts.split_share is True and opts.timeout == 7.0
    assert opts.config == {"max_ctas": 8, "split_share": True, "comm_name": "tp"}
    assert gpucoll.NCCLOptions().config == {}
    with pytest.raises(TypeError):
        gpucoll.NCCLOptions(no_such_field=1)  # type: ignore[call-arg]
    with pytest.raises(AttributeError):
        opts.max_ctas = 4  # type: ignore[misc]  # frozen


def test_every_config_field_is_an_option_and_a_struct_member() -> None:
    names = {f.name for f in nccl_config.FIELDS}
    option_fields = set(gpucoll.NCCLOptions.__dataclass_fields__) - {"is_high_priority_stream", "timeout"}
    assert option_fields == names
    assert [f.c_name for f in nccl_config.FIELDS] == [n for n, _ in nccl_config.NcclConfigStruct._fields_[3:]]


@pytest.mark.parametrize("kwargs, exc, word", [
    ({"transport": "udp"}, ValueError, "transport"), ({"transport": 3}, TypeError, "transport"),
    ({"timeout": 0}, ValueError, "timeout")])
def test_bad_cpu_options_are_refused(kwargs: dict[str, Any], exc: type, word: str) -> None:
    with pytest.raises(exc, match=word):
        gpucoll.CPUOptions(**kwargs)


def test_options_must_match_the_groups_backend() -> None:
    assert coerce_options(None, "nccl") is None
    with pytest.raises(TypeError, match="NCCLOptions but the group's backend is 'cpu'"):
        coerce_options(gpucoll.NCCLOptions(), "cpu")
    with pytest.raises(TypeError, match="CPUOptions but the group's backend is 'nccl'"):
        coerce_options(gpucoll.CPUOptions(), "nccl")
    with pytest.raises(TypeError, match="pg_options must be"):
        coerce_options({"max_ctas": 4}, "nccl")
    fake = coerce_options(gpucoll.CPUOptions(transport="tcp"), "fake")
    assert isinstance(fake, gpucoll.CPUOptions)


def test_torch_shaped_options_are_converted() -> None:
    # torch's ProcessGroupNCCL.Options: .config (NCCLConfig, unset ints are INT_MIN,
    # unset net_name None), .is_high_priority_stream, ._timeout.
    config = SimpleNamespace(blocking=nccl_config.UNDEF_INT, cga_cluster_size=4, min_ctas=nccl_config.UNDEF_INT,
                             max_ctas=16, net_name=None, split_share=1)
    torch_like = SimpleNamespace(config=config, is_high_priority_stream=True, _timeout=timedelta(seconds=9))
    opts = coerce_options(torch_like, "nccl")
    assert opts == gpucoll.NCCLOptions(cga_cluster_size=4, max_ctas=16, split_share=True,
                                       is_high_priority_stream=True, timeout=9.0)
    torch_like.config.max_ctas = -5
    with pytest.raises(ValueError, match="max_ctas"):
        coerce_options(torch_like, "nccl")


# ----- the ctypes mirror against the wheel's nccl.h -----

def _wheel_header() -> tuple[str, list[Path]]:
    spec_root = pytest.importorskip("nvidia.nccl", reason="the nvidia-nccl-cu12 wheel brings nccl.h and libnccl")
    base = Path(list(spec_root.__path__)[0])
    header, libs = base / "include" / "nccl.h", sorted((base / "lib").glob("libnccl.so*"))
    if not header.exists() or not libs:
        pytest.skip("the NCCL wheel has no nccl.h or libnccl here")
    return header.read_text(), libs


def check_struct_against_nccl_h(text: str) -> tuple[int, int, int]:
    """The struct gpucoll passes to the NCCL whose nccl.h is ``text``: that header's
    ``ncclConfig_t`` member for member (names, C types, order), ``size`` its sizeof,
    ``magic`` and ``version`` as its NCCL_CONFIG_INITIALIZER sets them, every other
    member unset. Returns the header's release."""
    body = re.search(r"typedef struct ncclConfig_v\d+ \{(.*?)\} ncclConfig_t;", text, re.S)
    assert body is not None
    c_types = {"size_t": ctypes.c_size_t, "unsigned int": ctypes.c_uint, "int": ctypes.c_int,
               "const char *": ctypes.c_char_p}
    declared = []
    for line in re.sub(r"/\*.*?\*/", "", body.group(1), flags=re.S).splitlines():
        line = line.strip()
        if line:
            m = re.fullmatch(r"(size_t|unsigned int|int|const char \*)\s*(\w+);", line.replace("char*", "char *"))
            assert m is not None, f"an ncclConfig_t member of a type the mirror does not know: {line!r}"
            declared.append((m.group(2), c_types[m.group(1)]))
    code = int(re.search(r"#define NCCL_VERSION_CODE (\d+)", text).group(1))  # type: ignore[union-attr]
    release = (code // 10000, code // 100 % 100, code % 100)
    layout = nccl_config.struct_for(release)
    assert [(n, t) for n, t in layout._fields_] == declared, release  # type: ignore[misc]
    # NCCL_CONFIG_INITIALIZER: size, magic, version, then every member unset, in order.
    init = re.search(r"#define NCCL_CONFIG_INITIALIZER \{(.*?)\n\}", text, re.S)
    assert init is not None
    entries = [(v.strip(), c.strip()) for v, c in re.findall(r"^\s*(.+?),\s*/\* (\w+) \*/", init.group(1), re.M)]
    assert [c for _, c in entries] == [n for n, _ in declared]
    # 2.32's header spells magic NCCL_API_MAGIC and version NCCL_VERSION_CODE; 2.28's
    # the literal and NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH): the same values.
    api_magic = re.search(r"#define NCCL_API_MAGIC (0x[0-9a-fA-F]+)", text)
    magic = int(api_magic.group(1) if entries[1][0] == "NCCL_API_MAGIC" and api_magic else entries[1][0], 16)
    assert entries[0] == ("sizeof(ncclConfig_t)", "size") and entries[1][1] == "magic"
    assert entries[2] in (("NCCL_VERSION_CODE", "version"),
                          ("NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH)", "version"))
    assert {v for v, _ in entries[3:]} <= {"NCCL_CONFIG_UNDEF_INT", "NCCL_CONFIG_UNDEF_PTR"}
    empty = nccl_config.make_struct({}, release)
    assert (empty.size, empty.magic, empty.version) == (ctypes.sizeof(layout), magic, code)
    for (name, kind), (value, _) in zip(declared[3:], entries[3:]):
        expect = None if value == "NCCL_CONFIG_UNDEF_PTR" else nccl_config.UNDEF_INT
        assert getattr(empty, name) == expect, name
    full = nccl_config.make_struct({"max_ctas": 8, "net_name": "IB", "split_share": True}, release)
    assert (full.maxCTAs, full.netName, full.splitShare, full.minCTAs) == (8, b"IB", 1, nccl_config.UNDEF_INT)
    return release


def test_the_config_struct_matches_the_wheels_nccl_h() -> None:
    """Against the installed wheel's nccl.h, whichever release it is (2.32.3 in CI; the
    GPU image's 2.28.9 once failed the old check, which compared 2.32's layout to it).
    A copy of an older nccl.h (GPUCOLL_TEST_NCCL_H=path[:path...]) is checked alike."""
    text, _ = _wheel_header()
    check_struct_against_nccl_h(text)
    for path in filter(None, os.environ.get("GPUCOLL_TEST_NCCL_H", "").split(os.pathsep)):
        check_struct_against_nccl_h(Path(path).read_text())


# ncclConfig_t's members after size, magic and version, as each release's nccl.h
# declares them (NVIDIA/nccl, src/nccl.h.in at the release tags).
_HEADER_FIELDS = {
    (2, 17, 1): "blocking cgaClusterSize minCTAs maxCTAs netName",
    (2, 19, 3): "blocking cgaClusterSize minCTAs maxCTAs netName splitShare",
    (2, 25, 1): "blocking cgaClusterSize minCTAs maxCTAs netName splitShare",
    (2, 26, 2): "blocking cgaClusterSize minCTAs maxCTAs netName splitShare trafficClass",
    (2, 27, 3): "blocking cgaClusterSize minCTAs maxCTAs netName splitShare trafficClass commName collnetEnable "
                "CTAPolicy shrinkShare nvlsCTAs",
    (2, 28, 9): "blocking cgaClusterSize minCTAs maxCTAs netName splitShare trafficClass commName collnetEnable "
                "CTAPolicy shrinkShare nvlsCTAs nChannelsPerNetPeer nvlinkCentricSched",
    (2, 29, 7): "blocking cgaClusterSize minCTAs maxCTAs netName splitShare trafficClass commName collnetEnable "
                "CTAPolicy shrinkShare nvlsCTAs nChannelsPerNetPeer nvlinkCentricSched graphUsageMode numRmaCtx",
    (2, 30, 4): "blocking cgaClusterSize minCTAs maxCTAs netName splitShare trafficClass commName collnetEnable "
                "CTAPolicy shrinkShare nvlsCTAs nChannelsPerNetPeer nvlinkCentricSched graphUsageMode numRmaCtx "
                "maxP2pPeers",
    (2, 30, 7): "blocking cgaClusterSize minCTAs maxCTAs netName splitShare trafficClass commName collnetEnable "
                "CTAPolicy shrinkShare nvlsCTAs nChannelsPerNetPeer nvlinkCentricSched graphUsageMode numRmaCtx "
                "maxP2pPeers graphStreamOrdering",
}


@pytest.mark.parametrize("release", sorted(_HEADER_FIELDS))
def test_an_older_nccl_gets_the_struct_its_nccl_h_declares(release: tuple[int, int, int]) -> None:
    """NCCL reads ``size`` and copies that many bytes (at most its own sizeof), then
    resets the fields newer than ``version`` (parseCommConfig, src/init.cc): the
    struct for an older NCCL is its own nccl.h's, with its size and version code, so
    that what it reads is what its headers promise."""
    names = _HEADER_FIELDS[release].split()
    cfg = nccl_config.make_struct({"max_ctas": 4}, release)
    assert [n for n, _ in cfg._fields_] == ["size", "magic", "version", *names]
    x, y, z = release
    assert (cfg.size, cfg.magic, cfg.version) == (ctypes.sizeof(cfg), nccl_config.NCCL_API_MAGIC, x * 10000 + y * 100 + z)
    # size_t, two unsigned ints, then 4-byte ints and 8-byte pointers, C's alignment
    offset = 16
    for name, kind in cfg._fields_[3:]:
        width = 8 if kind is ctypes.c_char_p else 4
        offset = -(-offset // width) * width + width
    assert cfg.size == -(-offset // 8) * 8
    assert cfg.maxCTAs == 4 and cfg.minCTAs == nccl_config.UNDEF_INT
    # A newer NCCL than the mirror gets the mirror's whole struct, with the mirror's version.
    newest = nccl_config.make_struct({}, (2, 99, 0))
    assert newest.version == nccl_config.CONFIG_LAYOUT_VERSION
    assert newest.size == ctypes.sizeof(nccl_config.NcclConfigStruct)


def test_the_shim_binds_the_config_taking_calls_as_nccl_h_declares_them() -> None:
    text, libs = _wheel_header()
    from gpucoll._backends.nccl.lib import NcclShim, UniqueId, config_pointer

    vp = ctypes.c_void_p
    c_types = {"ncclComm_t": vp, "ncclComm_t*": ctypes.POINTER(vp), "int": ctypes.c_int,
               "ncclUniqueId": UniqueId, "ncclConfig_t*": vp}
    shim = NcclShim(str(libs[0]))
    for name, fn in (("ncclCommInitRankConfig", shim.init_rank_config_fn), ("ncclCommSplit", shim.comm_split_fn)):
        proto = re.search(rf"ncclResult_t\s+{name}\(([^)]*)\)", text)
        assert proto is not None and fn is not None
        params = [re.sub(r"\s*\*\s*", "* ", p.strip()) for p in proto.group(1).split(",")]  # "T *x" -> "T* x"
        declared = [c_types[" ".join(p.split()[:-1])] for p in params]
        assert list(fn.argtypes) == declared and fn.restype is ctypes.c_int
    assert ctypes.sizeof(UniqueId) == int(re.search(r"#define NCCL_UNIQUE_ID_BYTES (\d+)", text).group(1))  # type: ignore[union-attr]
    assert config_pointer(None, (2, 32, 3)) is None and config_pointer({}, (2, 32, 3)) is None
    ref = config_pointer({"min_ctas": 2}, (2, 28, 9))
    struct = ctypes.cast(ref, ctypes.POINTER(nccl_config.struct_for((2, 28, 9)))).contents
    assert struct.minCTAs == 2 and struct.magic == nccl_config.NCCL_API_MAGIC and struct.version == 22809


def test_field_versions_refuse_what_an_older_nccl_lacks() -> None:
    nccl_config.check_config({"max_ctas": 4, "split_share": True}, (2, 18, 0))
    with pytest.raises(BackendUnavailableError) as info:
        nccl_config.check_config({"split_share": True, "comm_name": "x", "max_ctas": 2}, (2, 17, 1))
    assert "split_share (NCCL >= 2.18.0)" in str(info.value) and "comm_name (NCCL >= 2.27.0)" in str(info.value)
    assert "max_ctas" not in str(info.value) and "2.17.1" in str(info.value)


def test_cupy_applies_split_share_and_refuses_the_rest_by_name() -> None:
    cupy = pytest.importorskip("cupy", reason="CuPy carries the NCCL config through its NcclConfig")
    try:
        from cupy.cuda import nccl
    except Exception as exc:
        pytest.skip(f"CuPy's NCCL binding does not import here: {exc}")
    if not hasattr(nccl, "NcclConfig"):
        pytest.skip("this CuPy has no NcclConfig")
    from gpucoll._backends.nccl.runtime import cupy_config

    lib: Any = SimpleNamespace(cupy=cupy, nccl=nccl)
    assert cupy_config(lib, None) is None and cupy_config(lib, {}) is None
    cfg = cupy_config(lib, {"split_share": True})
    assert isinstance(cfg, nccl.NcclConfig) and cfg.split_share == 1
    with pytest.raises(BackendUnavailableError) as info:
        cupy_config(lib, {"split_share": True, "max_ctas": 4, "comm_name": "x"})
    assert "comm_name, max_ctas" in str(info.value) and "split_share" in str(info.value)


# ----- on the fake GPU: the config reaches the communicator -----

def _configs(rt: Any, since: int) -> list[tuple[str, Any]]:
    return list(rt.configs[since:])


def _groups_body(w: Any, rt: Any, rank: int) -> dict[str, Any]:
    size = w._world().default.size()
    out: dict[str, Any] = {}
    opts = gpucoll.NCCLOptions(comm_name="tp", max_ctas=8, is_high_priority_stream=True, timeout=11.0)
    n = len(rt.configs)
    g = gpucoll.new_group(list(range(size)), pg_options=opts)
    out["new_group"] = _configs(rt, n)
    out["timeout"] = g.timeout
    out["pg_options"] = g.pg_options
    out["comm_config"] = g._nccl._comm.config
    out["high_priority"] = g._nccl.comm_stream.stream.high_priority
    x = FakeDeviceArray(rt, np.full(3, rank + 1.0, np.float32))
    gpucoll.all_reduce(x, group=g)
    out["sum"] = x.get().tolist()
    n = len(rt.configs)
    s = gpucoll.split_group(split_ranks=[[0]] + ([list(range(1, size))] if size > 1 else []),
                            pg_options=gpucoll.NCCLOptions(split_share=True, cga_cluster_size=2))
    out["split_group"] = _configs(rt, n)
    out["split_high_priority"] = s._nccl.comm_stream.stream.high_priority
    n = len(rt.configs)
    gpucoll.split_group(g, split_ranks=[list(range(size))])  # None: the parent's options, as torch
    out["split_inherits"] = _configs(rt, n)
    n = len(rt.configs)
    subs = gpucoll.new_subgroups(1, pg_options=gpucoll.NCCLOptions(min_ctas=1))[1]
    out["subgroups"] = (_configs(rt, n), len(subs))
    for grp in w._world().groups:
        grp._destroy()
    return out


@pytest.mark.parametrize("size", [1, 2, 3])
def test_options_reach_ncclCommSplit_through_new_group_split_group_and_subgroups(
        monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    results = run_fake_gpu_worlds(size, _groups_body, monkeypatch, features=NEW)
    want = {"comm_name": "tp", "max_ctas": 8}
    for rank, got in enumerate(results):
        assert got["new_group"] == [("split", want)]
        assert got["comm_config"] == want and got["high_priority"] is True
        assert got["timeout"] == 11.0 and got["pg_options"].comm_name == "tp"
        assert got["sum"] == [size * (size + 1) / 2] * 3
        assert got["split_group"] == [("split", {"split_share": True, "cga_cluster_size": 2})]
        assert got["split_high_priority"] is False
        assert got["split_inherits"] == [("split", want)]
        assert got["subgroups"] == ([("split", {"min_ctas": 1})] * size, size)


def _init_body(w: Any, rt: Any, rank: int) -> dict[str, Any]:
    size = w._world().default.size()
    n = len(rt.configs)
    g = gpucoll.new_group(list(range(size)), pg_options=gpucoll.NCCLOptions(net_name="Socket", blocking=True))
    got = {"configs": _configs(rt, n), "split": b"/split" in g._nccl._comm.world.uid}
    x = FakeDeviceArray(rt, np.arange(4, dtype=np.float32) * (rank + 1))
    gpucoll.all_reduce(x, group=g)
    got["sum"] = x.get().tolist()
    g._destroy()
    return got


@pytest.mark.parametrize("size", [1, 3])
def test_options_reach_ncclCommInitRankConfig_where_no_split_is_possible(monkeypatch: pytest.MonkeyPatch,
                                                                         size: int) -> None:
    results = run_fake_gpu_worlds(size, _init_body, monkeypatch, features=NO_SPLIT)
    total = size * (size + 1) / 2
    for got in results:
        assert got["configs"] == [("init", {"net_name": "Socket", "blocking": True})]
        assert got["split"] is False
        assert got["sum"] == [0.0, total, 2 * total, 3 * total]


def _shrink_body(w: Any, rt: Any, rank: int) -> dict[str, Any]:
    size = w._world().default.size()
    x = FakeDeviceArray(rt, np.ones(2, np.float32))
    gpucoll.all_reduce(x)
    if rank == size - 1:
        return {}  # "dies"
    n = len(rt.configs)
    pg = gpucoll.shrink_group([size - 1], timeout=2.0,
                              pg_options=gpucoll.NCCLOptions(shrink_share=True, comm_name="survivors"))
    y = FakeDeviceArray(rt, np.ones(2, np.float32))
    gpucoll.all_reduce(y)
    out = {"configs": _configs(rt, n), "sum": y.get().tolist(), "size": pg.size(),
           "options": pg.pg_options.comm_name}
    pg._destroy()
    return out


def test_options_reach_ncclCommShrink(monkeypatch: pytest.MonkeyPatch) -> None:
    results = run_fake_gpu_worlds(3, _shrink_body, monkeypatch, features=NEW)
    for got in results[:2]:
        assert got["configs"] == [("shrink", {"shrink_share": True, "comm_name": "survivors"})]
        assert got["sum"] == [2.0, 2.0] and got["size"] == 2 and got["options"] == "survivors"


def _refused_body(opts: Any, exc: type, words: list[str]) -> Any:
    def body(w: Any, rt: Any, rank: int) -> dict[str, Any]:
        size = w._world().default.size()
        n = len(rt.configs)
        with pytest.raises(exc) as info:
            gpucoll.new_group(list(range(size)), pg_options=opts)
        for word in words:
            assert word in str(info.value), str(info.value)
        # Refused before any rank reached NCCL: nothing was made, and the world still works.
        assert rt.configs[n:] == []
        x = FakeDeviceArray(rt, np.ones(2, np.float32))
        gpucoll.all_reduce(x)
        return {"sum": x.get().tolist()}
    return body


@pytest.mark.parametrize("size", [1, 2, 3])
def test_fields_newer_than_the_loaded_nccl_are_refused_by_name(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    opts = gpucoll.NCCLOptions(comm_name="x", max_ctas=4, nvls_ctas=2)
    body = _refused_body(opts, BackendUnavailableError, ["comm_name (NCCL >= 2.27.0)", "nvls_ctas", "2.26.0"])
    results = run_fake_gpu_worlds(size, body, monkeypatch, features=OLD)
    assert all(r["sum"] == [float(size)] * 2 for r in results)


def test_fields_the_runtime_cannot_apply_and_nonblocking_mode_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    body = _refused_body(gpucoll.NCCLOptions(max_ctas=4), BackendUnavailableError, ["max_ctas"])
    run_fake_gpu_worlds(2, body, monkeypatch, features=NEW, refuse_config=frozenset({"max_ctas"}))
    body = _refused_body(gpucoll.NCCLOptions(blocking=False), ValueError, ["blocking=False"])
    run_fake_gpu_worlds(2, body, monkeypatch, features=NEW)
    body = _refused_body(gpucoll.CPUOptions(), TypeError, ["CPUOptions", "nccl"])
    run_fake_gpu_worlds(2, body, monkeypatch, features=NEW)


# ----- CPU options in real multi-process worlds -----

def _cpu_body() -> dict[str, Any]:
    gpucoll.init_process_group("cpu", pg_options=gpucoll.CPUOptions(transport="tcp", timeout=timedelta(seconds=17)))
    try:
        rank, size = gpucoll.get_rank(), gpucoll.get_world_size()
        default = gpucoll.GroupMember.WORLD
        out: dict[str, Any] = {"default": (default._cpu.transport, default.timeout)}
        x = np.arange(5, dtype=np.float64) * (rank + 1)
        gpucoll.all_reduce(x)
        out["sum"] = x.tolist()
        shm = gpucoll.new_group(pg_options=gpucoll.CPUOptions(transport="shm"))
        y = np.full(3, rank + 1, np.int64)
        gpucoll.all_reduce(y, group=shm)
        out["shm"] = (shm._cpu.transport, shm.timeout, y.tolist())
        explicit = gpucoll.new_group(timeout=5, pg_options=gpucoll.CPUOptions(timeout=9))
        out["explicit_timeout_wins"] = explicit.timeout
        split = gpucoll.split_group(split_ranks=[list(range(size))])  # inherits the default group's options
        out["split"] = (split._cpu.transport, split.timeout)
        try:
            gpucoll.new_group(pg_options=gpucoll.NCCLOptions())
        except TypeError as exc:
            out["wrong_kind"] = str(exc)
        return out
    finally:
        gpucoll.destroy_process_group()


@pytest.mark.parametrize("size", [2, 3])
def test_cpu_options_pick_the_transport_and_timeout(size: int) -> None:
    results = run_spmd(_cpu_body, size, init=False, timeout=120)
    from gpucoll._backends.cpu.segments import supported as _shm_supported

    want = np.arange(5, dtype=np.float64) * (size * (size + 1) / 2)
    for got in results:
        assert got["default"] == ("tcp", 17.0)
        assert got["sum"] == want.tolist()
        assert got["shm"] == ("shm" if _shm_supported() else "tcp", 17.0, [size * (size + 1) // 2] * 3)
        assert got["explicit_timeout_wins"] == 5.0
        assert got["split"] == ("tcp", 17.0)
        assert "NCCLOptions but the group's backend is 'cpu'" in got["wrong_kind"]
