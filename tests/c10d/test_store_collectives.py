"""StoreCollectives: torch's _StoreCollectives over every gpucoll store.

One scripted exchange runs on rank threads twice, once through torch's
``_StoreCollectives`` on torch's HashStore and once through ours; the results must
be identical. Timeouts must name the same missing ranks as torch does. A
multi-process run through the job's TCPStore covers world sizes 1-4.
"""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest

import gpucoll
from gpucoll import DistStoreTimeoutError, FileStore, HashStore, PrefixStore, StoreCollectives, TCPStore
from gpucoll.testing import run_spmd


def on_threads(n: int, body: Callable[[int], Any], timeout: float = 30.0) -> list[Any]:
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def main(r: int) -> None:
        try:
            results[r] = body(r)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank thread hung"
    if errors:
        raise errors[0]
    return results


def script(sc: Any, rank: int, n: int, timeout: Any) -> dict[str, Any]:
    """The same sequence of calls, for torch's object or ours (both take str data)."""
    out: dict[str, Any] = {}
    out["all_gather"] = [bytes(b) for b in sc.all_gather("ag", f"from{rank}", timeout)]
    out["all_sum"] = sc.all_sum("sum", rank * 10 + 1, timeout)
    sc.barrier("b1", timeout)
    if rank == 0:
        sc.broadcast_send("bc", "hello", timeout)
    else:
        out["broadcast"] = bytes(sc.broadcast_recv("bc", timeout))
    dst = n - 1
    if rank == dst:
        out["gather"] = [bytes(b) for b in sc.gather_recv("ga", f"g{rank}", timeout)]
    else:
        sc.gather_send("ga", f"g{rank}", timeout)
    if rank == 0:
        out["scatter"] = bytes(sc.scatter_send("sc", [f"part{i}" for i in range(n)], timeout))
    else:
        out["scatter"] = bytes(sc.scatter_recv("sc", timeout))
    # a non-blocking arrival: rank 0 marks it and goes on; the others wait for everyone
    sc.barrier("b2", timeout, block=(rank != 0))
    out["all_sum2"] = sc.all_sum("sum2", -rank, timeout)
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_the_same_script_gives_the_same_results_as_torch(n: int, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason="torch is the reference for _StoreCollectives")
    dist = torch.distributed
    tstore = dist.HashStore()
    want = on_threads(n, lambda r: script(dist._StoreCollectives(tstore, r, n), r, n, timedelta(seconds=20)))
    stores: dict[str, Callable[[], Any]] = {
        "hash": lambda: HashStore(timeout=20),
        "file": lambda: FileStore(tmp_path / "fs", timeout=20),
        "prefix": lambda: PrefixStore("job7", HashStore(timeout=20)),
    }
    for kind, make in stores.items():
        shared = make()
        got = on_threads(n, lambda r: script(StoreCollectives(shared, r, n), r, n, 20.0))
        assert got == want, kind
    assert want[0]["all_sum"] == sum(r * 10 + 1 for r in range(n))


def test_over_tcp_store_clients_on_threads() -> None:
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=20)
    try:
        def body(r: int) -> dict[str, Any]:
            client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=20)
            try:
                return script(StoreCollectives(client, r, 3), r, 3, 20.0)
            finally:
                client.close()
        got = on_threads(3, body)
    finally:
        server.close()
    assert got[2]["gather"] == [b"g0", b"g1", b"g2"]
    assert [g["scatter"] for g in got] == [b"part0", b"part1", b"part2"]


def _missing_from_torch(message: str) -> list[int]:
    found = re.search(r"missing ranks: ([0-9, ]*)", message)
    assert found, message
    return [int(x) for x in found.group(1).replace(" ", "").split(",") if x]


