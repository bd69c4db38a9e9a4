"""gpucoll on Ray: ``gpucoll.ray.run``, ``init_group``, the ``GPUCOLL`` backend of
``ray.util.collective``, and the failure path (a dead actor named in the survivors'
collectives within a second, shrink and carry on), on one local Ray cluster.

One cluster for the module (started once, torn down at the end), with HOME and Ray's
temporary folder in a fresh directory, so that Ray writes nothing elsewhere. Ray starts
its workers at nice 15: nothing here measures speed, only the 1 s bound of a death
notice (rerun once under heavy load before chasing it).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Iterator

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'gpucoll[ray]'); tests/ray needs it")

import gpucoll  # noqa: E402
import gpucoll.ray as gray  # noqa: E402
from gpucoll.clusters.base import ClusterEnv  # noqa: E402
from gpucoll.clusters.env import SOURCE, detect, rank_environment  # noqa: E402

pytestmark = pytest.mark.ray

JOB_S = 120.0  # every run's bound: a hang fails the test instead of the suite
DEAD_PIDS: list[int] = []  # ranks killed by the tests: nothing of theirs may stay behind


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    # Short: Ray's socket paths live under its temporary folder (AF_UNIX paths are short).
    tmp = tempfile.mkdtemp(prefix="gcr-", dir="/tmp")
    # The rank bodies below travel by value: Ray's workers cannot import this test module.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", tmp)  # Ray's auth token and caches go under $HOME/.ray
        # num_cpus 4 (logical): two 2-rank jobs fit at once. A small object store: the
        # tests move little through it, and CI machines have little /dev/shm.
        ray.init(num_cpus=4, object_store_memory=100 << 20, _temp_dir=os.path.join(tmp, "ray"),
                 include_dashboard=False, namespace="gpucoll-tests", log_to_driver=False)
        try:
            yield tmp
        finally:
            ray.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)


# ----- rank bodies (module level: Ray pickles them by reference) -----

def env_body() -> dict[str, Any]:
    import gpucoll
    from gpucoll.clusters.env import detect

    seen = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                           "MASTER_ADDR", "MASTER_PORT", "GPUCOLL_STORE_HOSTED",
                                           "GPUCOLL_STORE_TOKEN", "GPUCOLL_BACKEND", "GPUCOLL_DEATH_RECORDS")}
    cluster = detect(os.environ)
    gpucoll.init_process_group()  # no arguments: the rank environment says everything
    x = np.full(3, gpucoll.get_rank() + 1.0)
    gpucoll.all_reduce(x)
    out = {"env": seen, "detected": cluster, "rank": gpucoll.get_rank(), "size": gpucoll.get_world_size(),
           "backend": str(gpucoll.get_backend()), "sum": x.tolist(), "pid": os.getpid()}
    gpucoll.destroy_process_group()
    return out


def test_environment_and_rendezvous_are_gpucoll_runs(cluster: str) -> None:
    results = gray.run(env_body, 2, backend="cpu", timeout=JOB_S)
    token = results[0]["env"]["GPUCOLL_STORE_TOKEN"]
    port = int(results[0]["env"]["MASTER_PORT"])
    assert token and len(token) >= 32 and port > 0
    for rank, r in enumerate(results):
        # Exactly what gpucoll-run writes for a rank (the one contract), store hosted by the driver.
        want = rank_environment(ClusterEnv(SOURCE, rank, 2, rank, 2, "127.0.0.1", port, store_hosted=True),
                                token=token)
        assert {k: r["env"][k] for k in want} == want
        assert r["detected"] == detect(want)
        assert r["env"]["GPUCOLL_BACKEND"] == "cpu" and r["env"]["GPUCOLL_DEATH_RECORDS"] == "1"
        assert (r["rank"], r["size"], r["backend"], r["sum"]) == (rank, 2, "cpu", [3.0] * 3)
    assert results[0]["pid"] != results[1]["pid"]


def collectives_body(seed: int) -> dict[str, Any]:
    import gpucoll

    gpucoll.init_process_group("cpu", timeout=60)
    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    mine = np.random.default_rng(seed + r).standard_normal(6).astype(np.float64)
    out: dict[str, Any] = {}
    for name, op in (("sum", gpucoll.ReduceOp.SUM), ("max", gpucoll.ReduceOp.MAX),
                     ("min", gpucoll.ReduceOp.MIN), ("prod", gpucoll.ReduceOp.PRODUCT),
                     ("avg", gpucoll.ReduceOp.AVG)):
        x = mine.copy()
        gpucoll.all_reduce(x, op=op)
        out[f"all_reduce_{name}"] = x
    x = mine.copy()
    gpucoll.broadcast(x, src=1)
    out["broadcast"] = x
    x = mine.copy()
    gpucoll.reduce(x, dst=2)
    out["reduce"] = x if r == 2 else None
    parts = [np.empty(6) for _ in range(n)]
    gpucoll.all_gather(parts, mine)
    out["all_gather"] = np.stack(parts)
    flat = np.empty(6 * n)
    gpucoll.all_gather_single(flat, mine)
    out["all_gather_single"] = flat
    ins = np.arange(2 * n, dtype=np.float64) * (r + 1)
    got = np.empty(2)
    gpucoll.reduce_scatter_single(got, ins)
    out["reduce_scatter_single"] = got
    got = np.empty(2)
    gpucoll.reduce_scatter(got, [ins[2 * i:2 * i + 2].copy() for i in range(n)])
    out["reduce_scatter"] = got
    a2a = np.empty(2 * n)
    gpucoll.all_to_all_single(a2a, ins)
    out["all_to_all_single"] = a2a
    gathered = [np.empty(6) for _ in range(n)] if r == 0 else None
    gpucoll.gather(mine, gathered, dst=0)
    out["gather"] = np.stack(gathered) if gathered is not None else None
    sc = np.empty(2)
    gpucoll.scatter(sc, [ins[2 * i:2 * i + 2].copy() for i in range(n)] if r == 0 else None, src=0)
    out["scatter"] = sc
    ring = np.empty(6)
    reqs = [gpucoll.isend(mine, (r + 1) % n), gpucoll.irecv(ring, (r - 1) % n)]
    for q in reqs:
        q.wait()
    out["ring"] = ring
    objs: list[Any] = [None] * n
    gpucoll.all_gather_object(objs, {"rank": r})
    out["objects"] = objs
    gpucoll.barrier()
    gpucoll.destroy_process_group()
    return out


def test_every_collective_kind_against_numpy(cluster: str) -> None:
    n, seed = 3, 1234
    res = gray.run(collectives_body, n, args=(seed,), timeout=JOB_S)
    inputs = np.stack([np.random.default_rng(seed + r).standard_normal(6) for r in range(n)])
    ins = np.stack([np.arange(2 * n, dtype=np.float64) * (r + 1) for r in range(n)])
    for r, out in enumerate(res):
        np.testing.assert_allclose(out["all_reduce_sum"], inputs.sum(0))
        np.testing.assert_array_equal(out["all_reduce_max"], inputs.max(0))
        np.testing.assert_array_equal(out["all_reduce_min"], inputs.min(0))
        np.testing.assert_allclose(out["all_reduce_prod"], inputs.prod(0))
        np.testing.assert_allclose(out["all_reduce_avg"], inputs.mean(0))
        np.testing.assert_array_equal(out["broadcast"], inputs[1])
        if r == 2:
            np.testing.assert_allclose(out["reduce"], inputs.sum(0))
        np.testing.assert_array_equal(out["all_gather"], inputs)
        np.testing.assert_array_equal(out["all_gather_single"], inputs.reshape(-1))
        np.testing.assert_allclose(out["reduce_scatter_single"], ins.sum(0)[2 * r:2 * r + 2])
        np.testing.assert_allclose(out["reduce_scatter"], ins.sum(0)[2 * r:2 * r + 2])
        np.testing.assert_array_equal(out["all_to_all_single"], ins[:, 2 * r:2 * r + 2].reshape(-1))
        if r == 0:
            np.testing.assert_array_equal(out["gather"], inputs)
        np.testing.assert_array_equal(out["scatter"], ins[0, 2 * r:2 * r + 2])
        np.testing.assert_array_equal(out["ring"], inputs[(r - 1) % n])
        assert out["objects"] == [{"rank": i} for i in range(n)]


def job_body(scale: float, hold: float) -> tuple[float, int, str]:
    import gpucoll

    gpucoll.init_process_group()
    time.sleep(hold)  # both jobs' ranks alive at once
    x = np.full(2, scale * (gpucoll.get_rank() + 1))
    for _ in range(20):
        y = x.copy()
        gpucoll.all_reduce(y)
    gpucoll.destroy_process_group()
    return float(y[0]), os.getpid(), os.environ["MASTER_PORT"]


def test_two_jobs_at_once_on_one_cluster(cluster: str) -> None:
    out: dict[int, Any] = {}

    def start(i: int, scale: float) -> None:
        out[i] = gray.run(job_body, 2, args=(scale, 1.0), timeout=JOB_S)

    threads = [threading.Thread(target=start, args=(i, s)) for i, s in ((0, 1.0), (1, 10.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOB_S + 30)
    assert [r[0] for r in out[0]] == [3.0, 3.0] and [r[0] for r in out[1]] == [30.0, 30.0]
    assert out[0][0][2] != out[1][0][2], "two jobs share a store port"
    assert len({r[1] for job in out.values() for r in job}) == 4


def raising_body() -> None:
    import gpucoll

    gpucoll.init_process_group(timeout=60)
    x = np.ones(2)
    gpucoll.all_reduce(x)
    if gpucoll.get_rank() == 1:
        raise ValueError("rank one refuses: 4711")
    gpucoll.all_reduce(x)  # blocked until the job is stopped


def test_an_exception_on_one_rank_is_named_and_stops_the_others(cluster: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(gray.RayJobError) as info:
        gray.run(raising_body, 3, timeout=JOB_S)
    assert time.monotonic() - t0 < 45, "the other ranks were not stopped promptly"
    err = info.value
    assert err.rank == 1 and "rank 1 of 3" in str(err)
    assert "ValueError: rank one refuses: 4711" in str(err) and "raising_body" in str(err)  # the traceback
    assert err.failures[0].traceback.startswith("Traceback")


def victim_body(victim: int, how: str) -> Any:
    """The victim dies (os._exit, or ray.kill of its own actor); the survivors time the
    error of their pending all_reduce, shrink, and carry on among themselves."""
    import gpucoll

    gpucoll.init_process_group(timeout=60)
    x = np.ones(2)
    gpucoll.all_reduce(x)
    if gpucoll.get_rank() == victim:
        time.sleep(0.3)
        died_at = time.time()
        import ray as _ray

        with open(os.environ["GCR_STAMP"], "w") as f:
            f.write(repr(died_at))
        if how == "exit":
            os._exit(7)
        _ray.kill(_ray.get_runtime_context().current_actor, no_restart=True)
        time.sleep(60)
    try:
        gpucoll.all_reduce(x)  # pending when the victim dies
        return "no error"
    except gpucoll.DistBackendError as exc:
        failed_at, message = time.time(), str(exc)
    t0 = time.monotonic()
    gpucoll.shrink_group()
    shrink_s = time.monotonic() - t0
    y = np.full(2, float(gpucoll.get_rank() + 1))
    gpucoll.all_reduce(y)
    out = {"failed_at": failed_at, "message": message, "shrink_s": shrink_s, "sum": y.tolist(),
           "size": gpucoll.get_world_size(), "pid": os.getpid()}
    gpucoll.destroy_process_group()
    return out


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_a_dead_actor_is_named_within_a_second_and_survivors_shrink(cluster: str, how: str) -> None:
    stamp = os.path.join(cluster, f"died-{how}")  # the victim writes the time of its death here
    res = gray.run(_with_env, 3, args=(victim_body, {"GCR_STAMP": stamp}, 1, how), timeout=JOB_S,
                   on_failure="shrink")
    died_at = float(open(stamp).read())
    dead = res[1]
    DEAD_PIDS.append(getattr(dead, "pid", 0))
    assert isinstance(dead, gray.RankDied) and dead.rank == 1 and dead.pid > 0 and dead.node and dead.reason
    if how == "kill":
        assert "ray.kill" in dead.reason, dead.reason  # Ray's own words for the death
    for r in (0, 2):
        out = res[r]
        assert isinstance(out, dict), out
        delay = out["failed_at"] - died_at
        assert delay < 1.0, f"rank {r} learned of the death after {delay:.2f} s: {out['message']}"
        msg = out["message"]
        assert "rank 1" in msg and f"pid {dead.pid}" in msg and dead.node in msg, msg
        assert dead.reason[:40] in msg, (dead.reason, msg)
        assert out["shrink_s"] < 5.0, "shrink_group waited for its timeout"
        assert (out["size"], out["sum"]) == (2, [3.0, 3.0])


def _with_env(fn: Any, env: dict[str, str], *args: Any) -> Any:
    os.environ.update(env)
    return fn(*args)


def test_a_death_stops_the_job_when_asked_to_raise(cluster: str) -> None:
    stamp = os.path.join(cluster, "died-raise")
    with pytest.raises(gray.RayJobError) as info:
        gray.run(_with_env, 2, args=(victim_body, {"GCR_STAMP": stamp}, 0, "exit"), timeout=JOB_S)
    err = info.value
    assert err.rank == 0 and err.failures[0].died is not None
    assert f"pid {err.failures[0].died.pid}" in str(err) and "died" in str(err)


@ray.remote(num_cpus=0)
class Trainer:
    """A user's actor: no gpucoll method of its own."""

    def step(self, value: float) -> list[float]:
        x = np.full(3, value)
        gpucoll.all_reduce(x)  # the default group, no group argument
        return x.tolist()

    def state(self) -> tuple[bool, str | None]:
        return gpucoll.is_initialized(), os.environ.get("RANK")


