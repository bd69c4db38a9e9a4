"""Cluster detection: each environment faked as a dict, checked against what its launcher sets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpucoll import clusters
from gpucoll.clusters import ClusterEnv, detect, env, mpich, openmpi, slurm
from gpucoll.clusters.base import SCHEDULER_PORT_BASE, SCHEDULER_PORT_SPAN, scheduler_port


def test_detectors_are_a_literal_ordered_tuple() -> None:
    assert clusters.DETECTORS == (env.detect, openmpi.detect, mpich.detect, slurm.detect)


def test_nothing_detected_in_a_plain_environment() -> None:
    assert detect({"HOME": "/root", "PATH": "/usr/bin"}) is None


# -- gpucoll-run / torchrun ------------------------------------------------------------

GPUCOLL_RUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
               "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "41234",
               "GPUCOLL_STORE_HOSTED": "1", "GPUCOLL_STORE_TOKEN": "secret"}


def test_gpucoll_run_environment() -> None:
    assert detect(GPUCOLL_RUN) == ClusterEnv(
        source="gpucoll-run/torchrun", rank=3, world_size=8, local_rank=1, local_world_size=2,
        master_addr="10.0.0.1", master_port=41234, store_hosted=True, node_rank=1)


def test_kubernetes_operator_environment_has_no_local_variables() -> None:
    found = detect({"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"})
    assert found is not None
    assert (found.rank, found.local_rank, found.local_world_size, found.store_hosted) == (2, 0, 1, False)


def test_single_rank_needs_no_master() -> None:
    found = detect({"RANK": "0", "WORLD_SIZE": "1"})
    assert found is not None and (found.master_addr, found.master_port) == ("127.0.0.1", 0)


@pytest.mark.parametrize("environ, names", [
    ({"RANK": "0"}, "WORLD_SIZE"),
    ({"WORLD_SIZE": "2"}, "RANK"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "MASTER_ADDR"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "MASTER_PORT='70000'"),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2",
      "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "LOCAL_WORLD_SIZE"),
])
def test_torchrun_errors_name_the_variable(environ: dict[str, str], names: str) -> None:
    with pytest.raises(ValueError, match=names):
        detect(environ)


def test_explicit_variables_win_over_a_scheduler() -> None:
    # srun gpucoll-run ...: the launcher's RANK, not the srun task's SLURM_PROCID.
    found = detect({**SLURM, **GPUCOLL_RUN})
    assert found is not None and found.source == "gpucoll-run/torchrun" and found.rank == 3


# -- Slurm -----------------------------------------------------------------------------

SLURM = {"SLURM_JOB_ID": "73210", "SLURM_STEP_ID": "2", "SLURM_PROCID": "5", "SLURM_NTASKS": "99",
         "SLURM_STEP_NUM_TASKS": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "9",
         "SLURMD_NODENAME": "gpu03", "SLURM_STEP_NODELIST": "gpu[02-03,07]",
         "SLURM_JOB_NODELIST": "gpu[01-08]", "SLURM_STEP_TASKS_PER_NODE": "3,2(x2)"}


def test_slurm_step() -> None:
    found = detect(SLURM)
    # The step's variables win over the job's: 7 tasks, node index 1 of the step's
    # list (gpu03), 2 tasks there, master = first host of the step.
    assert found == ClusterEnv(source="slurm", rank=5, world_size=7, local_rank=1, local_world_size=2,
                               master_addr="gpu02",
                               master_port=SCHEDULER_PORT_BASE + (16 * 73210 + 2) % SCHEDULER_PORT_SPAN,
                               store_hosted=False, node_rank=1)


def test_slurm_port_is_the_same_on_every_task_and_differs_between_jobs_and_steps() -> None:
    ports = {detect({**SLURM, "SLURM_PROCID": str(r), "SLURM_LOCALID": "0"}).master_port  # type: ignore[union-attr]
             for r in range(7)}
    assert len(ports) == 1
    next_job = detect({**SLURM, "SLURM_JOB_ID": "73211"})
    next_step = detect({**SLURM, "SLURM_STEP_ID": "3"})
    assert next_job is not None and next_step is not None
    assert len(ports | {next_job.master_port, next_step.master_port}) == 3


def test_slurm_master_overrides() -> None:
    found = detect({**SLURM, "MASTER_ADDR": "ib-gpu02", "MASTER_PORT": "29500"})
    assert found is not None and (found.master_addr, found.master_port) == ("ib-gpu02", 29500)


def test_slurm_batch_script_is_not_a_launch() -> None:
    # sbatch's shell has SLURM_PROCID=0 and the allocation's SLURM_NTASKS but no step.
    batch = {k: v for k, v in SLURM.items() if not k.startswith("SLURM_STEP")}
    assert detect(batch) is None


def test_slurm_node_index_falls_back_to_nodeid() -> None:
    found = detect({**SLURM, "SLURMD_NODENAME": "elsewhere", "SLURM_NODEID": "2", "SLURM_PROCID": "6"})
    assert found is not None and (found.node_rank, found.local_world_size) == (2, 2)


@pytest.mark.parametrize("drop, names", [
    ("SLURM_LOCALID", "SLURM_LOCALID"),
    ("SLURM_JOB_ID", "MASTER_PORT"),
])
def test_slurm_errors_name_the_variable(drop: str, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        detect({k: v for k, v in SLURM.items() if k != drop})


def test_slurm_without_any_nodelist_asks_for_master_addr() -> None:
    environ = {k: v for k, v in SLURM.items() if "NODELIST" not in k}
    environ["SLURM_NODEID"] = "1"
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        detect(environ)


@pytest.mark.parametrize("nodelist, hosts", [
    ("node1", ["node1"]),
    ("node[01-03,07],other", ["node01", "node02", "node03", "node07", "other"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
    ("gpu[1,3]-ib", ["gpu1-ib", "gpu3-ib"]),
    ("x[5],y", ["x5", "y"]),
    ("host-1.example.org,host-2.example.org", ["host-1.example.org", "host-2.example.org"]),
])
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert slurm.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[1-3", "node1-3]", "node[3-1]", "node[a-b]", "n[[1]]", "a,,b", ""])
def test_expand_nodelist_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="host list"):
        slurm.expand_nodelist(bad)


def _compress(prefix: str, numbers: list[int], width: int) -> str:
    """Slurm's notation for prefix + numbers, written independently of the parser."""
    items = []
    run_start = prev = numbers[0]
    ends: list[int | None] = [*numbers[1:], None]
    for n in ends:
        if n is not None and n == prev + 1:
            prev = n
            continue
        items.append(f"{run_start:0{width}d}" if run_start == prev
                     else f"{run_start:0{width}d}-{prev:0{width}d}")
        if n is not None:
            run_start = prev = n
    return f"{prefix}[{','.join(items)}]"


