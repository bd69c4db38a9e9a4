"""The array layer: every way an array can come in, checked against the memory it names.

Device arrays are faked on host memory (mpi4py's FakeGPUArrayNumPy idea): objects
that publish ``__cuda_array_interface__`` or a CUDA ``__dlpack_device__`` over a
NumPy array, so pointers, shapes and dtypes can be checked without a GPU.
"""

from __future__ import annotations

import array as pyarray
import ctypes
import gc
import sys
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from gpucoll import array as array_mod
from gpucoll._buffer import DTYPES, Buffer, Device
from gpucoll.array import (NotContiguousError, as_buffer, copy_buffer, host_ndarray, is_device_array,
                           new_output, split_buffer, to_caller_type)
from gpucoll.testing import run_spmd

from _fake_arrays import FakeCudaArray, skip_without_jax
from _reference import np_dtype

NUMPY_DTYPES = [n for n in DTYPES]


class FakeDLPackCuda:
    """A CUDA-looking DLPack producer whose capsule is NumPy's (host memory)."""

    def __init__(self, a: np.ndarray, device: int = 1, versioned: bool = True) -> None:
        self.a = a
        self.device = device
        self.versioned = versioned
        self.streams: list[Any] = []

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None) -> Any:
        self.streams.append(stream)
        if self.versioned and max_version is not None:
            return self.a.__dlpack__(max_version=max_version)
        return self.a.__dlpack__()

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self.device)


class FakeDLPackCpu(FakeDLPackCuda):
    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


# ----- NumPy and the buffer protocol -----

@pytest.mark.parametrize("name", NUMPY_DTYPES)
def test_numpy_every_dtype(name: str) -> None:
    a = np.zeros((2, 3), np_dtype(name))
    buf = as_buffer(a, writable=True)
    assert buf.ptr == a.ctypes.data
    assert buf.nbytes == a.nbytes == 6 * DTYPES[name].itemsize
    assert buf.dtype is DTYPES[name]
    assert buf.shape == (2, 3)
    assert buf.device == Device("cpu") and not buf.is_cuda and not buf.readonly
    assert host_ndarray(buf) is a


def test_numpy_zero_copy_writes_through() -> None:
    a = np.arange(6, dtype=np.int32)
    view = host_ndarray(as_buffer(a))
    view[2] = 99
    assert a[2] == 99


def test_numpy_zero_d_and_empty() -> None:
    s = np.array(3.5)
    assert as_buffer(s).shape == () and as_buffer(s).nbytes == 8
    e = np.zeros((0, 4), np.float32)
    assert as_buffer(e).nbytes == 0


def test_non_contiguous_raises_naming_argument() -> None:
    a = np.zeros((4, 4))[:, ::2]
    with pytest.raises(NotContiguousError, match=r"output .*C-contiguous.*functional"):
        as_buffer(a, name="output")
    assert issubclass(NotContiguousError, ValueError)


def test_read_only_rejected_for_in_place() -> None:
    a = np.zeros(4)
    a.flags.writeable = False
    assert as_buffer(a).readonly
    with pytest.raises(ValueError, match=r"tensor is read-only.*gpucoll.functional"):
        as_buffer(a, writable=True)


def test_non_native_byte_order_and_unsupported_dtypes() -> None:
    with pytest.raises(TypeError, match="byte order"):
        as_buffer(np.zeros(2, ">f4"))
    with pytest.raises(TypeError, match="unsupported dtype"):
        as_buffer(np.zeros(2, object))
    with pytest.raises(TypeError, match="must be an array"):
        as_buffer([1, 2, 3], name="tensor")


def test_buffer_protocol_objects() -> None:
    ba = bytearray(b"abcd")
    buf = as_buffer(ba, writable=True)
    assert buf.dtype.name == "uint8" and buf.nbytes == 4
    host_ndarray(buf)[0] = ord("z")
    assert ba[0] == ord("z")
    arr = pyarray.array("d", [1.0, 2.0])
    assert as_buffer(arr).dtype.name == "float64"
    with pytest.raises(ValueError, match="read-only"):
        as_buffer(b"abc", writable=True)
    assert as_buffer(b"abc").readonly
    with pytest.raises(NotContiguousError):
        as_buffer(memoryview(np.zeros(8))[::2])


def test_buffer_passes_through() -> None:
    buf = as_buffer(np.zeros(3))
    assert as_buffer(buf) is buf


# ----- __cuda_array_interface__ -----

def test_cai_v3_with_stream_and_device() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    fake = FakeCudaArray(a, stream=0x1234, device=3)
    buf = as_buffer(fake, writable=True)
    assert buf.is_cuda and buf.device == Device("cuda", 3)
    assert (buf.ptr, buf.nbytes, buf.shape, buf.dtype.name) == (a.ctypes.data, 48, (3, 4), "float32")
    assert buf.stream == 0x1234
    assert buf.owner is fake
    assert is_device_array(fake) and not is_device_array(a)


