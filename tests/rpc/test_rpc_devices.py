"""Device arrays over RPC with a device map, on a fake CuPy (no GPU needed): the
stream-ordered staging path of gpucoll.rpc._devices, checked operation by operation.

worker0 maps its device 0 to worker1's device 1; worker1 sets no map, so its replies
follow the inverse of worker0's (torch's rule). The fake logs every operation in order
(tests/rpc/_fake_cupy_rpc.py). Checked: the sender copies device to host on its current
stream into pinned memory, records an event after the copy on that stream and waits for
it before the frame goes; the receiver copies host to device on a staging stream of the
mapped device, records an event there, and its current stream on that device waits on
the event before the function runs (the function's first operation is logged after the
wait, on the same stream); values and type are the sender's; a reply comes back to the
caller's device. tests/rpc/test_rpc_gpu.py is the same on a real GPU.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import gpucoll.rpc as rpc
from gpucoll.testing import run_spmd


def where(x: Any) -> tuple[str, int, list[float], list[tuple[Any, ...]]]:
    cupy = __import__("cupy")
    with cupy.cuda.Device(x.device.id):
        cupy.LOG.append(("run", cupy.cuda.get_current_stream().id))
    return type(x).__module__, int(x.device.id), x.tolist(), list(cupy.LOG)


def double(x: Any) -> Any:
    cupy = __import__("cupy")
    with cupy.cuda.Device(x.device.id):
        return x * 2


def _index(log: list[tuple[Any, ...]], kind: str, start: int = 0) -> int:
    return next(i for i, e in enumerate(log) if e[0] == kind and i >= start)


def device_checks() -> dict[str, Any]:
    import _fake_cupy_rpc as fake

    cupy = fake.install()
    rank = int(os.environ["RANK"])
    opts = rpc.TensorPipeRpcBackendOptions()
    if rank == 0:
        opts.set_device_map("worker1", {0: 1})
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    out: dict[str, Any] = {}
    if rank == 0:
        with cupy.cuda.Device(0):
            x = cupy.asarray(np.arange(4, dtype=np.float32))
            mine = cupy.cuda.get_current_stream().id
            fake.LOG.clear()
            out["there"] = rpc.rpc_sync("worker1", where, args=(x,))
            out["sent"] = list(fake.LOG)
            out["stream"] = mine
            fake.LOG.clear()
            back = rpc.rpc_sync("worker1", double, args=(x,))
            out["back"] = (type(back).__module__, int(back.device.id), back.tolist(), list(fake.LOG))
    rpc.shutdown()
    return out


def test_device_arrays_staged_through_pinned_memory_and_ordered_by_events() -> None:
    out = run_spmd(device_checks, 2, init=False, timeout=120)[0]
    module, device, values, callee = out["there"]
    assert (module, device, values) == ("cupy", 1, [0.0, 1.0, 2.0, 3.0])

    # sender: pinned allocation, D2H on its current stream into it, event after, waited on
    sent, mine = out["sent"], out["stream"]
    assert [e[0] for e in sent[:4]] == ["alloc_pinned", "d2h", "record", "synchronize"], sent
    assert sent[0][1] == 16
    assert sent[1] == ("d2h", mine, 0, True)
    assert sent[2][1] == mine and sent[3][1] == sent[2][2]

    # receiver: H2D on a staging stream of device 1, event after it, current stream waits, then the function
    h2d, rec, wait, run = (_index(callee, k) for k in ("h2d", "record", "wait_event", "run"))
    assert h2d < rec < wait < run, callee
    staging = callee[h2d][1]
    assert ("new_stream", staging, 1) in callee and callee[h2d][2] == 1
    assert callee[rec] == ("record", staging, callee[rec][2])
    assert callee[wait][2] == callee[rec][2]  # the event recorded after the copy
    assert callee[wait][1] == callee[run][1] != staging  # the function's stream waited

    # the reply follows the inverse map: back on worker0's device 0, as a CuPy array
    module, device, values, log = out["back"]
    assert (module, device, values) == ("cupy", 0, [0.0, 2.0, 4.0, 6.0])
    h2d = _index(log, "h2d")  # after the argument's own staging out (alloc_pinned, d2h, record, synchronize)
    rec, wait = _index(log, "record", h2d), _index(log, "wait_event", h2d)
    assert log[h2d][2] == 0 and h2d < rec < wait and log[wait][2] == log[rec][2], log
