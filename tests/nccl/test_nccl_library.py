"""The NCCL backend's library layer without a GPU: import hygiene, the reasons it gives
when it cannot run, the loaded libnccl and the ctypes shim, unique ids and their
rendezvous through a real TCPStore across processes, the CuPy adapter's bindings.

Tests that need CuPy's libnccl skip with a reason when CuPy is not installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpucoll._buffer import DTYPES
from gpucoll._backends.nccl import lib as _nccl_lib
from gpucoll._backends.nccl import values as _nccl_values
from gpucoll._backends.nccl.lib import features_of, version_tuple
from gpucoll._backends.nccl.backend import NCCLBackend, nccl_unavailable_reason, rendezvous
from gpucoll.errors import BackendUnavailableError, DistBackendError
from gpucoll.store import HashStore, PrefixStore

from _fake_gpu_world import has_gpu

needs_cupy = pytest.mark.skipif(importlib.util.find_spec("cupy") is None,
                                reason='needs CuPy and its libnccl (pip install "gpucoll[cuda12]")')

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ============================================================ import hygiene and availability

def test_import_gpucoll_and_the_nccl_module_import_no_cupy() -> None:
    code = ("import sys, gpucoll, gpucoll._backends.nccl.backend, gpucoll._backends.nccl.kernel_loader\n"
            "print('cupy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@needs_cupy
@pytest.mark.skipif(has_gpu(), reason="a usable GPU is present")
def test_without_a_gpu_the_backend_is_unavailable_and_says_why() -> None:
    reason = nccl_unavailable_reason()
    assert reason is not None and "CUDA device" in reason
    with pytest.raises(BackendUnavailableError, match="CUDA device") as info:
        NCCLBackend(HashStore(), 0, 1, timeout=5.0, group_name="g", device_id=None)
    assert "NCCL backend cannot run here" in str(info.value)


def _run_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_without_cupy_the_reason_names_cupy_and_the_install_command() -> None:
    out = _run_python(
        "import sys\nsys.modules['cupy'] = None\n"
        "from gpucoll._backends.nccl.backend import nccl_unavailable_reason\n"
        "print(nccl_unavailable_reason())\n")
    assert "needs CuPy, which is not installed" in out
    assert 'pip install "gpucoll[cuda12]"' in out and "gpucoll[cuda13]" in out


@needs_cupy
def test_without_nccl_the_reason_names_the_nccl_library() -> None:
    out = _run_python(
        "import sys, types, cupy\n"
        "sys.modules['cupy.cuda.nccl'] = types.SimpleNamespace(available=False)\n"
        "from gpucoll._backends.nccl.backend import nccl_unavailable_reason\n"
        "print(nccl_unavailable_reason())\n")
    assert "found no NCCL library (libnccl.so.2)" in out and "nvidia-nccl-cu12" in out


# ============================================================ the loaded library

@needs_cupy
def test_version_and_shim_are_those_of_the_library_cupy_loaded() -> None:
    from cupy.cuda import nccl

    lib = _nccl_lib.load()
    assert lib.version == version_tuple(nccl.get_version())
    assert lib.version >= (2, 18, 0)
    assert lib.shim is not None, lib.shim_error
    assert lib.library_path == _nccl_lib.loaded_library_path()
    assert os.path.basename(lib.library_path or "").startswith("libnccl.so")
    assert lib.shim.version() == nccl.get_version()
    assert lib.shim.error_string(6) and lib.shim.async_error(0) == 0
    f = lib.features
    assert f.avg and f.premul_sum and f.comm_split and f.async_error
    assert f.fp8 == (lib.version >= (2, 24, 0))
    assert f.all_to_all == f.gather == f.scatter == (lib.version >= (2, 28, 0))


@needs_cupy
def test_version_codes_and_features_by_version() -> None:
    assert version_tuple(2708) == (2, 7, 8)
    assert version_tuple(21805) == (2, 18, 5)
    assert version_tuple(23203) == (2, 32, 3)
    lib = _nccl_lib.load()
    old = features_of(20905, lib.shim, lib.nccl)
    assert not old.avg and not old.premul_sum and not old.comm_split and not old.all_to_all
    mid = features_of(21805, lib.shim, lib.nccl)
    assert mid.avg and mid.premul_sum and mid.comm_split and not mid.fp8 and not mid.gather
    assert not features_of(23203, None, lib.nccl).premul_sum  # no shim, no PreMulSum


@needs_cupy
def test_unique_ids_from_the_real_library() -> None:
    from cupy.cuda import nccl

    a = _nccl_values.normalise_unique_id(nccl.get_unique_id())
    b = _nccl_values.normalise_unique_id(nccl.get_unique_id())
    assert len(a) == 128 and a != b
    signed = tuple(x - 256 if x > 127 else x for x in a)  # CuPy < 14's form
    assert _nccl_values.normalise_unique_id(signed) == a
    assert _nccl_values.comm_id_arg(a, "14.2.0") == a
    assert _nccl_values.comm_id_arg(a, "13.6.0") == signed
    assert all(-128 <= c <= 127 for c in signed)
    with pytest.raises(ValueError, match="128 bytes"):
        _nccl_values.normalise_unique_id(b"x" * 12)


def test_premul_factors_encode_like_numpy() -> None:
    import ml_dtypes

    for value in (0.5, -3.25, 1 / 3, 1e-3, 250.0):
        for name, np_type in (("float64", np.float64), ("float32", np.float32), ("float16", np.float16),
                              ("bfloat16", ml_dtypes.bfloat16), ("float8_e4m3fn", ml_dtypes.float8_e4m3fn)):
            got = _nccl_values.encode_scalar(value, DTYPES[name])
            assert got == np.asarray(value, np.float64).astype(np_type).tobytes(), (name, value)
    with pytest.raises(ValueError, match="out of range for float16"):
        _nccl_values.encode_scalar(1e6, DTYPES["float16"])


# ============================================================ unique-id rendezvous through a real store

def _rendezvous_body() -> list[int]:
    from gpucoll.clusters.base import STORE_TOKEN_ENV
    from gpucoll.store import TCPStore
    from cupy.cuda import nccl

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=20.0, token=os.environ[STORE_TOKEN_ENV])
    uid = rendezvous(PrefixStore("pg/g", store), rank, size, timeout=20.0, group_name="g",
                     make_uid=nccl.get_unique_id)
    return list(uid)


@needs_cupy
def test_unique_id_rendezvous_through_a_tcp_store_across_processes() -> None:
    from gpucoll.testing import run_spmd

    results = run_spmd(_rendezvous_body, world_size=3, init=False, timeout=90.0)
    assert len(results[0]) == 128
    assert results[0] == results[1] == results[2]


def test_rendezvous_times_out_naming_the_group_and_the_arrivals() -> None:
    store = HashStore()
    with pytest.raises(DistBackendError, match=r"group 'g': rank 1 did not get the NCCL unique id"):
        rendezvous(store, 1, 2, timeout=0.2, group_name="g", make_uid=lambda: b"\0" * 128)
    with pytest.raises(DistBackendError, match=r"group 'g': only 1 of 3 ranks reached"):
        rendezvous(store, 0, 3, timeout=0.2, group_name="g", make_uid=lambda: b"\1" * 128)


# ============================================================ the CuPy adapter, as far as it runs without a GPU

@needs_cupy
def test_cupy_adapter_binds_only_names_that_exist() -> None:
    from cupy.cuda import nccl

    from gpucoll._backends.nccl.runtime import CudaRuntime, CupyComm

    lib = _nccl_lib.load()
    rt = CudaRuntime(lib)  # binds every CuPy function it will call
    assert rt.features == lib.features
    assert rt.group_start.__self__ is lib.shim  # type: ignore[attr-defined]  # GIL-free ctypes calls
    placeholder = nccl.NcclCommunicator.__new__(nccl.NcclCommunicator)  # as initAll makes them
    comm = CupyComm(lib, placeholder, 0, 1)
    assert comm.handle == 0 and comm.async_error() == 0
    for name in ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "send", "recv"):
        assert callable(getattr(comm, name))


@needs_cupy
def test_the_shim_is_refused_on_another_copy_of_the_same_nccl(tmp_path: Path) -> None:
    """Two copies of one NCCL release can be mapped at once (a wheel's, one on
    LD_LIBRARY_PATH): ncclGroupStart through one and ncclSend through the other leave the
    send ungrouped, which for a send/receive pair NCCL leaves undefined. A group opened
    through CuPy must be open in the shim's library (same_library); a copy of the file,
    loaded as a second library, is told apart, and CuPy's group is closed again."""
    import shutil

    from cupy.cuda import nccl

    lib = _nccl_lib.load()
    assert lib.shim is not None and lib.library_path is not None, lib.shim_error
    assert _nccl_lib.same_library(nccl, lib.shim)
    copy = tmp_path / os.path.basename(lib.library_path)
    shutil.copy(lib.library_path, copy)
    other = _nccl_lib.NcclShim(str(copy))
    assert other.version() == lib.shim.version()  # the same release: the version check cannot tell
    assert not _nccl_lib.same_library(nccl, other)
    assert _nccl_lib.same_library(nccl, lib.shim)  # CuPy's group was closed: no group is left open
