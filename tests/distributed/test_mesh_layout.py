# The mesh layout is one value: explain(), the memory estimate and the real ranks read the same sizes.
# Its tests that start no process are in tests/unit/test_parallel_plans.py.
import pytest
import torch

import shardwise as sw
from shardwise.testing import run_distributed

from _parallel import heads8

transformers = pytest.importorskip("transformers")


def on_eight_fake_ranks():
    """The pipelines above applied on rank 0 of an 8-rank fake process group (torch's own:
    collectives return at once), as the real ranks would apply them."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    env = sw.Env(world_size=8, local_world_size=8, rank=0, backend="fake")
    try:
        model = heads8()
        cp = sw.pipeline(env, sw.context_parallel(), sw.tensor_parallel(size=2), sw.shard())(
            model, torch.optim.AdamW(model.parameters()))
        model = heads8()
        pp = sw.pipeline(env, sw.pipeline_parallel(), sw.tensor_parallel(size=2))(
            model, torch.optim.AdamW(model.parameters()))
        return {"cp_mesh": cp.mesh.mesh_dim_names, "cp_shape": tuple(cp.mesh.shape),
                "cp_split": cp.context.size, "cp_layout": cp.plan.mesh.describe(),
                "pp_shape": tuple(pp.mesh.shape), "pp_stages": (pp.stages.size, pp.stages.total),
                "pp_microbatches": pp.stages.microbatches}
    finally:
        dist.destroy_process_group()


def test_the_real_ranks_run_the_sizes_explain_gives():
    """On 8 ranks (a fake process group): context_parallel() splits each sequence over the
    mesh's 4 cp ranks (it asked for cp=8 on a cp=4 mesh), pipeline_parallel() cuts 4 stages
    over 4 pp ranks."""
    [got] = run_distributed(on_eight_fake_ranks, world_size=1)
    assert got["cp_mesh"] == ("dp_shard", "cp", "tp") and got["cp_shape"] == (1, 4, 2)
    assert got["cp_split"] == 4 and got["cp_layout"] == "dp_shard=1 x cp=4 x tp=2"
    assert got["pp_shape"] == (1, 4, 2) and got["pp_stages"] == (4, 4)
    assert got["pp_microbatches"] == 4
