"""Object and bytes collectives (CPU backend), world sizes 1 and 3."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from gpucoll.testing import run_spmd


def payload(rank: int) -> dict[str, Any]:
    """Objects of different sizes per rank (rank 1's is empty-ish, so padding is exercised)."""
    return {"rank": rank, "blob": "x" * (rank * 1000 if rank != 1 else 0), "arr": np.arange(rank + 1)}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["rank"] == b["rank"] and a["blob"] == b["blob"] and np.array_equal(a["arr"], b["arr"])


def objects_body() -> str:
    import gpucoll

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    everyone = [payload(q) for q in range(n)]
    root = n - 1

    out: list[Any] = [None] * n
    gpucoll.all_gather_object(out, payload(r))
    assert all(same(o, e) for o, e in zip(out, everyone))

    gl: list[Any] | None = [None] * n if r == root else None
    gpucoll.gather_object(payload(r), gl, dst=root)
    if r == root:
        assert gl is not None and all(same(o, e) for o, e in zip(gl, everyone))

    objs: list[Any] = [payload(root), "two", 3] if r == root else [None, None, None]
    gpucoll.broadcast_object_list(objs, src=root)
    assert same(objs[0], payload(root)) and objs[1:] == ["two", 3]

    got: list[Any] = [None]
    gpucoll.scatter_object_list(got, [payload(q) for q in range(n)] if r == 0 else None, src=0)
    assert same(got[0], payload(r))

    # bytes variants: nothing is unpickled
    assert gpucoll.all_gather_bytes(bytes([r]) * r) == [bytes([q]) * q for q in range(n)]
    assert gpucoll.all_gather_bytes(b"") == [b""] * n
    gathered = gpucoll.gather_bytes(b"r%d" % r, dst=0)
    assert gathered == ([b"r%d" % q for q in range(n)] if r == 0 else None)
    assert gpucoll.broadcast_bytes(b"hello" if r == root else None, src=root) == b"hello"
    assert gpucoll.broadcast_bytes(b"" if r == 0 else None, src=0) == b""
    assert gpucoll.scatter_bytes([b"%d" % q * 3 for q in range(n)] if r == 0 else None, src=0) == b"%d" % r * 3

    if n > 1:
        # point to point: everybody sends to rank 0, which receives from any source
        if r == 0:
            senders = set()
            for _ in range(n - 1):
                box: list[Any] = [None, None]
                src = gpucoll.recv_object_list(box)
                assert box == [src, "from %d" % src]
                senders.add(src)
            assert senders == set(range(1, n))
        else:
            gpucoll.send_object_list([r, "from %d" % r], dst=0)
        # nothing else may be in flight to rank 0 while it receives from any source
        gpucoll.barrier()
        if r == 0:
            data, src = gpucoll.recv_bytes(src=1, tag=5)
            assert (data, src) == (b"\x00" * 70000, 1)
            box = [None]
            with pytest.raises(ValueError, match="sent 2"):
                gpucoll.recv_object_list(box, src=1)
        elif r == 1:
            gpucoll.send_bytes(b"\x00" * 70000, dst=0, tag=5)
            gpucoll.send_object_list([1, 2], dst=0)
    with pytest.raises(ValueError, match="object_list must have %d entries" % n):
        gpucoll.all_gather_object([None] * (n + 1), 1)
    with pytest.raises(TypeError, match="data must be bytes"):
        gpucoll.all_gather_bytes("text")  # type: ignore[arg-type]
    return "ok"


@pytest.mark.parametrize("world_size", [1, 3])
def test_object_collectives(world_size: int) -> None:
    assert run_spmd(objects_body, world_size, timeout=90) == ["ok"] * world_size


def nccl_like_group_body() -> str:
    """Objects in a group created for NCCL go through its CPU backend, never a GPU."""
    import gpucoll
    from gpucoll._group import registry as group_module

    calls: list[str] = []

    def fake_nccl(*args: Any, **kwargs: Any) -> Any:
        calls.append("nccl")
        raise AssertionError("object collectives must not create the NCCL backend")

    group_module.BACKENDS["nccl"] = fake_nccl
    from gpucoll.store import PrefixStore

    store = PrefixStore("nccl-objects", gpucoll._world.default_group().store)
    g = gpucoll.ProcessGroup(store, gpucoll.get_rank(),
                                  gpucoll.get_world_size(), group_name="nccl-objects",
                                  global_ranks=range(gpucoll.get_world_size()), timeout=30.0, backend="nccl")
    out: list[Any] = [None] * gpucoll.get_world_size()
    gpucoll.all_gather_object(out, gpucoll.get_rank(), group=g)
    assert out == list(range(gpucoll.get_world_size())) and not calls
    g._destroy()
    return "ok"


def test_objects_in_an_nccl_group_use_the_cpu_backend() -> None:
    assert run_spmd(nccl_like_group_body, 2, timeout=60) == ["ok", "ok"]


def _blob(rank: int, call: int) -> bytes:
    """A payload whose length crosses the first exchange's edges as calls go on: empty,
    short, exactly what rides with the size, one byte more, and several rows' worth."""
    from gpucoll._objects import FIRST_BYTES

    lengths = [0, 10, FIRST_BYTES - 8, FIRST_BYTES - 7, 3 * FIRST_BYTES + 5, 1]
    n = lengths[(call + rank) % len(lengths)]
    return bytes((rank * 31 + call * 7 + i) % 251 for i in range(n))


def reused_first_exchange_body() -> str:
    import gpucoll
    from gpucoll import _world
    from gpucoll._objects import all_gather_bytes

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    pg = _world._resolve(None)
    for call in range(24):
        # Long payloads followed by short ones: stale bytes in the reused row must never show.
        assert all_gather_bytes(_blob(r, call)) == [_blob(q, call) for q in range(n)], call
        out: list[Any] = [None] * n
        gpucoll.all_gather_object(out, {"r": r, "call": call, "pad": "y" * (call * 97 % 5000)})
        assert out == [{"r": q, "call": call, "pad": "y" * (call * 97 % 5000)} for q in range(n)]
    pool = pg._object_scratch
    assert pool is not None and len(pool) == 1  # made once, given back after every call
    kept = pool[0]
    # Arrays held elsewhere (another thread's call): this call makes its own, same answer.
    held = pool.pop()
    assert all_gather_bytes(_blob(r, 3)) == [_blob(q, 3) for q in range(n)]
    assert pool == []
    pool.append(held)
    # With a hook registered the op takes the Work path; the hook sees it.
    seen: list[str] = []
    pg.register_on_completion_hook(lambda info: seen.append(str(info.op_type)))
    assert all_gather_bytes(_blob(r, 4)) == [_blob(q, 4) for q in range(n)]
    deadline = time.monotonic() + 30  # hooks run on the group's watchdog thread, soon after
    while "all_gather_single" not in seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "all_gather_single" in seen, seen
    assert pool == [kept]
    # A new group has arrays of its own.
    sub = gpucoll.new_group(list(range(n)))
    assert all_gather_bytes(_blob(r, 5), group=sub) == [_blob(q, 5) for q in range(n)]
    assert sub._object_scratch is not None and sub._object_scratch[0] is not kept
    return "ok"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_the_first_exchange_reuses_its_arrays_and_never_shows_stale_bytes(world_size: int) -> None:
    assert run_spmd(reused_first_exchange_body, world_size, timeout=120) == ["ok"] * world_size