def test_init_group_on_existing_actors_and_destroy(cluster: str) -> None:
    actors = [Trainer.remote() for _ in range(3)]
    group = gray.init_group(actors, backend="cpu", timeout=60)
    assert ray.get([a.state.remote() for a in actors], timeout=JOB_S) == [(True, "0"), (True, "1"), (True, "2")]
    assert ray.get([a.step.remote(float(i)) for i, a in enumerate(actors)], timeout=JOB_S) == [[3.0] * 3] * 3
    group.destroy()
    group.destroy()  # harmless
    assert ray.get([a.state.remote() for a in actors], timeout=JOB_S) == [(False, None)] * 3
    for a in actors:
        ray.kill(a)


class Collective:
    """An actor using ray.util.collective with backend GPUCOLL, in a process without torch."""

    def __init__(self) -> None:
        self.had_torch = "torch" in sys.modules
        sys.modules["torch"] = None  # type: ignore[assignment]  # importing torch now fails
        import gpucoll.ray

        gpucoll.ray.register()  # the setup hook did it already: harmless again

    def work(self, rank: int, n: int) -> dict[str, Any]:
        import ray.util.collective as col

        x = np.full(4, rank + 1.0)
        col.allreduce(x, group_name="g")  # the first call makes the group (create_collective_group's record)
        assert (col.get_rank("g"), col.get_collective_group_size("g")) == (rank, n)
        b = np.full(4, float(rank))
        col.broadcast(b, src_rank=1, group_name="g")
        parts = [np.empty(4) for _ in range(n)]
        col.allgather(parts, np.full(4, 10.0 * rank), group_name="g")
        rs = np.empty(2)
        col.reducescatter(rs, [np.full(2, rank + i + 0.0) for i in range(n)], group_name="g")
        mx = np.full(2, float(rank))
        col.allreduce(mx, group_name="g", op=col.types.ReduceOp.MAX)
        red = np.full(2, 2.0)
        col.reduce(red, dst_rank=0, group_name="g")
        col.barrier(group_name="g")
        got = np.zeros(3)
        if rank == 0:
            col.send(np.arange(3.0), 1, group_name="g")
        else:
            col.recv(got, 0, group_name="g")
        col.destroy_collective_group("g")
        return {"allreduce": x.tolist(), "broadcast": b.tolist(), "allgather": [p.tolist() for p in parts],
                "reducescatter": rs.tolist(), "max": mx.tolist(), "reduce": red.tolist() if rank == 0 else None,
                "recv": got.tolist(), "torch": "torch" in sys.modules and sys.modules["torch"] is not None,
                "had_torch": self.had_torch}