@pytest.mark.parametrize("stream, expected", [(None, None), (1, None), (2, 2)])
def test_cai_stream_conventions(stream: int | None, expected: int | None) -> None:
    assert as_buffer(FakeCudaArray(np.zeros(2), stream=stream)).stream == expected


def test_cai_v2_has_no_stream() -> None:
    assert as_buffer(FakeCudaArray(np.zeros(2), version=2, stream=77)).stream is None


def test_cai_contiguous_strides_accepted_others_refused() -> None:
    a = np.zeros((3, 4), np.int16)
    assert as_buffer(FakeCudaArray(a, strides=True)).shape == (3, 4)
    with pytest.raises(NotContiguousError, match="C-contiguous"):
        as_buffer(FakeCudaArray(np.zeros((4, 4), np.int16)[:, ::2], strides=True))
    # a dimension of size 1 may carry any stride
    b = np.zeros((3, 1), np.int16)
    assert as_buffer(FakeCudaArray(b, strides=True)).nbytes == 6


def test_cai_readonly() -> None:
    fake = FakeCudaArray(np.zeros(2), readonly=True)
    assert as_buffer(fake).readonly
    with pytest.raises(ValueError, match="read-only device memory"):
        as_buffer(fake, writable=True)


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_cai_opaque_typestr_uses_dtype_attribute(name: str) -> None:
    a = np.zeros(4, np_dtype(name))
    assert a.dtype.str[1:] in ("V2", "V1", "f1")  # no typestr of their own
    buf = as_buffer(FakeCudaArray(a))
    assert buf.dtype.name == name and buf.nbytes == 4 * a.itemsize


def test_cai_opaque_typestr_without_dtype_refused() -> None:
    fake = FakeCudaArray(np.zeros(4, np.uint16), typestr="<V2", dtype="mystery")
    with pytest.raises(TypeError, match="opaque typestr"):
        as_buffer(fake)


def test_cai_masked_refused() -> None:
    class Masked(FakeCudaArray):
        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            d = super().__cuda_array_interface__
            d["mask"] = object()
            return d

    with pytest.raises(ValueError, match="mask"):
        as_buffer(Masked(np.zeros(2)))


def _jax_cai_raising_falls_back_to_dlpack() -> None:
    class RefusesCAI(FakeDLPackCuda):
        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            raise TypeError("dtype bfloat16 is not supported")

    import jax.numpy as jnp

    a = jnp.zeros(3, jnp.bfloat16)  # NumPy cannot export bfloat16 through DLPack; JAX can
    buf = as_buffer(RefusesCAI(a, device=2))
    assert buf.dtype.name == "bfloat16" and buf.device == Device("cuda", 2)


# ----- DLPack -----

@pytest.mark.parametrize("versioned", [True, False])
def test_dlpack_cuda_parsed_with_ctypes(versioned: bool) -> None:
    a = np.arange(10, dtype=np.int64).reshape(2, 5)
    fake = FakeDLPackCuda(a, device=1, versioned=versioned)
    buf = as_buffer(fake, writable=True)
    assert buf.is_cuda and buf.device == Device("cuda", 1)
    assert (buf.ptr, buf.nbytes, buf.shape, buf.dtype.name) == (a.ctypes.data, 80, (2, 5), "int64")
    # The DLPack handshake names the caller's stream: CuPy's current one, 1 (the
    # legacy default stream) without a usable CuPy.
    assert buf.stream is None and fake.streams == [array_mod.consumer_stream()]


def test_dlpack_handshake_passes_the_current_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    class Stream:
        ptr = 0xABC0

    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: Stream()))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    assert array_mod.consumer_stream() == 0xABC0
    fake = FakeDLPackCuda(np.zeros(4, np.float32))
    assert as_buffer(fake).stream is None and fake.streams == [0xABC0]
    Stream.ptr = 0  # the null stream is spelled 1 in DLPack
    assert array_mod.consumer_stream() == 1
    monkeypatch.delitem(sys.modules, "cupy")
    assert array_mod.consumer_stream() == 1
    cpu = FakeDLPackCpu(np.zeros(2))
    as_buffer(cpu)
    assert cpu.streams == [None]  # host memory: no stream


