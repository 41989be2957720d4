# pipeline_parallel(): each rank holds the layers of its stages; torch's schedules run microbatches.
"""Pipeline parallelism on the ``pp`` dimension of the pipeline's mesh."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
from torch import nn

from shardwise._params import refuse_state, unwrap
from shardwise._text import short
from shardwise.bundle import Bundle
from shardwise.distributed import ensure_process_group
from shardwise.env import Env
from shardwise.errors import ArgumentError, ConflictError
from shardwise.meta_init import is_rank0_weights
from shardwise.parallel.mesh import with_dimension
from shardwise.parallel.pp_schedule import (
    SCHEDULES,
    PipelineRun,
    Schedule,
    schedule_of,
    v_shaped_names,
)
from shardwise.parallel.pp_stages import (
    StageSplit,
    check_views,
    decoder_parts,
    prune,
    split_of,
    stage_modules,
)
from shardwise.plan import Plan
from shardwise.transforms.base import Stage, Transform, plan_for

__all__ = ["PipelineParallel", "pipeline_parallel"]


def _positive(name: str, upper: int) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 1 <= value <= upper):
            raise ArgumentError(f"pipeline_parallel() '{name}' must be None or an integer in "
                                f"[1, {upper}] (got {short(value)})")
    return check


def _schedule(instance: Any, attribute: Any, value: Any) -> None:
    if value not in SCHEDULES:
        raise ArgumentError(f"pipeline_parallel() 'schedule' must be one of {', '.join(SCHEDULES)} "
                            f"(got {short(value)})")


def _split(instance: Any, attribute: Any, value: Any) -> None:
    if value == "auto":
        return
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or \
            not all(isinstance(name, str) for name in value):
        raise ArgumentError(f"pipeline_parallel() 'split' must be 'auto' or a list of the layer "
                            f"names where stages 1, 2, ... begin (got {short(value)})")


def _loss(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and not callable(value):
        raise ArgumentError(f"pipeline_parallel() 'loss' must be None or a callable (output, "
                            f"target) -> loss (got {short(value)})")


@attrs.frozen(repr=False)
class PipelineParallel(Transform):
    """Cut the model into stages at layer boundaries, one (or a few) per rank of a pipeline
    group, and train with one of torch's pipeline schedules (``torch.distributed.pipelining``).

    Every rank of a group reads the same batch; each batch is cut into ``microbatches`` that
    flow through the stages (the first stage runs the inputs, the last computes the loss from
    the labels, shifted before the cut as a causal LM shifts them). The loss is a sum over
    labelled tokens with their count, so parameters equal one process's on the same batches
    (the step weighs tokens across microbatches, the accumulation window and data ranks);
    clipping takes one norm over all stages, and a non-finite value on any stage skips or
    stops the step on all of them. Each rank holds and saves only its stages' parameters,
    under the model's own names: a checkpoint loads at any other layout. With more ranks
    than ``size`` the rest are data parallel: ``shard()`` (the default) shards each stage
    over them, on a ``dp_shard x pp`` mesh.

    A Transformers decoder (``embed_tokens``, ``layers``, ``norm``, ``lm_head``) runs its own
    forward per stage; the stages are checked, once, to compose to the whole model's logits.
    An ``nn.Sequential`` is cut between its children (batches ``(inputs, target)``, and
    ``loss(output, target)`` returning the microbatch's mean or ``(loss_sum, num_items)``).
    In one process (or ``size=1``) it is a no-op.

    Args:
        size: ranks per pipeline group; default all ranks of one node.
        schedule: one of :data:`shardwise.parallel.pp_schedule.SCHEDULES` ("GPipe", "1F1B",
            "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
            "DualPipeV").
        microbatches: microbatches per batch; default the number of stages. A decoder batch
            they do not divide is padded with unlabelled repeats (no loss, no gradient); an
            ``nn.Sequential``'s must divide.
        split: ``"auto"`` (stages balanced by parameter count) or the names of the layers
            where stages 1, 2, ... begin (``["model.layers.2"]``).
        stages_per_rank: stages each rank holds under a multi-stage schedule (default 2;
            the V-shaped ones take exactly 2); 1 for GPipe and 1F1B.
        loss: for an ``nn.Sequential``, ``loss(output, target)``.

    Raises:
        ConflictError: a model that cannot be cut, more stages than layers, an
            ``nn.Sequential`` batch its microbatches do not divide, tied embeddings on
            different ranks.

    Example:
        >>> pipe = sw.pipeline(sw.pipeline_parallel(size=2, schedule="Interleaved1F1B"))
    """

    splits_weights = True

    size: int | None = attrs.field(default=None, validator=_positive("size", 2**16))
    schedule: str = attrs.field(default="1F1B", kw_only=True, validator=_schedule)
    microbatches: int | None = attrs.field(default=None, kw_only=True,
                                           validator=_positive("microbatches", 2**20))
    split: str | Sequence[str] = attrs.field(
        default="auto", kw_only=True, validator=_split,
        converter=lambda v: v if isinstance(v, str) or not isinstance(v, Sequence) else tuple(v))
    stages_per_rank: int | None = attrs.field(default=None, kw_only=True,
                                              validator=_positive("stages_per_rank", 64))
    loss: Callable[[Any, Any], Any] | None = attrs.field(default=None, kw_only=True,
                                                         validator=_loss)
    stage: ClassVar[Stage] = Stage.PIPELINE_PARALLEL
    factory_name: ClassVar[str] = "pipeline_parallel"
    distributes: ClassVar[bool] = True

    def __attrs_post_init__(self) -> None:
        self.kind  # noqa: B018  (a count the schedule cannot hold is refused here)

    @property
    def kind(self) -> Schedule:
        """The schedule, resolved once into its record (torch class, stages per rank, shape)."""
        return schedule_of(self.schedule, self.stages_per_rank)

    def mesh_dims(self) -> dict[str, int | None]:
        return {"pp": self.size}

    @property
    def per_rank(self) -> int:
        """Stages each rank holds."""
        return self.kind.per_rank

    def microbatch_count(self, plan: Plan) -> int:
        """Microbatches per batch: as given, or the pipeline's number of stages (``plan``'s
        layout gives the ranks)."""
        return self.microbatches or plan.size("pp") * self.per_rank

    def record(self, plan: Plan) -> Plan:
        return attrs.evolve(plan, pipeline_parallel=self)

    def excludes(self) -> dict[str, str]:
        why = "is not combined with pipeline_parallel yet"
        return {"replicate": "replicate() wraps the whole model in DDP, whose forward the "
                             "stages do not call; use shard() for the data ranks (FSDP2 on "
                             "each stage)",
                **{name: f"{name}() {why}" for name in (
                    "shard_optimizer", "deepspeed", "local_sgd", "offload")}}

    def _check_schedule(self, size: int, microbatches: int) -> None:
        """Build torch's schedule on stand-in stages (nothing runs), so that its own rules on
        the microbatch count are met before the model is cut.

        Raises:
            ConflictError: torch's schedule refuses this count, with its reason.
        """
        try:
            self.kind.order(size, microbatches)
        except ValueError as exc:
            raise ConflictError(f"{self!r}: torch's {self.schedule} schedule refuses "
                                f"{microbatches} microbatches for {size * self.per_rank} stages on "
                                f"{size} ranks ({exc}); choose another microbatches=") from None

    def data_shard(self) -> Transform:
        """The ``shard()`` its data ranks take by default: under a zero-bubble schedule with
        the parameters kept gathered through the step (:meth:`conflicts_with` says why)."""
        from shardwise.transforms.sharding import shard

        return shard(reshard_after_forward=not self.kind.zero_bubble)

    def conflicts_with(self, other: Transform) -> str | None:
        from shardwise.transforms.sharding import Shard

        if self.kind.zero_bubble and isinstance(other, Shard) \
                and other.reshard_after_forward:
            return (f"the zero-bubble schedule {self.schedule!r} computes weight gradients after "
                    "later microbatches' forwards, which reshard the stage's parameters under "
                    "reshard_after_forward=True (measured: gradients of the middle stages 0.2-0.4x "
                    "one process's); use shard(reshard_after_forward=False), the default chosen "
                    "beside it, which keeps them gathered for the step")
        return None

    def split_for(self, model: nn.Module, plan: Plan) -> StageSplit:
        """Where ``model`` is cut under ``plan``'s layout (for ``explain`` and the memory
        estimate)."""
        return split_of(unwrap(model), plan.size("pp") * self.per_rank, self.split)

    def __call__(self, bundle: Bundle) -> Bundle:
        bundle = self._record(bundle)
        env, model, plan = bundle.env, bundle.model, bundle.plan
        size = plan.size("pp")  # the pipeline's layout: this size is read, never worked out
        if not env.is_distributed or size == 1:
            return bundle
        if bundle.loss_fn is not None:
            raise ConflictError(f"{self!r}: the loss is computed on the last stage from the "
                                "stage's output and the batch's labels, not by a loss_fn given "
                                "the whole model; drop loss_fn (for an nn.Sequential pass "
                                "pipeline_parallel(loss=lambda output, target: ...))")
        cut = getattr(unwrap(model), "_pp_stage", None)
        if cut is not None:
            raise ConflictError(f"{self!r}: this model was cut already by Transformers' "
                                f"distributed_config(pp_size={getattr(cut, 'pp_size', '?')}) "
                                "(an even split by layer count, run without a schedule); load "
                                "it whole (no distributed_config) and let pipeline_parallel cut "
                                "and schedule it")
        if bundle.plan.precision == "fp16":
            raise ConflictError(f"{self!r}: fp16's gradient scaling cannot reach the loss inside "
                                "the schedule; use bf16")
        if is_rank0_weights(model):
            raise ConflictError(f"{self!r}: a model built by sw.init_on_meta holds its weights on "
                                "rank 0 only, which pipeline_parallel does not cut yet; build it "
                                "normally")
        refuse_state(bundle.optimizer)
        ensure_process_group(env)
        mesh = with_dimension(bundle.mesh, env, plan.mesh, "pp", size, repr(self))
        split = self.split_for(model, plan)
        if split.kind == "sequential" and self.loss is None:
            raise ConflictError(f"{self!r}: an nn.Sequential has no loss of its own; pass "
                                "pipeline_parallel(loss=lambda output, target: ...)")
        microbatches = self.microbatch_count(plan)
        self._check_schedule(size, microbatches)
        batch_size = _loader_batch_size(bundle.loader)
        if batch_size is not None and microbatches > batch_size:
            raise ArgumentError(f"{self!r}: {microbatches} microbatches for the "
                                f"loader's batches of {batch_size} samples: each microbatch needs "
                                f"a sample; microbatches must be at most the batch size "
                                f"({batch_size})")
        rank = int(mesh["pp"].get_local_rank())
        mine = self.kind.stages_on(rank, size)
        _check_tied(model, split, self.kind, size)
        check_views(model, split)
        groups = [len(group["params"]) for group in bundle.optimizer.param_groups] \
            if bundle.optimizer is not None else []
        prune(model, split, mine)
        if not any(p.is_meta for p in model.parameters()):  # a meta model: shapes only
            model.to(env.device)
        _keep_held(bundle.optimizer, model)
        run = PipelineRun(group=mesh["pp"].get_group(), rank=rank, size=size,
                          schedule=self.kind, microbatches=microbatches,
                          stages=mine, modules=stage_modules(model, split, mine),
                          total=split.stages, kind=split.kind, loss=self.loss,
                          device=env.device, group_sizes=groups, batch_size=batch_size)
        return attrs.evolve(bundle, mesh=mesh, stages=run)

    def describe(self, env: Env) -> str:
        return self.describe_in(env, plan_for(env, [self]))

    def describe_in(self, env: Env, plan: Plan) -> str:
        size = plan.size("pp")
        if not env.is_distributed or size == 1:
            return "one rank per group: every layer on every rank"
        stages, micro = size * self.per_rank, self.microbatch_count(plan)
        cut = "balanced by parameter count" if self.split == "auto" else \
            f"at {', '.join(self.split)}"
        idle = self.kind.bubble(size, micro)
        filled = " before the weight-gradient work fills it" if self.kind.zero_bubble else ""
        return (f"{self.schedule} over the mesh's pp dimension ({size} ranks, {stages} stages, "
                f"{self.per_rank} per rank), cut at layer boundaries {cut}; each batch in "
                f"{micro} microbatches; theoretical bubble {idle:.0%}{filled}; the loss a token "
                f"sum on the last stage, shared with every stage; the {size} "
                "ranks read the same batch")


def _check_tied(model: nn.Module, split: StageSplit, schedule: Schedule, size: int) -> None:
    """Refuse tied input and output embeddings whose stages are on different ranks (each
    rank would train its own copy: silently untied)."""
    parts = decoder_parts(unwrap(model))
    if parts is None:
        return
    _, inner = parts
    if unwrap(model).lm_head.weight is not inner.embed_tokens.weight:  # type: ignore[union-attr]
        return
    last = split.stages - 1
    if not any(0 in schedule.stages_on(r, size) and last in schedule.stages_on(r, size)
               for r in range(size)):
        raise ConflictError(f"pipeline_parallel(schedule={schedule.name!r}): this model ties lm_head "
                            "to embed_tokens, and its first and last stages are on different "
                            "ranks, which would train two copies apart; untie them "
                            "(tie_word_embeddings=False) or use a V-shaped schedule "
                            f"({v_shaped_names()}), whose rank 0 holds both")


def _keep_held(optimizer: Any, model: nn.Module) -> None:
    """Keep in each param group of ``optimizer`` only the parameters ``model`` still holds."""
    if optimizer is None:
        return
    held = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in held]


#: the public factory: the class itself, so its defaults are written once
pipeline_parallel = PipelineParallel


def _loader_batch_size(loader: Any) -> int | None:
    """The samples in each batch of ``loader`` (a DataLoader's, or one shardwise wraps), if
    it says."""
    size = getattr(getattr(loader, "loader", loader), "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None