def test_gpucoll_backend_through_ray_util_collective(cluster: str) -> None:
    import ray.util.collective as col

    gray.register()
    gray.register()
    cls = ray.remote(num_cpus=0)(Collective).options(
        runtime_env={"worker_process_setup_hook": "gpucoll.ray.register"})
    actors = [cls.remote() for _ in range(2)]
    col.create_collective_group(actors, 2, [0, 1], backend="GPUCOLL", group_name="g")
    out = ray.get([a.work.remote(i, 2) for i, a in enumerate(actors)], timeout=JOB_S)
    for rank, o in enumerate(out):
        assert o["allreduce"] == [3.0] * 4 and o["broadcast"] == [1.0] * 4
        assert o["allgather"] == [[0.0] * 4, [10.0] * 4]
        assert o["reducescatter"] == [float(sum(r + rank for r in range(2)))] * 2
        assert o["max"] == [1.0, 1.0]
        assert not o["had_torch"] and not o["torch"], "the actor imported torch"
    assert out[0]["reduce"] == [4.0, 4.0] and out[1]["recv"] == [0.0, 1.0, 2.0]
    for a in actors:
        ray.kill(a)


def gpu_body() -> dict[str, Any]:
    import cupy

    import gpucoll

    local = int(os.environ["LOCAL_RANK"])
    cupy.cuda.Device(local).use()  # the rank's own GPU: its LOCAL_RANK-th visible one
    gpucoll.init_process_group()  # GPUCOLL_BACKEND=nccl from run(backend="nccl")
    x = cupy.full(4, float(gpucoll.get_rank() + 1), dtype=cupy.float32)
    gpucoll.all_reduce(x)
    out = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "count": cupy.cuda.runtime.getDeviceCount(),
           "local": local, "local_size": int(os.environ["LOCAL_WORLD_SIZE"]), "sum": x.get().tolist(),
           "backend": str(gpucoll.get_backend())}
    gpucoll.destroy_process_group()
    return out


