"""Slurm: processes started by ``srun``.

=========================  ====================================================
SLURM_PROCID               rank; with SLURM_STEP_ID it selects this detector
SLURM_STEP_NUM_TASKS       world size (falls back to SLURM_NTASKS)
SLURM_LOCALID              local rank
SLURM_STEP_TASKS_PER_NODE  "2(x3),1": local world size of each node of the step
SLURM_STEP_NODELIST        "node[01-03,07]": the first host is the master
SLURMD_NODENAME            this node, to find its index in the node list
SLURM_JOB_ID               the master port is derived from it (and SLURM_STEP_ID)
MASTER_ADDR, MASTER_PORT   override the derived master address and port
=========================  ====================================================

A batch script or ``salloc`` shell also carries SLURM_PROCID and SLURM_NTASKS,
but it is one process, not a task of a step: without SLURM_STEP_ID the
environment is not treated as a Slurm launch.

Rank 0 runs on the first node of the step under Slurm's block and cyclic
distributions; with ``--distribution=arbitrary`` or a node name that does not
resolve, set MASTER_ADDR.
"""

from __future__ import annotations

import re
from typing import Mapping

from .base import ClusterEnv, read_int, read_master_port, scheduler_port

__all__ = ["detect", "expand_nodelist", "expand_tasks_per_node", "slurm_port", "SOURCE"]

SOURCE = "slurm"

_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def detect(environ: Mapping[str, str]) -> ClusterEnv | None:
    """Read the environment of a task started by ``srun``.

    Args:
        environ: the environment mapping.

    Returns:
        A ClusterEnv, or None when SLURM_PROCID or SLURM_STEP_ID is unset.

    Raises:
        ValueError: a variable is missing or malformed; the message names it.

    Example:
        >>> env = detect({"SLURM_PROCID": "5", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8",
        ...               "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "gpu[01-04]",
        ...               "SLURM_STEP_TASKS_PER_NODE": "2(x4)", "SLURMD_NODENAME": "gpu03",
        ...               "SLURM_JOB_ID": "4242"})
        >>> env.master_addr, env.node_rank, env.local_world_size
        ('gpu01', 2, 2)
    """
    if "SLURM_PROCID" not in environ or "SLURM_STEP_ID" not in environ:
        return None
    rank = read_int(environ, "SLURM_PROCID", source=SOURCE)
    ntasks_var = "SLURM_STEP_NUM_TASKS" if environ.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    world_size = read_int(environ, ntasks_var, minimum=1, source=SOURCE)
    local_rank = read_int(environ, "SLURM_LOCALID", source=SOURCE)

    nodelist_var = next((v for v in _NODELIST_VARS if environ.get(v, "").strip()), None)
    hosts = expand_nodelist(environ[nodelist_var]) if nodelist_var else []
    nodename = environ.get("SLURMD_NODENAME", "")
    if nodename in hosts:
        node_rank = hosts.index(nodename)
    else:
        node_rank = read_int(environ, "SLURM_NODEID", default=0, source=SOURCE)

    per_node_raw = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if per_node_raw:
        per_node = expand_tasks_per_node(per_node_raw)
        if node_rank >= len(per_node):
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={per_node_raw!r} lists {len(per_node)} nodes but "
                             f"this is node {node_rank} ({SOURCE})")
        local_world_size = per_node[node_rank]
    elif len(hosts) == 1:
        local_world_size = world_size
    else:
        raise ValueError("cannot tell how many tasks run on this node (slurm): "
                         "set SLURM_STEP_TASKS_PER_NODE (srun sets it) or launch with srun")

    master_addr = environ.get("MASTER_ADDR", "").strip()
    if not master_addr:
        if not hosts:
            raise ValueError("cannot derive the master address (slurm): SLURM_STEP_NODELIST is not set; "
                             "set MASTER_ADDR to the host of rank 0")
        master_addr = hosts[0]
    master_port = read_master_port(environ, source=SOURCE)
    if master_port is None:
        master_port = slurm_port(environ)
    return ClusterEnv(
        source=SOURCE,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        master_addr=master_addr,
        master_port=master_port,
        store_hosted=False,
        node_rank=node_rank,
    )


def slurm_port(environ: Mapping[str, str]) -> int:
    """The master port every task of a step derives from SLURM_JOB_ID and SLURM_STEP_ID.

    ``61440 + (16 * job_id + step_id % 16) % 4096``: up to 16 concurrent steps of one
    job, and 256 jobs submitted one after another, get distinct ports.

    Raises:
        ValueError: SLURM_JOB_ID is unset or not an integer (the message says to set
            MASTER_PORT instead).
    """
    if not environ.get("SLURM_JOB_ID", "").strip():
        raise ValueError("cannot derive the master port (slurm): SLURM_JOB_ID is not set; set MASTER_PORT")
    job = read_int(environ, "SLURM_JOB_ID", source=SOURCE)
    step_raw = environ.get("SLURM_STEP_ID", "0").strip()
    # Special steps ("batch", "extern", or their large numeric ids) never run ranks
    # next to numbered steps, so folding them onto step 0 cannot collide.
    step = int(step_raw) % 16 if step_raw.isascii() and step_raw.isdigit() else 0
    return scheduler_port(str(16 * job + step))


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list, e.g. ``"node[01-03,07],other"``.

    Zero padding follows the lower bound of each range (``[08-10]`` gives 08, 09, 10);
    several bracket groups in one name give their product (``r[1-2]n[1-2]`` gives
    r1n1, r1n2, r2n1, r2n2), as ``scontrol show hostnames`` does.

    Args:
        nodelist: the value of SLURM_STEP_NODELIST or SLURM_JOB_NODELIST.

    Returns:
        The host names, in order.

    Raises:
        ValueError: unbalanced brackets, an empty name, or a range that is not
            ``a`` or ``a-b`` with ``a <= b``.
    """
    hosts: list[str] = []
    for expr in _split_top_level(nodelist):
        hosts.extend(_expand_one(expr, nodelist))
    return hosts


def expand_tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's tasks-per-node notation: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Raises:
        ValueError: an item is not ``n`` or ``n(xk)``.
    """
    counts: list[int] = []
    for item in value.split(","):
        m = _TASKS.fullmatch(item.strip())
        if m is None:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={value!r}: cannot parse {item!r}; "
                             "expected items like '4' or '2(x3)'")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def _split_top_level(nodelist: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"host list {nodelist!r}: nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"host list {nodelist!r}: ']' without '[' at position {i}")
        elif ch == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"host list {nodelist!r}: '[' is never closed")
    parts.append(nodelist[start:])
    for part in parts:
        if not part.strip():
            raise ValueError(f"host list {nodelist!r} has an empty host name")
    return [p.strip() for p in parts]


def _expand_one(expr: str, whole: str) -> list[str]:
    open_at = expr.find("[")
    if open_at < 0:
        return [expr]
    close_at = expr.index("]", open_at)
    prefix, body, rest = expr[:open_at], expr[open_at + 1:close_at], expr[close_at + 1:]
    suffixes = _expand_one(rest, whole) if rest else [""]
    names: list[str] = []
    for item in body.split(","):
        m = _RANGE.fullmatch(item.strip())
        if m is None:
            raise ValueError(f"host list {whole!r}: bad range {item!r} in [{body}]; expected 'a' or 'a-b'")
        lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_text), int(hi_text)
        if lo > hi:
            raise ValueError(f"host list {whole!r}: range {item!r} runs backwards")
        width = len(lo_text)
        for n in range(lo, hi + 1):
            names.extend(f"{prefix}{n:0{width}d}{s}" for s in suffixes)
    return names