def test_cai_v2_producers_that_speak_dlpack_get_the_handshake() -> None:
    class TorchLike(FakeDLPackCuda):
        """CAI v2 (no stream) plus DLPack, as PyTorch CUDA tensors and JAX GPU arrays."""

        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            return {"shape": self.a.shape, "typestr": self.a.dtype.str, "data": (self.a.ctypes.data, False),
                    "version": 2, "strides": None}

    t = TorchLike(np.arange(6, dtype=np.float32), device=3)
    buf = as_buffer(t, writable=True)
    assert t.streams == [array_mod.consumer_stream()] and buf.device == Device("cuda", 3)
    assert (buf.ptr, buf.nbytes, buf.dtype.name) == (t.a.ctypes.data, 24, "float32")
    # CAI v3 is read as it is (CuPy, Numba): no DLPack export
    class V3(TorchLike):
        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            return {**super().__cuda_array_interface__, "version": 3, "stream": 5}

    v3 = V3(np.zeros(2, np.float32))
    assert as_buffer(v3).stream == 5 and v3.streams == []


def test_dlpack_read_only_flag_of_versioned_capsule() -> None:
    a = np.zeros(3)
    a.flags.writeable = False
    buf = as_buffer(FakeDLPackCuda(a, versioned=True))
    assert buf.readonly
    with pytest.raises(ValueError, match="read-only"):
        as_buffer(FakeDLPackCuda(a, versioned=True), writable=True)


@pytest.mark.parametrize("name", [n for n in NUMPY_DTYPES if n not in ("bfloat16", "float8_e4m3fn", "float8_e5m2")])
def test_dlpack_cpu_every_numpy_dtype(name: str) -> None:
    a = np.ones(5, np_dtype(name))
    buf = as_buffer(FakeDLPackCpu(a), writable=True)
    assert not buf.is_cuda and buf.dtype.name == name and buf.ptr == a.ctypes.data
    view = host_ndarray(buf)
    assert isinstance(view, np.ndarray) and view.dtype == a.dtype
    view[0] = 0
    assert a[0] == 0


def test_dlpack_capsule_kept_alive_by_buffer() -> None:
    a = np.arange(4.0)
    buf = as_buffer(FakeDLPackCpu(a))
    del a
    gc.collect()
    assert host_ndarray(buf).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_dlpack_non_contiguous_refused() -> None:
    a = np.zeros((4, 4))[:, ::2]
    with pytest.raises(NotContiguousError):
        as_buffer(FakeDLPackCpu(a))


def test_dlpack_unsupported_device() -> None:
    class Metal(FakeDLPackCuda):
        def __dlpack_device__(self) -> tuple[int, int]:
            return (8, 0)

    with pytest.raises(TypeError, match="device type 8"):
        as_buffer(Metal(np.zeros(2)))


def _jax_arrays_are_read_only_and_zero_copy() -> None:
    import jax.numpy as jnp

    x = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    buf = as_buffer(x)
    assert buf.readonly and buf.shape == (2, 3) and buf.dtype.name == "float32"
    assert host_ndarray(buf).tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="immutable.*gpucoll.functional"):
        as_buffer(x, writable=True)
    # JAX's CPU arrays have a __cuda_array_interface__ property that raises: still host memory
    assert hasattr(type(x), "__cuda_array_interface__") and not is_device_array(x)


def _jax_low_precision_through_dlpack(name: str) -> None:
    import jax.numpy as jnp

    x = jnp.asarray(np.array([1, 2, -1], np_dtype(name)))
    buf = as_buffer(x)
    assert buf.dtype.name == name
    np.testing.assert_array_equal(host_ndarray(buf).astype(np.float32), [1, 2, -1])


# ----- helpers for the functional API -----

def test_split_buffer_views() -> None:
    a = np.arange(12, dtype=np.int32)
    parts = split_buffer(as_buffer(a), 3)
    assert [p.ptr - a.ctypes.data for p in parts] == [0, 16, 32]
    assert host_ndarray(parts[2]).tolist() == [8, 9, 10, 11]
    dev = split_buffer(as_buffer(FakeCudaArray(a)), 4)
    assert [p.nbytes for p in dev] == [12] * 4 and dev[1].ptr == a.ctypes.data + 12 and dev[1].is_cuda
    with pytest.raises(ValueError, match="equal chunks"):
        split_buffer(as_buffer(a), 5)


def test_copy_buffer_host() -> None:
    src = np.arange(4, dtype=ml_dtypes.bfloat16)
    out, dst = new_output(src, (4,), DTYPES["bfloat16"])
    copy_buffer(dst, as_buffer(src))
    assert isinstance(out, np.ndarray) and out.dtype == src.dtype
    np.testing.assert_array_equal(out, src)
    with pytest.raises(ValueError, match="sizes differ"):
        copy_buffer(dst, as_buffer(np.zeros(3, ml_dtypes.bfloat16)))


def test_to_caller_type_numpy_and_buffer_protocol() -> None:
    result = np.arange(3.0)
    assert to_caller_type(result, np.zeros(1), DTYPES["float64"]) is result
    assert to_caller_type(result, bytearray(8), DTYPES["float64"]) is result


