"""Placing ranks: their order (node, then GPU) and each one's environment, written with
the rank-environment contract gpucoll-run uses (:func:`gpucoll.clusters.env.rank_environment`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .._env import BACKEND_ENV, CPU_IFADDR_ENV, DEATH_RECORDS_ENV
from ..clusters.base import ClusterEnv
from ..clusters.env import SOURCE, rank_environment

__all__ = ["Placement", "order", "environments"]


@dataclass(frozen=True)
class Placement:
    """Where one rank runs (from the actor's own report)."""

    index: int  # the actor's position as it was made (bundle) or given (init_group)
    node_id: str
    node: str  # address
    pid: int
    gpus: tuple[str, ...]


def _gpu_key(gpus: Sequence[str]) -> tuple[int, str]:
    ids = sorted(gpus, key=lambda g: (len(g), g))
    return (int(ids[0]), "") if ids and ids[0].isdigit() else (-1, ids[0] if ids else "")


def order(infos: Sequence[dict[str, Any]], *, by_node: bool = True) -> list[Placement]:
    """The ranks in order: grouped by node (nodes in order of first appearance), then by
    GPU id within a node, then as made. With ``by_node=False`` the given order stands."""
    places = [Placement(i, str(d["node_id"]), str(d["node"]), int(d["pid"]), tuple(d.get("gpus", ())))
              for i, d in enumerate(infos)]
    if not by_node:
        return places
    first: dict[str, int] = {}
    for p in places:
        first.setdefault(p.node_id, len(first))
    return sorted(places, key=lambda p: (first[p.node_id], _gpu_key(p.gpus), p.index))


def environments(places: Sequence[Placement], master_addr: str, master_port: int, token: str, *,
                 backend: str | None, loopback: bool, records_deaths: bool = True) -> list[dict[str, str | None]]:
    """Each rank's environment (rank order): what gpucoll-run gives a rank, with the store
    hosted by the driver, plus the node's address for the CPU backend's connections, the
    backend ``init_process_group()`` picks, whether deaths are recorded, and on GPU nodes
    ``CUDA_VISIBLE_DEVICES`` covering every GPU of the node's ranks (NCCL needs to see its
    peers' devices), each rank's own GPU being its ``LOCAL_RANK``-th there. With
    ``loopback`` (every rank on the driver's node) the CPU backend listens on loopback.
    ``records_deaths``: the driver watches the ranks and records their deaths (``run``;
    ``init_group`` cannot watch a user's actors, so its ranks do not wait for records)."""
    nodes: dict[str, list[Placement]] = {}
    for p in places:
        nodes.setdefault(p.node_id, []).append(p)
    node_rank = {nid: i for i, nid in enumerate(nodes)}
    out = []
    for rank, p in enumerate(places):
        peers = nodes[p.node_id]
        local = peers.index(p)
        env: dict[str, str | None] = dict(rank_environment(
            ClusterEnv(SOURCE, rank, len(places), local, len(peers), master_addr, master_port,
                       store_hosted=True, node_rank=node_rank[p.node_id]), token=token))
        env[CPU_IFADDR_ENV] = "" if loopback else p.node
        env[BACKEND_ENV] = backend or ""
        env[DEATH_RECORDS_ENV] = "1" if records_deaths else ""
        gpus = [g for q in peers for g in q.gpus]
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(sorted(dict.fromkeys(gpus), key=lambda g: (len(g), g)))
        out.append(env)
    return out
