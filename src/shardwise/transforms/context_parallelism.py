# context_parallel(): each rank of a group holds a slice of every sequence (Ulysses all-to-alls).
"""Context parallelism on the ``cp`` dimension of the pipeline's mesh."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import attrs

from shardwise._text import short
from shardwise.bundle import Bundle
from shardwise.distributed import ensure_process_group
from shardwise.env import Env
from shardwise.errors import ArgumentError, ConflictError
from shardwise.parallel.context_hooks import hook_attention
from shardwise.parallel.context_split import ContextSplit
from shardwise.parallel.mesh import with_dimension
from shardwise.plan import Plan
from shardwise.transforms._checks import group_size
from shardwise.transforms.base import Stage, Transform, plan_for

__all__ = ["ContextParallel", "context_parallel", "METHODS"]

Method = Literal["ulysses", "ring"]
METHODS = ("ulysses",)


def _method(instance: Any, attribute: Any, value: Any) -> None:
    if value == "ring":
        raise ArgumentError("context_parallel(method='ring') is not available: torch's context-"
                            "parallel attention splits CUDA's SDPA kernels only, and its flex "
                            "path has no backward on a CPU (docs/parallelism.md); use "
                            "method='ulysses', which runs any attention kernel, the CPU's "
                            "included")
    if value not in METHODS:
        raise ArgumentError(f"context_parallel() 'method' must be one of {METHODS} (got "
                            f"{short(value)})")


@attrs.frozen(repr=False)
class ContextParallel(Transform):
    """Split every sequence across the ranks of a context-parallel group (Ulysses).

    All ranks of a group read the same batch; each trains on its contiguous slice of every
    sequence, with the whole sequence's position ids and labels shifted before the cut. Around
    each attention an all-to-all turns the sequence slice into a slice of the heads over the
    whole sequence, the model's attention runs causally on it, and a second all-to-all turns it
    back (DeepSpeed-Ulysses). Activations shrink by the group's size. The loss is a sum over a
    slice's labelled tokens with their count, weighed by the step across the group, the
    accumulation window and the data ranks: parameters and metrics equal one process's.

    A Transformers model is hooked through its attention registry (``config._attn_implementation``);
    another model declares ``self.context_parallel = None`` on its attention modules and
    calls ``self.context_parallel.attend(q, k, v, attend)`` when it is set. Batches must be
    mappings with ``input_ids`` (or ``inputs_embeds``) and ``labels``, or a ``loss_fn`` that
    returns ``(loss_sum, num_tokens)``. In one process (or ``size=1``) it is a no-op.

    Args:
        size: ranks per group; default all ranks of one node.
        method: ``"ulysses"``.

    Raises:
        ConflictError: heads or sequence lengths the size does not divide, a padding mask other
            than right padding, a model whose attention cannot be reached.

    Example:
        >>> pipe = sw.pipeline(sw.context_parallel(size=2), sw.shard())  # dp_shard x cp
    """

    size: int | None = attrs.field(default=None, validator=group_size("the ranks of one node"))
    method: Method = attrs.field(default="ulysses", kw_only=True, validator=_method)
    stage: ClassVar[Stage] = Stage.TENSOR_PARALLEL
    factory_name: ClassVar[str] = "context_parallel"
    distributes: ClassVar[bool] = True

    def mesh_dims(self) -> dict[str, int | None]:
        return {"cp": self.size}

    def record(self, plan: Plan) -> Plan:
        return attrs.evolve(plan, context_parallel=self)

    def excludes(self) -> dict[str, str]:
        why = "is not combined with context_parallel yet"
        return {"deepspeed": f"DeepSpeed {why}; its own Ulysses is sp_size in the config",
                "local_sgd": "local_sgd skips the gradient reduction that sums the slices of a "
                             "sequence across the context-parallel group"}

    def __call__(self, bundle: Bundle) -> Bundle:
        bundle = self._record(bundle)
        env = bundle.env
        size = bundle.plan.size("cp")  # the pipeline's layout: this size is read, never worked out
        if not env.is_distributed or size == 1:
            return bundle
        if bundle.context is not None:
            raise ConflictError(f"{self!r}: the bundle splits sequences already")
        ensure_process_group(env)
        mesh = with_dimension(bundle.mesh, env, bundle.plan.mesh, "cp", size, repr(self))
        cp = mesh["cp"]
        split = ContextSplit(cp.get_group(), int(cp.get_local_rank()), size, self.method)
        # each rank's heads are 1/tp of them already
        hook_attention(bundle.model, split, bundle.plan.size("tp"))
        # under pipeline_parallel (applied first) the stages run the slices
        stages = attrs.evolve(bundle.stages, context=split) if bundle.stages is not None \
            else None
        return attrs.evolve(bundle, mesh=mesh, context=split, stages=stages)

    def describe(self, env: Env) -> str:
        return self.describe_in(env, plan_for(env, [self]))

    def describe_in(self, env: Env, plan: Plan) -> str:
        size = plan.size("cp")
        if not env.is_distributed or size == 1:
            return "one rank per group: whole sequences"
        return (f"Ulysses over the mesh's cp dimension ({size} ranks): each rank a 1/{size} "
                "slice of every sequence (position ids of the whole, labels shifted before the "
                "cut), an all-to-all to a slice of the heads around each attention; the loss "
                f"a token sum weighed across the group; the {size} ranks read the same batch")


#: the public factory: the class itself, so its defaults are written once
context_parallel = ContextParallel