def _to_caller_type_jax(name: str) -> None:
    import jax

    like = jax.numpy.zeros(2, dtype=name)
    result = np.arange(3).astype(np_dtype(name))
    out = to_caller_type(result, like, DTYPES[name])
    assert isinstance(out, jax.Array)
    assert out.dtype == like.dtype
    np.testing.assert_array_equal(np.asarray(out).astype(np.float32), [0, 1, 2])


def test_buffer_owner_is_a_numpy_view_for_host_memory() -> None:
    for obj in (np.zeros(3), bytearray(3), FakeDLPackCpu(np.zeros(3))):
        buf = as_buffer(obj)
        assert isinstance(buf.owner, np.ndarray)
        assert buf.nbytes == 0 or buf.owner.ctypes.data == buf.ptr


def test_ctypes_memory_round_trip() -> None:
    raw = (ctypes.c_int32 * 4)(1, 2, 3, 4)
    buf = as_buffer(raw, writable=True)
    assert buf.dtype.name == "int32" and host_ndarray(buf).tolist() == [1, 2, 3, 4]
    assert isinstance(buf, Buffer)


# ----- real device arrays (GPU machines only) -----

def cupy_array_body() -> str:
    import cupy

    from gpucoll.array import xp_view

    a = cupy.arange(6, dtype=cupy.float32).reshape(2, 3)
    buf = as_buffer(a, writable=True)
    assert buf.ptr == a.data.ptr and buf.nbytes == 24 and buf.shape == (2, 3)
    assert buf.device == Device("cuda", a.device.id) and is_device_array(a)
    out, dst = new_output(a, (2, 3), buf.dtype)
    copy_buffer(dst, buf)
    cupy.cuda.get_current_stream().synchronize()
    assert isinstance(out, cupy.ndarray) and cupy.asnumpy(out).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert isinstance(xp_view(buf), cupy.ndarray) and int(xp_view(buf).sum()) == 15
    s = cupy.cuda.Stream()
    with s:
        b = cupy.zeros(4, cupy.int8)
        assert as_buffer(b).stream in (None, s.ptr)
    with pytest.raises(NotContiguousError):
        as_buffer(cupy.zeros((4, 4))[:, ::2])
    return "ok"


@pytest.mark.gpu
def test_cupy_arrays_on_a_gpu() -> None:
    from gpucoll.testing import run_spmd

    assert run_spmd(cupy_array_body, 1, init=False, timeout=180) == ["ok"]


# ----- JAX arrays, in a process of their own -----
# JAX starts threads once it has a backend; a test process that used JAX then warns at every
# os.fork() the later tests make (and risks their children). So the JAX checks run in one
# spawned process, and the test process never initialises JAX.

def _jax_checks() -> list[str]:
    done = []
    for check, args in [(_jax_cai_raising_falls_back_to_dlpack, ()), (_jax_arrays_are_read_only_and_zero_copy, ())]:
        check(*args)
        done.append(check.__name__)
    for name in ["bfloat16", "float8_e4m3fn", "float8_e5m2"]:
        _jax_low_precision_through_dlpack(name)
        done.append(f"low_precision[{name}]")
    for name in ["float32", "int32", "bfloat16"]:
        _to_caller_type_jax(name)
        done.append(f"to_caller_type[{name}]")
    return done


def test_jax_arrays() -> None:
    skip_without_jax()
    (done,) = run_spmd(_jax_checks, 1, init=False, start_method="spawn", timeout=120,
                       env={"JAX_PLATFORMS": "cpu"})
    assert len(done) == 8, done


def test_the_test_process_never_initialises_jax() -> None:
    """The JAX tests above leave this process without a JAX backend (no threads to fork)."""
    xla_bridge = sys.modules.get("jax._src.xla_bridge")
    assert xla_bridge is None or not getattr(xla_bridge, "_backends", None), "JAX was initialised here"


def test_host_address_is_numpys_data_pointer() -> None:
    """as_buffer reads a host array's address from the array object itself: for every kind
    of view it must be what NumPy's own ``ctypes.data`` says."""
    from gpucoll._buffer import host_address

    base = np.arange(64, dtype=np.float64)
    ro = np.arange(6, dtype=np.int32)
    ro.flags.writeable = False
    arrays = [base, base[7:], base[::-1], base.reshape(8, 8)[3], base.reshape(8, 8)[:, 2],
              base.view(np.uint8)[5:], np.zeros(0, np.float32), np.zeros((0, 3)), ro,
              np.frombuffer(bytearray(40), np.uint16)[1:], np.asarray(memoryview(bytearray(9))),
              np.zeros(3, ml_dtypes.bfloat16), np.ma.masked_array(np.ones(4)), np.full((), 2.5)]
    for a in arrays:
        assert host_address(a) == a.ctypes.data, a
    for a in arrays:
        if a.flags.c_contiguous:
            assert as_buffer(a).ptr == a.ctypes.data
