"""DeviceMesh: layout, coordinates, per-dimension groups and sub-meshes, checked against
torch's DeviceMesh (on torch's fake process group, one rank at a time in this process),
then used for real collectives on CPU ranks (run_spmd) and on the fake GPU.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

import gpucoll
from gpucoll.testing import run_spmd

LAYOUTS = [((1,), ("x",)), ((3,), ("dp",)), ((1, 3), ("dp", "tp")), ((2, 2), ("dp", "tp")), ((4,), None),
           ((2, 1, 2), ("pp", "dp", "tp"))]


def _name_sets(names: tuple[str, ...] | None) -> list[tuple[str, ...]]:
    if not names:
        return []
    return [c for k in range(1, len(names) + 1) for c in itertools.combinations(names, k)]


def describe(mesh: Any, ranks_of: Any) -> dict[str, Any]:
    """What a mesh looks like from one rank, in plain Python (torch's mesh or ours)."""
    mesh_list = mesh.mesh.tolist()
    out: dict[str, Any] = {
        "mesh": mesh_list, "shape": tuple(mesh.shape), "ndim": mesh.ndim, "size": mesh.size(),
        "sizes": [mesh.size(d) for d in range(mesh.ndim)], "rank": mesh.get_rank(),
        "coordinate": tuple(mesh.get_coordinate()), "local": [mesh.get_local_rank(d) for d in range(mesh.ndim)],
        "groups": [ranks_of(mesh.get_group(d)) for d in range(mesh.ndim)],
        "all_groups": [ranks_of(g) for g in mesh.get_all_groups()],
        "names": tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
    }
    for combo in _name_sets(out["names"]):
        sub = mesh[combo if len(combo) > 1 else combo[0]]
        out[f"sub{combo}"] = (sub.mesh.tolist(), tuple(sub.get_coordinate()),
                              [ranks_of(g) for g in sub.get_all_groups()], tuple(sub.mesh_dim_names))
    if out["names"]:
        out["by_name"] = [(mesh.get_local_rank(n), ranks_of(mesh.get_group(n))) for n in out["names"]]
    return out


def torch_reference(shape: tuple[int, ...], names: tuple[str, ...] | None) -> list[dict[str, Any]]:
    torch = pytest.importorskip("torch", reason="torch's DeviceMesh is the reference")
    dist = torch.distributed
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    n = int(np.prod(shape))
    out = []
    for rank in range(n):
        dist.init_process_group("fake", rank=rank, world_size=n, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            out.append(describe(mesh, dist.get_process_group_ranks))
        finally:
            dist.destroy_process_group()
    return out


def _ours(shape: tuple[int, ...], names: tuple[str, ...] | None) -> dict[str, Any]:
    mesh = gpucoll.init_device_mesh("cpu", shape, mesh_dim_names=names)
    got = describe(mesh, gpucoll.get_process_group_ranks)
    # Each dimension's group really communicates: the sum of global ranks along the line.
    sums = []
    for d in range(mesh.ndim):
        x = np.array([float(gpucoll.get_rank())])
        gpucoll.all_reduce(x, group=mesh.get_group(d))
        sums.append(float(x[0]))
    got["sums"] = sums
    got["repr"] = repr(mesh)
    return got


def _all_layouts() -> dict[int, list[dict[str, Any]]]:
    """Every layout of one world size, in one world (starting ranks is the slow part)."""
    out = {}
    for i, (shape, names) in enumerate(LAYOUTS):
        if int(np.prod(shape)) == gpucoll.get_world_size():
            out[i] = _ours(shape, names)
    return out


@pytest.mark.parametrize("n", [1, 3, 4])
def test_layouts_coordinates_groups_and_submeshes_match_torch(n: int) -> None:
    results = run_spmd(_all_layouts, n, timeout=90)
    checked = 0
    for i, (shape, names) in enumerate(LAYOUTS):
        if int(np.prod(shape)) != n:
            continue
        want = torch_reference(shape, names)
        for rank in range(n):
            got = dict(results[rank][i])
            sums, text = got.pop("sums"), got.pop("repr")
            assert got == want[rank], (shape, rank)
            assert sums == [float(sum(g)) for g in want[rank]["groups"]]
            assert f"mesh={want[rank]['mesh']}" in text
            checked += 1
    assert checked >= n


def _errors_and_from_group() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with pytest.raises(ValueError, match=r"mesh_shape \(3,\) holds 3 ranks but the world size is 4"):
        gpucoll.init_device_mesh("cpu", (3,))
    with pytest.raises(ValueError, match="device_type must be 'cpu' or 'cuda'"):
        gpucoll.init_device_mesh("tpu", (4,))
    with pytest.raises(ValueError, match="needs an NCCL default group"):
        gpucoll.init_device_mesh("cuda", (4,))
    with pytest.raises(ValueError, match="unique"):
        gpucoll.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "a"))
    mesh = gpucoll.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(RuntimeError, match="pass mesh_dim"):
        mesh.get_group()
    with pytest.raises(KeyError, match="mesh's order"):
        mesh["tp", "dp"]
    with pytest.raises(KeyError, match="invalid mesh_dim_names"):
        mesh["xx"]
    assert mesh["dp", "tp"] is mesh
    # from_group: one group -> 1-d mesh; a list of groups + the layout -> n-d mesh, no new groups
    made = len(gpucoll._world._world().groups)
    one = gpucoll.DeviceMesh.from_group(mesh.get_group("tp"), "cpu", mesh_dim_names=("tp",))
    again = gpucoll.DeviceMesh.from_group(mesh.get_all_groups(), "cpu", mesh=mesh.mesh, mesh_dim_names=("dp", "tp"))
    assert len(gpucoll._world._world().groups) == made
    assert again == mesh and hash(again) == hash(mesh) and one == mesh["tp"]
    with pytest.raises(ValueError, match="line along dimension 0"):
        gpucoll.DeviceMesh.from_group(mesh.get_all_groups()[::-1], "cpu", mesh=mesh.mesh)
    # an arbitrary layout through the constructor: columns first
    cols = gpucoll.DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("a", "b"))
    out["cols"] = (cols.get_coordinate(), gpucoll.get_process_group_ranks(cols.get_group("b")))
    # a mesh over some ranks only: the others are not in it
    part = gpucoll.DeviceMesh("cpu", [0, 1, 2])
    out["part"] = part.get_coordinate()
    if part.get_coordinate() is None:
        with pytest.raises(RuntimeError, match="not in this DeviceMesh"):
            part.get_group()
    return out


