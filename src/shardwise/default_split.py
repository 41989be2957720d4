# The default distribution beside a split model: shard() over the ranks that hold each part.
"""When ``pipeline_parallel`` or ``tensor_parallel`` splits the model, the distribution is
not a memory question (DDP runs neither): the rule lives here, beside ``choice.py`` (which
chooses from the memory estimate when nothing splits the model)."""

from __future__ import annotations

from collections.abc import Sequence

from shardwise.env import Env
from shardwise.transforms.base import Transform, plan_for

__all__ = ["split_default"]


def split_default(env: Env, transforms: Sequence[Transform]) -> tuple[list[Transform], str] | None:
    """The default distribution when ``pipeline_parallel`` or ``tensor_parallel`` splits the
    model (DDP runs neither a pipeline's stages nor DTensor layers): ``shard()`` over the
    ranks that hold the same part (data and context-parallel ranks, whose gradients are
    reduced together), or nothing when one ``pp x tp`` block spans the world; with the
    reason. None without either (the memory estimate chooses then). The one place this is
    decided: the default choice and the memory estimate ask it."""
    splitting = [t for t in transforms if {"pp", "tp"} & set(t.mesh_dims())]
    if not splitting or not env.is_distributed:
        return None
    from shardwise.transforms.sharding import shard

    plan = plan_for(env, transforms)
    assert plan.mesh is not None  # several processes, a dimension declared
    block, holders = plan.size("pp") * plan.size("tp"), plan.mesh.holders
    names = " x ".join(type(t).factory_name for t in splitting)
    reason = (f"default: {names} groups of {block} ranks leave {holders} rank(s) holding each "
              "part")
    if holders == 1:
        return [], reason
    reason += "; DDP runs neither pipeline stages nor DTensor layers, so shard()"
    staged = plan.pipeline_parallel
    chosen = staged.data_shard() if staged is not None else shard()
    if not chosen.reshard_after_forward:
        reason += (", its parameters kept gathered through the step: the zero-bubble "
                   "schedule's weight gradients come after later forwards")
    return [chosen], reason