@settings(max_examples=60, deadline=None)
@given(groups=st.lists(st.tuples(st.sampled_from(["n", "gpu", "rack1-node"]),
                                 st.sets(st.integers(0, 300), min_size=1, max_size=12),
                                 st.integers(1, 4)), min_size=1, max_size=4))
def test_expand_nodelist_inverts_compression(groups: list[tuple[str, set[int], int]]) -> None:
    text = ",".join(_compress(p, sorted(ns), w) for p, ns, w in groups)
    expected = [f"{p}{n:0{w}d}" for p, ns, w in groups for n in sorted(ns)]
    assert slurm.expand_nodelist(text) == expected


@pytest.mark.parametrize("value, counts", [
    ("4", [4]), ("2(x3)", [2, 2, 2]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2),5", [1, 3, 3, 5])])
def test_expand_tasks_per_node(value: str, counts: list[int]) -> None:
    assert slurm.expand_tasks_per_node(value) == counts


def test_expand_tasks_per_node_rejects() -> None:
    with pytest.raises(ValueError, match="SLURM_STEP_TASKS_PER_NODE"):
        slurm.expand_tasks_per_node("2(3)")


# -- Open MPI --------------------------------------------------------------------------

# As mpirun 4.1 sets them (recorded from `mpirun -n 2 env` on one host).
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1",
        "OMPI_MCA_ess_base_jobid": "1975844865", "PMIX_NAMESPACE": "1975844865",
        "OMPI_MCA_orte_hnp_uri": "1975844864.0;tcp://192.0.2.2:33179;tcp6://[fd00::2]:54033"}


def test_openmpi_one_node_uses_loopback() -> None:
    found = detect(OMPI)
    assert found == ClusterEnv(source="openmpi", rank=1, world_size=2, local_rank=1, local_world_size=2,
                               master_addr="127.0.0.1", master_port=scheduler_port("1975844865"))


def test_openmpi_across_nodes_uses_mpiruns_host() -> None:
    found = detect({**OMPI, "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3",
                    "OMPI_MCA_orte_hnp_uri": "77.0;tcp://10.1.2.3,172.17.0.1:4100;tcp6://[fd00::2]:5"})
    assert found is not None and found.master_addr == "10.1.2.3"


def test_openmpi5_across_nodes_needs_master_addr() -> None:
    environ = {k: v for k, v in OMPI.items() if k != "OMPI_MCA_orte_hnp_uri"}
    environ.update(OMPI_COMM_WORLD_SIZE="4")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        detect(environ)
    found = detect({**environ, "MASTER_ADDR": "node01"})
    assert found is not None and found.master_addr == "node01"


def test_openmpi_wins_over_the_slurm_step_of_its_daemons() -> None:
    # mpirun inside an allocation starts one daemon per node with srun; the ranks
    # inherit the daemons' SLURM_PROCID.
    found = detect({**SLURM, **OMPI})
    assert found is not None and found.source == "openmpi" and found.rank == 1


def test_openmpi_without_job_id_needs_master_port() -> None:
    environ = {k: v for k, v in OMPI.items()
               if k not in ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "OMPI_MCA_orte_hnp_uri")}
    with pytest.raises(ValueError, match="MASTER_PORT"):
        detect(environ)