def test_errors_from_group_and_custom_layouts() -> None:
    results = run_spmd(_errors_and_from_group, 4, timeout=90)
    assert [r["cols"] for r in results] == [((0, 0), [0, 2]), ((1, 0), [1, 3]), ((0, 1), [0, 2]), ((1, 1), [1, 3])]
    assert [r["part"] for r in results] == [(0,), (1,), (2,), None]


def test_a_mesh_needs_the_default_group_or_makes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # without a world and without an environment, init_device_mesh tries init_process_group's env://
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert not gpucoll.is_initialized()
    with pytest.raises(ValueError, match="env://"):
        gpucoll.init_device_mesh("cpu", (1,))
    store = gpucoll.HashStore()
    gpucoll.init_process_group("cpu", store=store, rank=0, world_size=1)
    try:
        mesh = gpucoll.init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
        assert mesh.get_coordinate() == (0, 0) and mesh.size() == 1
        x = np.ones(3)
        gpucoll.all_reduce(x, group=mesh.get_group("b"))
        assert x.tolist() == [1.0] * 3
    finally:
        gpucoll.destroy_process_group()


# ============================================================ on the fake GPU: groups split from the default one

def test_a_cuda_mesh_splits_the_default_communicator_once_per_dimension(monkeypatch: pytest.MonkeyPatch) -> None:
    from _fake_gpu_world import FakeDeviceArray, run_fake_gpu_worlds, split_made

    def body(w: Any, rt: Any, rank: int) -> dict[str, Any]:
        before = len(w._world().groups)
        mesh = gpucoll.init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
        out: dict[str, Any] = {"new_groups": len(w._world().groups) - before, "coord": mesh.get_coordinate()}
        assert all(split_made(g) for g in mesh.get_all_groups())
        for name in ("dp", "tp"):
            x = FakeDeviceArray(rt, np.full(4, rank + 1, np.float32))
            gpucoll.all_reduce(x, group=mesh[name].get_group())
            out[name] = float(x.get()[0])
        return out

    results = run_fake_gpu_worlds(4, body, monkeypatch)
    # rank = 2 * dp + tp; a dp group is a column {tp, tp + 2}, a tp group a row {2dp, 2dp + 1}
    for rank, got in enumerate(results):
        dp, tp = divmod(rank, 2)
        assert got["coord"] == (dp, tp) and got["new_groups"] == 2
        assert got["dp"] == (tp + 1) + (tp + 3) and got["tp"] == (2 * dp + 1) + (2 * dp + 2)
