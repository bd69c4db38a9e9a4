"""RPC backend options: torch's ``RpcBackendOptions`` and ``TensorPipeRpcBackendOptions``.

Options are mutable records, as torch's (``opts.rpc_timeout = 5`` is common in tests).
Devices are kept as ``"cuda:N"`` strings; an int, ``"cuda:N"``, or any object with
``type == "cuda"`` and an ``index`` (a ``torch.device``) or an ``id`` (a CuPy
``Device``) is accepted.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from . import constants

__all__ = ["RpcBackendOptions", "TensorPipeRpcBackendOptions"]

DeviceType = Any
"""An int, ``"cuda:N"``, a ``torch.device`` or a CuPy ``Device``."""


def _to_device(device: DeviceType) -> str:
    if isinstance(device, bool):
        raise ValueError(f"a device must be an int, 'cuda:N' or a device object; got {device!r}")
    if isinstance(device, int):
        index = device
    elif isinstance(device, str):
        kind, _, rest = device.partition(":")
        if kind != "cuda" or not rest.isdigit():
            raise ValueError(f"`set_devices` and `device_maps` only support CUDA devices ('cuda:N' or an int); "
                             f"got {device!r}")
        index = int(rest)
    elif getattr(device, "type", None) == "cuda" and isinstance(getattr(device, "index", None), int):
        index = device.index
    elif isinstance(getattr(device, "id", None), int):
        index = device.id
    else:
        raise ValueError(f"`set_devices` and `device_maps` only support CUDA devices; got {device!r}")
    if index < 0:
        raise ValueError(f"a device index must be >= 0; got {device!r}")
    return f"cuda:{index}"


def _to_device_map(device_map: Mapping[DeviceType, DeviceType]) -> dict[str, str]:
    out: dict[str, str] = {}
    reverse: dict[str, str] = {}
    for k, v in device_map.items():
        src, dst = _to_device(k), _to_device(v)
        if dst in reverse and reverse[dst] != src:
            raise ValueError(f"`device_map` only supports 1-to-1 mapping, trying to map {reverse[dst]} and {src} "
                             f"to {dst}")
        out[src], reverse[dst] = dst, src
    return out


class RpcBackendOptions:
    """What every RPC backend takes: the default call timeout and the rendezvous URL.

    Args:
        rpc_timeout: default timeout of a call in seconds (0: none).
        init_method: ``env://`` (default), ``tcp://host:port`` or ``file:///path``.
    """

    def __init__(self, rpc_timeout: float = constants.DEFAULT_RPC_TIMEOUT_SEC,
                 init_method: str = constants.DEFAULT_INIT_METHOD) -> None:
        if isinstance(rpc_timeout, bool) or not isinstance(rpc_timeout, (int, float)):
            raise TypeError(f"incompatible constructor arguments: rpc_timeout must be a number of seconds; got "
                            f"{type(rpc_timeout).__name__}: {rpc_timeout!r}")
        self.rpc_timeout = float(rpc_timeout)
        self.init_method = init_method

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rpc_timeout={self.rpc_timeout}, init_method={self.init_method!r})"


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """The options of gpucoll's RPC transport, under torch's name.

    Args:
        num_worker_threads: threads that run incoming calls (default 16).
        rpc_timeout: default timeout of a call in seconds (default 60; 0: none).
        init_method: rendezvous URL (default ``env://``).
        device_maps: ``{callee name: {my device: callee's device}}``: device arrays sent
            to that callee arrive on the mapped device; replies follow the inverse map.
        devices: the local devices RPC uses (default: those named by the maps).
        _transports, _channels: accepted for torch's signature; ignored.

    Raises:
        ValueError: a device that is not a CUDA device, or a map that is not 1-to-1.
    """

    def __init__(self, *, num_worker_threads: int = constants.DEFAULT_NUM_WORKER_THREADS,
                 rpc_timeout: float = constants.DEFAULT_RPC_TIMEOUT_SEC,
                 init_method: str = constants.DEFAULT_INIT_METHOD,
                 device_maps: Mapping[str, Mapping[DeviceType, DeviceType]] | None = None,
                 devices: Sequence[DeviceType] | None = None,
                 _transports: list[Any] | None = None, _channels: list[Any] | None = None) -> None:
        super().__init__(rpc_timeout, init_method)
        if not isinstance(num_worker_threads, int) or num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be an int >= 1; got {num_worker_threads!r}")
        self.num_worker_threads = num_worker_threads
        self.device_maps: dict[str, dict[str, str]] = (
            {} if device_maps is None else {k: _to_device_map(v) for k, v in device_maps.items()})
        self.devices: list[str] = [] if devices is None else [_to_device(d) for d in devices]

    def set_device_map(self, to: str, device_map: Mapping[DeviceType, DeviceType]) -> None:
        """Map this worker's devices to ``to``'s: device arrays sent there land on the mapped device.

        Calling it again for the same ``to`` adds to that map (torch's behaviour).

        Raises:
            ValueError: a device is not a CUDA device, or two devices map to one.
        """
        full = _to_device_map(device_map)
        current = dict(self.device_maps.get(to, {}))
        for k, v in full.items():
            if k in current and current[k] != v:
                raise ValueError(f"A different device map ({k} -> {current[k]}) already exists for {to}; "
                                 f"cannot map {k} -> {v}")
            current[k] = v
        _to_device_map(current)  # still 1-to-1
        self.device_maps[to] = current

    def set_devices(self, devices: Sequence[DeviceType]) -> None:
        """Set the local devices this worker's RPC agent uses."""
        self.devices = [_to_device(d) for d in devices]

    def __repr__(self) -> str:
        return (f"TensorPipeRpcBackendOptions(num_worker_threads={self.num_worker_threads}, "
                f"rpc_timeout={self.rpc_timeout}, init_method={self.init_method!r}, "
                f"device_maps={self.device_maps}, devices={self.devices})")
