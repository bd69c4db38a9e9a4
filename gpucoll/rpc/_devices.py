"""Device arrays in RPC: refused without a device map; with one, staged through host memory.

As in torch, an array in device memory (CuPy, JAX on GPU, PyTorch CUDA, Numba, anything
with ``__cuda_array_interface__``) may travel only to a worker this one has a device
map for (``TensorPipeRpcBackendOptions.set_device_map``); replies follow the inverse of
the caller's map. It is copied to host memory, sent out of band like a NumPy array, and
rebuilt on the mapped device as the sender's array type.
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
    if framework == "cupy":
        host = obj.get()
    elif framework == "torch":
        host = obj.detach().cpu().numpy()
    elif framework == "jax":
        host = np.asarray(obj)
    else:
        import cupy

        host = cupy.asarray(obj).get()
        framework = "cupy"
    return (_rebuild, (framework, host, int(target[5:])))


def _rebuild(framework: str, host: np.ndarray, index: int) -> Any:
    """On the receiver: the staged array back on device ``index``, as the sender's type."""
    if framework == "torch":
        return sys.modules["torch"].from_numpy(host).to(f"cuda:{index}") if "torch" in sys.modules else \
            __import__("torch").from_numpy(host).to(f"cuda:{index}")
    if framework == "jax":
        import jax

        return jax.device_put(host, jax.devices("gpu")[index])
    import cupy

    with cupy.cuda.Device(index):
        return cupy.asarray(host)
