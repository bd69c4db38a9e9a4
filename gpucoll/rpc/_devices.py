"""Device arrays in RPC: refused without a device map; with one, staged through host memory.

As in torch, an array in device memory (CuPy, JAX on GPU, PyTorch CUDA, Numba, anything
with ``__cuda_array_interface__``) may travel only to a worker this one has a device
map for (``TensorPipeRpcBackendOptions.set_device_map``); replies follow the inverse of
the caller's map. It is copied to host memory, sent out of band like a NumPy array, and
rebuilt on the mapped device as the sender's array type.

CuPy arrays (and arrays CuPy can wrap: Numba, anything with ``__cuda_array_interface__``)
take the stream-ordered path:

* sender: the device-to-host copy is enqueued on the sender's current stream into pinned
  host memory (``cupy.cuda.alloc_pinned_memory``), an event is recorded after it on that
  stream, and the frame is written once that event has completed (the pinned buffer goes
  out of band, not copied again);
* receiver (while unpickling, on the thread that then runs the function or reads the
  reply): the host-to-device copy is enqueued on a staging stream of the mapped device,
  an event is recorded after it, and the receiving thread's current stream waits on that
  event, so whatever the function enqueues on its stream runs after the data has
  arrived; the host does not block.

PyTorch and JAX arrays go through their own host copies (``.cpu()``, ``np.asarray``).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..array import is_device_array

__all__ = ["reduce", "inverse"]


def inverse(device_map: dict[str, str]) -> dict[str, str]:
    return {v: k for k, v in device_map.items()}


def _framework(obj: Any) -> str:
    module = type(obj).__module__.split(".", 1)[0]
    return "jax" if module == "jaxlib" else module


def _device_index(obj: Any) -> int:
    try:
        return int(obj.__dlpack_device__()[1])
    except Exception:  # noqa: BLE001
        device = getattr(obj, "device", None)
        return int(getattr(device, "id", getattr(device, "index", 0)) or 0)


def reduce(obj: Any, device_map: dict[str, str], dst: Any) -> Any:
    """The pickling hook's answer for ``obj``: NotImplemented unless it is a device array."""
    if type(obj) is np.ndarray or not is_device_array(obj):
        return NotImplemented
    src = f"cuda:{_device_index(obj)}"
    name = getattr(dst, "name", "this worker")
    if not device_map:
        raise ValueError(
            f"a {type(obj).__name__} on {src} cannot be sent to {name}: RPC with device arrays needs a device map. "
            f"Before init_rpc, call options.set_device_map({name!r}, {{{src[5:]}: <{name}'s device index>}}) on "
            f"the gpucoll.rpc.TensorPipeRpcBackendOptions you pass as rpc_backend_options (torch's rule), or send "
            f"a host copy (NumPy)")
    target = device_map.get(src)
    if target is None:
        raise ValueError(f"a {type(obj).__name__} on {src} cannot be sent to {name}: the device map for it "
                         f"({device_map}) has no entry for {src}; add one with set_device_map")
    framework = _framework(obj)
    if framework == "torch":
        host = obj.detach().cpu().numpy()
    elif framework == "jax":
        host = np.asarray(obj)
    else:
        return (_rebuild_cupy, (_stage_out(obj), int(target[5:])))
    return (_rebuild, (framework, host, int(target[5:])))


def _stage_out(obj: Any) -> np.ndarray:
    """The sender's half: ``obj`` copied into pinned host memory on its current stream.

    Returns once the copy is complete (an event recorded after it on that stream)."""
    import cupy

    arr = obj if type(obj).__module__.split(".", 1)[0] == "cupy" else cupy.asarray(obj)
    with cupy.cuda.Device(arr.device.id):
        stream = cupy.cuda.get_current_stream()
        pinned = cupy.cuda.alloc_pinned_memory(max(arr.nbytes, 1))
        host = np.frombuffer(pinned, arr.dtype, arr.size).reshape(arr.shape)
        arr.get(stream=stream, out=host)
        done = cupy.cuda.Event()
        done.record(stream)
        done.synchronize()
    return host  # type: ignore[no-any-return]


def _rebuild_cupy(host: np.ndarray, index: int) -> Any:
    """The receiver's half: a CuPy array on device ``index``, copied on a staging stream;
    this thread's current stream waits on the copy's event (the host does not)."""
    import cupy

    with cupy.cuda.Device(index):
        staging = cupy.cuda.Stream(non_blocking=True)
        out = cupy.empty(host.shape, host.dtype)
        out.set(host, stream=staging)
        arrived = cupy.cuda.Event()
        arrived.record(staging)
        cupy.cuda.get_current_stream().wait_event(arrived)
    return out


def _rebuild(framework: str, host: np.ndarray, index: int) -> Any:
    """On the receiver: the staged array back on device ``index``, as the sender's type."""
    if framework == "torch":
        return sys.modules["torch"].from_numpy(host).to(f"cuda:{index}") if "torch" in sys.modules else \
            __import__("torch").from_numpy(host).to(f"cuda:{index}")
    import jax

    return jax.device_put(host, jax.devices("gpu")[index])
