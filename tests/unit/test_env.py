# detect() on faked torchrun, SLURM, OpenMPI and bare environments, and its errors.
import datetime

import pytest
import torch

import shardwise as sw
from shardwise.env import first_host
from shardwise.errors import EnvError

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29511", "TORCHELASTIC_RUN_ID": "abc"}
SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
         "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_ID": "0",
         "SLURM_JOB_NODELIST": "gpu[07-09,12],cpu1", "SLURM_JOB_ID": "4242"}
MPI = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
       "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}


def test_bare_process_is_one_rank_on_cpu():
    env = sw.detect(environ={})
    assert (env.world_size, env.rank, env.launcher) == (1, 0, "none")
    assert env.device == torch.device("cpu") and env.backend == "gloo"
    assert env.precisions == ("fp32", "bf16")
    assert env.timeout == datetime.timedelta(minutes=30)
    assert env.is_main and not env.is_distributed
    assert env.device_memory_bytes is not None and env.device_memory_bytes > 2**30


def test_torchrun_variables():
    env = sw.detect(environ=TORCHRUN)
    assert (env.world_size, env.rank, env.local_rank, env.local_world_size) == (8, 5, 1, 4)
    assert (env.node_rank, env.num_nodes) == (1, 2)
    assert (env.master_addr, env.master_port, env.launcher) == ("10.0.0.1", 29511, "torchrun")
    assert env.is_distributed and not env.is_main


def test_rank_variables_without_torchrun_agent_are_generic_env():
    env = sw.detect(environ={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"})
    assert env.launcher == "env" and env.local_world_size == 2 and env.num_nodes == 1


def test_slurm_variables():
    env = sw.detect(environ=SLURM)
    assert (env.world_size, env.rank, env.local_rank, env.local_world_size) == (4, 3, 1, 2)
    assert (env.node_rank, env.num_nodes, env.launcher) == (1, 2, "slurm")
    assert env.master_addr == "gpu07"
    assert env.master_port == 15000 + 4242


def test_an_sbatch_script_without_srun_is_one_process():
    batch_step = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    batch_step["SLURM_PROCID"] = "0"
    env = sw.detect(environ=batch_step)
    assert (env.world_size, env.launcher) == (1, "none")


def test_slurm_uneven_tasks_per_node():
    uneven = {**SLURM, "SLURM_NTASKS": "5", "SLURM_TASKS_PER_NODE": "3,2",
              "SLURM_PROCID": "2", "SLURM_LOCALID": "2", "SLURM_NODEID": "0"}
    env = sw.detect(environ=uneven)
    assert (env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (5, 2, 3, 0)
    on_second = sw.detect(environ={**uneven, "SLURM_PROCID": "4", "SLURM_LOCALID": "1",
                                   "SLURM_NODEID": "1"})
    assert on_second.local_world_size == 2


@pytest.mark.parametrize("spec, counts", [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("3,2", [3, 2])])
def test_expand_slurm_task_counts(spec, counts):
    from shardwise.env import expand_task_counts
    assert expand_task_counts(spec) == counts


def test_torchrun_wins_over_slurm():
    env = sw.detect(environ={**SLURM, **TORCHRUN})
    assert env.launcher == "torchrun" and env.world_size == 8


def test_openmpi_variables():
    env = sw.detect(environ=MPI)
    assert (env.world_size, env.rank, env.local_rank, env.local_world_size) == (4, 2, 0, 2)
    assert (env.node_rank, env.num_nodes, env.launcher) == (1, 2, "mpi")
    assert env.master_addr is None  # two nodes: MASTER_ADDR must be given
    assert sw.detect(environ={**MPI, "MASTER_ADDR": "h1"}).master_addr == "h1"


def test_config_path_is_read_from_the_documented_variable():
    assert sw.detect(environ={sw.CONFIG_ENV_VAR: "/tmp/c.yaml"}).config_path == "/tmp/c.yaml"


@pytest.mark.parametrize("nodelist, host", [
    ("node1", "node1"), ("gpu[07-09,12],cpu1", "gpu07"), ("a[3]", "a3"), ("x-1,x-2", "x-1")])
def test_first_host_of_slurm_nodelist(nodelist, host):
    assert first_host(nodelist) == host


def test_overrides_and_timeout():
    env = sw.detect(environ={}, timeout=90, world_size=4, rank=3)
    assert env.timeout == datetime.timedelta(seconds=90)
    assert (env.world_size, env.rank) == (4, 3)
    env = sw.detect(environ={}, device="meta")
    assert env.device == torch.device("meta")


@pytest.mark.parametrize("environ, overrides, message", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, {}, "not LOCAL_RANK"),
    ({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, {}, "RANK must be an integer >= 0 (got 'x')"),
    ({"RANK": "0", "WORLD_SIZE": "0", "LOCAL_RANK": "0"}, {}, "WORLD_SIZE must be an integer >= 1"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, {}, "'rank' must be an integer in [0, 2) (got 2)"),
    ({}, {"timeout": -1}, "'timeout' must be a finite number of seconds in [0.001, "),
    ({}, {"timeout": "soon"}, "'timeout' must be a datetime.timedelta or seconds (got 'soon')"),
    ({}, {"world": 2}, "unknown override(s) ['world']"),
    ({}, {"precisions": ("fp8",)}, "'precisions' must be a tuple of"),
])
def test_bad_environment_is_named(environ, overrides, message):
    with pytest.raises(EnvError) as info:
        sw.detect(environ=environ, **overrides)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_reading_changes_nothing():
    import torch.distributed as dist
    sw.detect(environ=TORCHRUN)
    assert not dist.is_initialized()