@pytest.mark.parametrize("op", ["barrier", "all_gather", "gather_recv", "all_sum"])
def test_a_timeout_names_the_same_missing_ranks_as_torch(op: str) -> None:
    torch = pytest.importorskip("torch", reason="torch is the reference for _StoreCollectives")
    dist = torch.distributed
    n, present = 4, [0, 2]  # ranks 1 and 3 never arrive; rank 0 is the one that times out

    def call(sc: Any, rank: int, timeout: Any) -> str:
        t0 = time.monotonic()
        try:
            if op == "gather_recv":
                if rank:
                    sc.gather_send("k", "x", timeout)
                    return ""
                sc.gather_recv("k", "me", timeout)
            elif op == "all_gather":
                sc.all_gather("k", "me", timeout)
            elif op == "all_sum":
                sc.all_sum("k", 1, timeout)
            else:
                sc.barrier("k", timeout)
        except RuntimeError as exc:
            assert time.monotonic() - t0 < 5
            return str(exc)
        raise AssertionError(f"{op} did not time out")

    def run(make: Callable[[int], Any], timeout: Any) -> str:
        got = on_threads(len(present), lambda i: call(make(present[i]), present[i], timeout))
        return str(got[0])

    tstore = dist.HashStore()
    theirs = run(lambda r: dist._StoreCollectives(tstore, r, n), timedelta(seconds=0.3))
    ours_store = HashStore(timeout=10)
    ours = run(lambda r: StoreCollectives(ours_store, r, n), 0.3)
    want = _missing_from_torch(theirs)
    assert want and want == _missing_from_torch(ours)
    # torch's words lead, then the caller's key (never the internal barrier's)
    assert want == [1, 3] and theirs.split(", Wait timeout")[0] == ours.split(", Wait timeout")[0]
    assert "'k'" in ours and "k/barrier" not in ours
    with pytest.raises(DistStoreTimeoutError, match=r"^barrier failed -- missing ranks: 1, 2, 3, Wait timeout"):
        StoreCollectives(HashStore(), 0, 4).barrier("k", 0.2)


def test_keys_are_single_use_and_arguments_are_checked() -> None:
    sc = StoreCollectives(HashStore(), 0, 1)
    sc.barrier("k", 1.0)
    with pytest.raises(ValueError, match="Key k has already been used"):
        sc.barrier("k", 1.0)
    with pytest.raises(ValueError, match="Key k has already been used"):
        sc.all_gather("k", "x")
    assert sc.all_gather("solo", b"\x00\xff") == [b"\x00\xff"]
    assert sc.all_sum("s", 7) == 7
    # torch accepts any rank at construction; the calls indexed by rank refuse it
    with pytest.raises(ValueError, match="needs rank < world_size"):
        StoreCollectives(HashStore(), 2, 2).all_gather("x", b"")
    with pytest.raises(ValueError, match="rank must be >= 0"):
        StoreCollectives(HashStore(), -1, 2)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        StoreCollectives(HashStore(), 0, 0)
    with pytest.raises(TypeError, match="store must be a gpucoll Store"):
        StoreCollectives(object(), 0, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one per rank"):
        StoreCollectives(HashStore(), 0, 2).scatter_send("x", ["only one"])
    with pytest.raises(ValueError, match="timeout must be a positive"):
        sc.barrier("neg", -1)
    with pytest.raises(DistStoreTimeoutError, match="sender never published"):
        StoreCollectives(HashStore(), 1, 2).broadcast_recv("nothing", 0.1)
    with pytest.raises(DistStoreTimeoutError, match="never sent this rank's part"):
        StoreCollectives(HashStore(), 1, 2).scatter_recv("nothing", 0.1)


def _spmd_body() -> dict[str, Any]:
    rank, n = gpucoll.get_rank(), gpucoll.get_world_size()
    store = PrefixStore("control", gpucoll.GroupMember.WORLD.store)  # type: ignore[union-attr]
    sc = StoreCollectives(store, rank, n)
    out = script(sc, rank, n, 20.0)
    if rank == 0:
        # rank 0 alone waits on a barrier the others skip: it names them all
        try:
            sc.barrier("alone", 0.3)
        except DistStoreTimeoutError as exc:
            out["alone"] = str(exc)
    return out


@pytest.mark.parametrize("n", [1, 3, 4])
def test_across_processes_through_the_job_store(n: int) -> None:
    results = run_spmd(_spmd_body, n, timeout=60)
    for rank, got in enumerate(results):
        assert got["all_gather"] == [f"from{r}".encode() for r in range(n)]
        assert got["all_sum"] == sum(r * 10 + 1 for r in range(n))
        assert got["all_sum2"] == -sum(range(n))
        assert got["scatter"] == f"part{rank}".encode()
        if rank:
            assert got["broadcast"] == b"hello"
    assert results[n - 1]["gather"] == [f"g{r}".encode() for r in range(n)]
    if n > 1:
        shown = ", ".join(map(str, range(1, n)))
        assert results[0]["alone"].startswith(f"barrier failed -- missing ranks: {shown}, Wait timeout")
