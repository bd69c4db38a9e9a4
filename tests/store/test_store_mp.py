"""Stores under real multi-process concurrency, through gpucoll.testing.run_spmd.

One world of 8 processes runs every check against both multi-process stores: the
harness's TCPStore (hosted in the test process) and a FileStore in a temp dir.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpucoll.testing import run_spmd

WORLD = 8
ADDS = 1000
ROUNDS = 20
ITEMS = 25


def _barrier(store: Any, name: str, world: int) -> None:
    if store.add(f"{name}/arrived", 1) == world:
        store.set(f"{name}/go", b"1")
    store.wait([f"{name}/go"])


def _body(file_path: str) -> dict[str, Any]:
    from gpucoll.store import FileStore, PrefixStore, TCPStore

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    # The token comes from GPUCOLL_STORE_TOKEN, set by the harness.
    tcp = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=60)
    fs = FileStore(file_path, world_size=world, timeout=60)
    out: dict[str, Any] = {}
    for name, base in (("tcp", tcp), ("file", fs)):
        s = PrefixStore(name, base)
        for _ in range(ADDS):
            s.add("counter", 1)
        _barrier(s, "after-adds", world)
        total = int(s.get("counter"))
        mine = f"rank{rank}".encode()
        wins = [r for r in range(ROUNDS) if s.compare_set(f"race/{r}", b"", mine) == mine]
        _barrier(s, "after-race", world)
        final = s.multi_get([f"race/{r}" for r in range(ROUNDS)])
        for i in range(ITEMS):
            s.queue_push("q", f"{rank}:{i}")
        popped = []
        # A claim <= the number of items guarantees one will be there to pop.
        while s.add("claims", 1) <= world * ITEMS:
            popped.append(s.queue_pop("q", timeout=30).decode())
        out[name] = {"total": total, "wins": wins, "final": final, "popped": popped}
    fs.close()
    tcp.close()
    return out


def test_concurrent_add_cas_and_queue_across_8_processes(tmp_path: Path) -> None:
    path = str(tmp_path / "mp.store")
    results = run_spmd(_body, WORLD, args=(path,), init=False, timeout=240)
    for name in ("tcp", "file"):
        per = [r[name] for r in results]
        # add: every rank, after the barrier, sees the exact total.
        assert [p["total"] for p in per] == [WORLD * ADDS] * WORLD, name
        # compare_set: exactly one winner per round, and everyone reads the winner's value.
        for rnd in range(ROUNDS):
            winners = [rank for rank, p in enumerate(per) if rnd in p["wins"]]
            assert len(winners) == 1, (name, rnd, winners)
            assert all(p["final"][rnd] == f"rank{winners[0]}".encode() for p in per), (name, rnd)
        # queue_pop: every item delivered exactly once.
        popped = [item for p in per for item in p["popped"]]
        expected = sorted(f"{r}:{i}" for r in range(WORLD) for i in range(ITEMS))
        assert sorted(popped) == expected, name
    # The last of world_size FileStores to close removes the file.
    assert not os.path.exists(path)