# -- MPICH / PMI -----------------------------------------------------------------------

HYDRA = {"PMI_RANK": "2", "PMI_SIZE": "3", "PMI_FD": "6", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3"}


def test_hydra_one_node() -> None:
    found = detect({**HYDRA, "MASTER_PORT": "29511"})
    assert found == ClusterEnv(source="mpich/pmi", rank=2, world_size=3, local_rank=2, local_world_size=3,
                               master_addr="127.0.0.1", master_port=29511)


def test_hydra_has_no_job_id_so_master_port_is_required() -> None:
    with pytest.raises(ValueError, match="MASTER_PORT"):
        detect(HYDRA)


def test_hydra_across_nodes_needs_master_addr() -> None:
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        detect({**HYDRA, "MPI_LOCALNRANKS": "1", "MPI_LOCALRANKID": "0", "MASTER_PORT": "1"})


def test_cray_pals_local_variables_and_job_id() -> None:
    found = detect({"PMI_RANK": "0", "PMI_SIZE": "2", "PMI_LOCAL_RANK": "0", "PMI_LOCAL_SIZE": "2",
                    "PALS_APID": "8c2ed5d4-1f0b-4b63-a8f2-3c3d5e0c1f10"})
    assert found is not None and found.master_port == scheduler_port("8c2ed5d4-1f0b-4b63-a8f2-3c3d5e0c1f10")


def test_pmi_without_local_rank_names_the_variable() -> None:
    with pytest.raises(ValueError, match="MPI_LOCALRANKID"):
        detect({"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_PORT": "1"})


def test_srun_pmi2_direct_launch_is_read_as_slurm() -> None:
    environ = {**SLURM, "PMI_RANK": "5", "PMI_SIZE": "7", "PMI_JOBID": "73210.2"}
    found = detect(environ)
    assert found is not None and found.source == "slurm" and found.master_addr == "gpu02"


def test_hydra_inside_a_slurm_allocation_is_read_as_pmi() -> None:
    # Hydra's proxies run as one srun task per node: SLURM_PROCID is the proxy's.
    environ = {**SLURM, "SLURM_PROCID": "0", **HYDRA, "MASTER_PORT": "29512"}
    found = detect(environ)
    assert found is not None and found.source == "mpich/pmi" and found.rank == 2


# -- the derived port ------------------------------------------------------------------

@given(st.text(min_size=1, max_size=40))
def test_scheduler_port_is_in_its_range(key: str) -> None:
    if key.strip():
        assert SCHEDULER_PORT_BASE <= scheduler_port(key) < SCHEDULER_PORT_BASE + SCHEDULER_PORT_SPAN


def test_scheduler_port_of_consecutive_job_ids_differs() -> None:
    assert len({scheduler_port(str(j)) for j in range(1000, 1000 + SCHEDULER_PORT_SPAN)}) == SCHEDULER_PORT_SPAN


def test_cluster_env_rejects_inconsistent_values() -> None:
    with pytest.raises(ValueError, match="rank"):
        ClusterEnv("x", rank=2, world_size=2, local_rank=0, local_world_size=1, master_addr="h", master_port=1)
    with pytest.raises(ValueError, match="master_port"):
        ClusterEnv("x", rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="h",
                   master_port=70000)


def test_empty_torchrun_variables_count_as_unset() -> None:
    assert detect({"RANK": "", "WORLD_SIZE": " "}) is None


# -- the rank-environment contract: rank_environment() is detect()'s inverse ---------------

_PLACES = [
    ClusterEnv(env.SOURCE, 0, 1, 0, 1, "127.0.0.1", 0),
    ClusterEnv(env.SOURCE, 5, 8, 1, 4, "node7.cluster", 29500, store_hosted=True, node_rank=1),
    ClusterEnv(env.SOURCE, 2, 3, 2, 3, "::1", 65535, store_hosted=False, node_rank=0),
]


@pytest.mark.parametrize("place", _PLACES, ids=lambda c: f"r{c.rank}of{c.world_size}")
def test_rank_environment_round_trips_through_detect(place: ClusterEnv) -> None:
    built = env.rank_environment(place, token="s3cret")
    assert env.detect(built) == place
    assert clusters.detect(built) == place  # and the env detector is the one that answers
    assert built[clusters.STORE_TOKEN_ENV] == "s3cret"
    assert set(built) == {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                          "MASTER_PORT", clusters.STORE_HOSTED_ENV, clusters.STORE_TOKEN_ENV}


def test_rank_environment_overrides_an_inherited_hosted_flag_and_omits_a_missing_token() -> None:
    place = ClusterEnv(env.SOURCE, 0, 2, 0, 2, "10.0.0.1", 1234, store_hosted=False)
    inherited = {clusters.STORE_HOSTED_ENV: "1", "SLURM_PROCID": "3"}
    built = env.rank_environment(place)
    assert clusters.STORE_TOKEN_ENV not in built
    assert clusters.detect({**inherited, **built}) == place


@given(st.data())
def test_rank_environment_round_trips_for_any_place(data: st.DataObject) -> None:
    world = data.draw(st.integers(1, 4096))
    local_world = data.draw(st.integers(1, min(world, 64)))
    place = ClusterEnv(env.SOURCE, data.draw(st.integers(0, world - 1)), world,
                       data.draw(st.integers(0, local_world - 1)), local_world,
                       data.draw(st.sampled_from(["127.0.0.1", "node-3", "fe80::1", "a.b.c"])),
                       data.draw(st.integers(1 if world > 1 else 0, 65535)),
                       store_hosted=data.draw(st.booleans()), node_rank=data.draw(st.integers(0, 1000)))
    assert env.detect(env.rank_environment(place)) == place
