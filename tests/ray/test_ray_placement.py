"""gpucoll.ray's placement rules and death records without a Ray cluster: the rank order
(node, then GPU), each rank's environment (gpucoll-run's contract, CUDA_VISIBLE_DEVICES
per node), and the records a launcher writes into the job's store."""

from __future__ import annotations

import threading
import time

import pytest

from gpucoll._backends import deaths
from gpucoll.clusters.base import ClusterEnv
from gpucoll.clusters.env import SOURCE, detect, rank_environment
from gpucoll.ray import _ranks
from gpucoll.store import HashStore, PrefixStore


def info(node: str, pid: int, gpus: list[str]) -> dict[str, object]:
    return {"node_id": f"id-{node}", "node": node, "pid": pid, "gpus": gpus}


def test_ranks_are_ordered_by_node_then_gpu_and_get_gpucoll_runs_environment() -> None:
    # Bundles as Ray placed them: interleaved nodes, GPUs out of order (10 after 9).
    infos = [info("10.0.0.2", 11, ["10"]), info("10.0.0.1", 12, ["1"]), info("10.0.0.2", 13, ["9"]),
             info("10.0.0.1", 14, ["0"])]
    places = _ranks.order(infos)
    assert [(p.node, p.gpus) for p in places] == [("10.0.0.2", ("9",)), ("10.0.0.2", ("10",)),
                                                  ("10.0.0.1", ("0",)), ("10.0.0.1", ("1",))]
    envs = _ranks.environments(places, "10.0.0.9", 4242, "tok", backend="nccl", loopback=False)
    for rank, (p, env) in enumerate(zip(places, envs)):
        local = rank % 2
        want = rank_environment(ClusterEnv(SOURCE, rank, 4, local, 2, "10.0.0.9", 4242, store_hosted=True,
                                           node_rank=rank // 2), token="tok")
        assert {k: env[k] for k in want} == want
        assert detect({k: v for k, v in env.items() if v is not None}) == detect(want)
        # Every GPU of the node's ranks is visible; the rank's own is its LOCAL_RANK-th.
        visible = (env["CUDA_VISIBLE_DEVICES"] or "").split(",")
        assert visible == (["9", "10"] if p.node == "10.0.0.2" else ["0", "1"])
        assert visible[local] == p.gpus[0]
        assert (env["GPUCOLL_CPU_IFADDR"], env["GPUCOLL_BACKEND"], env["GPUCOLL_DEATH_RECORDS"]) == (p.node, "nccl", "1")


def test_given_order_stands_for_init_group_and_cpu_ranks_get_no_devices() -> None:
    infos = [info("b", 1, []), info("a", 2, []), info("b", 3, [])]
    places = _ranks.order(infos, by_node=False)
    assert [p.pid for p in places] == [1, 2, 3]
    envs = _ranks.environments(places, "127.0.0.1", 5, "t", backend=None, loopback=True)
    assert [(e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) for e in envs] == [
        ("0", "2", "0"), ("0", "1", "1"), ("1", "2", "0")]
    assert all("CUDA_VISIBLE_DEVICES" not in e and e["GPUCOLL_CPU_IFADDR"] == "" and e["GPUCOLL_BACKEND"] == ""
               for e in envs)


def test_death_records_are_found_through_namespaces_and_awaited() -> None:
    root = HashStore()
    group_store = PrefixStore("cpu", PrefixStore("pg/default", PrefixStore("gpucoll/gen1", root)))
    made = time.time()
    assert deaths.read(group_store) == []
    t0 = time.monotonic()
    assert deaths.await_since(group_store, made, timeout=0.2) == []  # none came: bounded wait
    assert 0.15 < time.monotonic() - t0 < 2.0
    deaths.write(root, {"rank": 0, "node": "n0", "pid": 1, "reason": "old", "time": made - 10})  # before the group

    def later() -> None:
        time.sleep(0.2)
        deaths.write(root, {"rank": 3, "node": "10.1.1.1", "node_id": "abcdef0123456789", "pid": 77,
                            "reason": "killed by ray.kill"})

    threading.Thread(target=later).start()
    t0 = time.monotonic()
    found = deaths.await_since(group_store, made, timeout=5.0)
    assert time.monotonic() - t0 < 2.0, "the wait was not woken by the record"
    assert [r["rank"] for r in found] == [3]
    assert deaths.describe(found[0]) == ("rank 3 of the job (node 10.1.1.1, node id abcdef012345, pid 77) died: "
                                         "killed by ray.kill")
    assert [r["rank"] for r in deaths.read(group_store)] == [0, 3]


def test_death_records_are_off_unless_the_launcher_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUCOLL_DEATH_RECORDS", raising=False)
    assert not deaths.enabled()
    monkeypatch.setenv("GPUCOLL_DEATH_RECORDS", "1")
    assert deaths.enabled()


@pytest.mark.parametrize("kwargs, match", [
    ({"world_size": 0}, "world_size must be an int >= 1; got 0"),
    ({"world_size": 2, "on_failure": "retry"}, "on_failure must be 'raise' or 'shrink'; got 'retry'"),
    ({"world_size": 2, "strategy": "pack"}, "strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD"),
    ({"world_size": 2, "timeout": 0}, "timeout must be a positive number of seconds or None; got 0"),
])
def test_run_refuses_bad_arguments_before_touching_ray(kwargs: dict[str, object], match: str) -> None:
    import gpucoll.ray

    with pytest.raises(ValueError, match=match):
        gpucoll.ray.run(print, **kwargs)  # type: ignore[arg-type]


def test_init_process_group_without_a_backend_takes_the_launchers_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpucoll

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPUCOLL_BACKEND", "fake")  # not anyone's default: only the variable picks it
    gpucoll.init_process_group(rank=1, world_size=3)
    try:
        assert (str(gpucoll.get_backend()), gpucoll.get_rank(), gpucoll.get_world_size()) == ("fake", 1, 3)
    finally:
        gpucoll.destroy_process_group()
    monkeypatch.setenv("GPUCOLL_BACKEND", "mpi")
    with pytest.raises(ValueError, match=r"GPUCOLL_BACKEND='mpi' \(the backend init_process_group\(\) picks"):
        gpucoll.init_process_group(rank=0, world_size=1)
    assert not gpucoll.is_initialized()


def test_without_ray_each_entry_point_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import gpucoll.ray

    monkeypatch.setitem(sys.modules, "ray", None)  # importing ray now fails, as where it is not installed
    for call in (lambda: gpucoll.ray.run(print, 2), lambda: gpucoll.ray.init_group([object()]),
                 gpucoll.ray.register):
        with pytest.raises(ImportError, match=r"gpucoll.ray needs Ray.*pip install 'gpucoll\[ray\]'"):
            call()
