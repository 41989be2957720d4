# explain(): a pipeline in words, stage by stage, and where shardwise departs from Accelerate and torchtitan.
"""The prose of :meth:`shardwise.Pipeline.explain`: each stage with its settings and why a
default was chosen, the mesh, and the places where shardwise deliberately differs from
Accelerate, the Trainer or torchtitan (said here, so a user never meets the difference
silently)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from shardwise.env import Env
from shardwise.memory import SAFE_FRACTION
from shardwise.parallel.mesh import MeshLayout
from shardwise.transforms.base import Transform, plan_for

__all__ = ["describe"]


def describe(env: Env, steps: list[tuple[Transform, str | None]], *, choose_distribution: bool,
             on_nonfinite: str, notes: Iterable[str], fit_options: Mapping[str, Any]) -> str:
    """The pipeline of ``steps`` (each transform and why it is there) on ``env``, in words."""
    transforms = [t for t, _ in steps]
    plan = plan_for(env, transforms)  # its layout: what every line below reads
    lines = [f"shardwise pipeline: {env.world_size} process(es) ({env.launcher}), "
             f"rank {env.rank}, device {env.device}, backend {env.backend}"]
    for i, (t, reason) in enumerate(steps, 1):
        why = f"  [{reason}]" if reason else ""
        lines.append(f"  {i}. {t.stage.name.lower():<15} {t!r}{why}")
        lines.append(f"     {'':<15} -> {t.describe_in(env, plan)}")
    lines += _mesh_lines(env, plan.mesh)
    if choose_distribution:
        lines.append(f"  distribution: chosen per model when called ({env.world_size} "
                     "processes, none given): replicate if it fits in "
                     f"{SAFE_FRACTION:.0%} of device memory, else shard, else shard + "
                     "checkpoint_activations, else also offload; explain(model) shows it")
    lines.append(f"  non-finite loss/gradient in fp32/bf16: {on_nonfinite}")
    if on_nonfinite == "raise":
        lines.append("    torch's Adam/AdamW/momentum-free SGD run their fused kernel where "
                     "you chose no implementation: a non-finite step is skipped on the "
                     "device and raised by the next step(), an epoch's last step, sw.save, "
                     "sw.fit or bundle.check(state); no host sync per step (other "
                     "optimizers read the flag at each optimizer step; explain(model, "
                     "optimizer) says which)")
    # where shardwise deliberately differs from Accelerate, explain() says so
    lines.append("  scheduler: steps once per optimizer step (an Accelerate-prepared one "
                 "steps once per process per optimizer step)")
    lines.append("  evaluation: bundle.predict runs at the training precision; a bare "
                 "model(...) call outside step()/predict() runs without autocast")
    lines += [f"  notice: {note}" for note in notes]
    if fit_options:
        shown = ", ".join(f"{k}={v!r}" for k, v in fit_options.items())
        lines.append(f"  sw.fit(bundle, **pipe.fit_options): {shown}")
    return "\n".join(lines)


def _mesh_lines(env: Env, mesh: MeshLayout | None) -> list[str]:
    """The mesh, its dimensions and why, when the pipeline has more than one."""
    if mesh is None or mesh.copies == 1:  # data dimensions alone: said by shard()
        return []
    data = mesh.data_ranks(env.world_size)
    inner = " x ".join(name for name, _ in mesh.dims if name in ("pp", "cp", "tp"))
    lines = [f"  mesh: {mesh.describe()} over {env.world_size} ranks; {inner} innermost: the "
             f"{mesh.copies} ranks of a {inner} block are consecutive (on one node), as their "
             "collectives run in every layer, and read the same batch; data split over "
             f"{' x '.join(mesh.data_names)} ({data} share(s) of each global batch, rank r "
             f"reads share r // {mesh.copies}); sw.reduce(x, 'sum') counts each block's value "
             f"{mesh.copies} times, once with the loader (sw.reduce(x, 'sum', loader))"]
    # where shardwise deliberately differs from torchtitan and Accelerate, it says so
    if mesh.tp > 1:
        lines.append(
            "  tensor parallel: parameters outside the plan (norms) stay whole on every rank "
            "as replicated DTensors, with no sequence or loss parallelism (torchtitan splits "
            "them): activations around them are whole and results equal one process's; the "
            "plan is applied to the model you pass (Accelerate has Transformers apply it in "
            "from_pretrained); every rank starts from rank 0's weights" +
            (" (each stage from the first rank holding it)" if mesh.pp > 1 else ""))
    if mesh.cp > 1:
        lines.append(
            "  context parallel: labels are shifted before the sequence is cut (done for "
            "you; Accelerate leaves it to the script), attention runs causally over whole "
            "sequences (right padding only), and the loss is the token sum over the "
            "accumulation window and all ranks divided by its labelled tokens (as "
            "Transformers' Trainer weighs tokens; a step without context_parallel averages "
            "each micro-batch's own mean); gradients are reduced over the cp ranks with the "
            "data ranks; bundle.predict returns whole-sequence outputs on every rank and "
            "sw.gather_for_metrics keeps each block's once")
    return lines