@pytest.mark.gpu
def test_gpu_ranks_see_their_nodes_gpus_and_use_their_own(cluster: str) -> None:
    gpus = int(ray.cluster_resources().get("GPU", 0))
    assert gpus >= 1, "Ray sees no GPU on a machine where CUDA does"
    n = min(gpus, 2)  # one GPU: world size 1
    res = gray.run(gpu_body, n, backend="nccl", timeout=JOB_S)
    for r in res:
        assert r["backend"] == "nccl" and r["sum"] == [float(n * (n + 1) // 2)] * 4
        assert r["count"] == r["local_size"] == len(r["visible"].split(","))  # the node's ranks' GPUs, all


def sleepy_body(seconds: float) -> None:
    time.sleep(seconds)


def test_timeout_and_an_impossible_placement_are_named_errors(cluster: str) -> None:
    t0 = time.monotonic()
    # 10 s: the bound covers starting the actors too, which takes seconds on a busy machine.
    with pytest.raises(gray.RayJobError, match=r"timed out after 10 s; ranks \[0, 1\] had not finished"):
        gray.run(sleepy_body, 2, args=(60.0,), timeout=10.0)
    assert time.monotonic() - t0 < 40
    with pytest.raises(gray.RayJobError, match=r"did not place 2 ranks of \{'CPU': 64.0\}"):
        gray.run(sleepy_body, 2, args=(0.0,), resources_per_rank={"CPU": 64.0}, timeout=2.0)


def test_the_store_served_by_a_head_node_actor(cluster: str) -> None:
    """The path of a Ray Client driver, which the ranks cannot reach: an actor serves the
    store and reports its port; records go through it."""
    from gpucoll._backends import deaths
    from gpucoll.ray._store import JobStore
    from gpucoll.store import TCPStore

    store = JobStore(ray, loopback=False, in_actor=True)
    try:
        client = TCPStore(store.addr, store.port, is_master=False, timeout=30, token=store.token)
        client.set("k", b"v")
        store.record({"rank": 5, "node": "n", "pid": 9, "reason": "test"})
        assert client.get("k") == b"v" and [r["rank"] for r in deaths.read(client)] == [5]
        with pytest.raises(Exception):
            TCPStore(store.addr, store.port, is_master=False, timeout=5, token="wrong").get("k")
        client.close()
    finally:
        store.close()


def test_nothing_left_behind(cluster: str) -> None:
    results = gray.run(env_body, 2, timeout=JOB_S)
    pids = [r["pid"] for r in results] + [p for p in DEAD_PIDS if p]
    with pytest.raises(gray.RayJobError):
        gray.run(raising_body, 2, timeout=JOB_S)
    for pid in pids:
        assert not _alive(pid), f"rank process {pid} is still running"
    left = [f for f in os.listdir("/dev/shm") if any(f"-{pid}-" in f for pid in pids)]
    assert not left, f"shared-memory segments left behind: {left}"
    from ray.util import placement_group_table

    live = [p for p in placement_group_table().values() if p["state"] != "REMOVED"]
    assert not live, f"placement groups left: {live}"
    from ray._private.state import actors as actor_table  # no public listing without the dashboard

    alive = [a for a in actor_table().values() if a["State"] != "DEAD" and a["ActorClassName"] == "RankActor"]
    assert not alive, f"rank actors left: {alive}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
