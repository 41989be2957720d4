# PipelineRun: one rank's stages under a torch.distributed.pipelining schedule, for train and eval.
"""What ``pipeline_parallel`` does with a batch on one rank.

Every rank of a pipeline group is given the same batch: the first stage runs its inputs, the
last computes the loss from its labels (shifted before the batch is cut into microbatches,
as a Transformers causal LM shifts them), as a sum over labelled tokens with their count.
torch's schedule runs the microbatches' forwards and backwards across the stages
(``scale_grads=False``: gradients are sums), and the sum and count are shared over the group,
so every stage reports the same loss and the step weighs the tokens as it weighs any
``(loss_sum, num_items)``. A schedule and its stages are built for each shape of
microbatch met (torch's stages fix their buffers' shapes at their first step).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from shardwise.errors import ArgumentError, ConflictError, LossError
from shardwise.parallel.context_split import IGNORE, ContextSplit, causal_lm_loss, next_token_labels

__all__ = ["SCHEDULES", "Schedule", "schedule_of", "PipelineRun", "v_shaped_names"]
#: every schedule torch offers, by the name ``pipeline_parallel(schedule=...)`` takes
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble", "DualPipeV")
#: the schedules that run several stages on each rank
_MULTI = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
#: the ones whose two stages per rank make a V (rank r: stages r and 2p - 1 - r)
_V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
#: the ones that fill the bubble with weight-gradient work (backward split in two)
_ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")

Loss = Callable[[Any, Any], Any]


@attrs.frozen
class Schedule:
    """A pipeline schedule resolved once from its name (:func:`schedule_of`): everything
    the transform, the run, the memory estimate and ``explain()`` ask of it.

    Attributes:
        name: torch's class name without ``Schedule`` (:data:`SCHEDULES`).
        per_rank: stages each rank holds.
    """

    name: str
    per_rank: int

    @property
    def multi(self) -> bool:
        """Several stages on each rank (torch's multi-stage schedules)."""
        return self.name in _MULTI

    @property
    def v_shaped(self) -> bool:
        """Two stages per rank in a V: rank r holds stages r and 2p - 1 - r."""
        return self.name in _V_SHAPED

    @property
    def zero_bubble(self) -> bool:
        """The backward split in two, the weight-gradient half filling the bubble."""
        return self.name in _ZERO_BUBBLE

    def torch_class(self) -> Any:
        """torch's schedule class."""
        from torch.distributed.pipelining import schedules as torch_schedules

        return getattr(torch_schedules, f"Schedule{self.name}")

    def build(self, stages: list[Any], **kwargs: Any) -> Any:
        """torch's schedule over this rank's ``stages`` (one, or the list for multi-stage)."""
        return self.torch_class()(stages if self.multi else stages[0], **kwargs)

    def stages_on(self, rank: int, size: int) -> list[int]:
        """The stages rank ``rank`` of a group of ``size`` holds: looped (r, r + p, ...) or,
        V-shaped, r and 2p - 1 - r."""
        if self.v_shaped:
            return [rank, 2 * size - 1 - rank]
        return [rank + k * size for k in range(self.per_rank)]

    def bubble(self, size: int, microbatches: int) -> float:
        """The theoretical idle fraction per rank with equal stage times: (p - 1) /
        (v·m + p - 1) for v stages per rank; a zero-bubble schedule fills most of it with
        weight-gradient work (this is the bound before that filling)."""
        return (size - 1) / (self.per_rank * microbatches + size - 1)

    def order(self, size: int, microbatches: int) -> dict[int, list[Any]]:
        """torch's compute actions of every rank of a group of ``size`` (from stand-in
        stages: nothing runs).

        Raises:
            ValueError: torch's schedule refuses this microbatch count (its reason).
        """
        total = size * self.per_rank

        def stand_in(index: int) -> Any:
            return types.SimpleNamespace(stage_index=index, num_stages=total, group_size=size,
                                         group_rank=0, is_first=index == 0,
                                         is_last=index == total - 1, submod=None,
                                         stage_index_to_group_rank=None, has_backward=True)

        built = self.build([stand_in(i) for i in self.stages_on(0, size)],
                           n_microbatches=microbatches, loss_fn=lambda output, target: output)
        return {rank: [a for a in actions if a is not None]
                for rank, actions in built.pipeline_order.items()}


def schedule_of(name: str, stages_per_rank: int | None = None) -> Schedule:
    """The record of schedule ``name`` with ``stages_per_rank`` (None: 2 for a multi-stage
    schedule, else 1), checked.

    Raises:
        ArgumentError: a count the schedule cannot hold.
    """
    multi, v_shaped = name in _MULTI, name in _V_SHAPED
    per = stages_per_rank
    if per is not None and not multi and per != 1:
        raise ArgumentError(f"pipeline_parallel(schedule={name!r}) runs one stage per rank "
                            f"(got stages_per_rank={per}); the multi-stage schedules are "
                            f"{', '.join(_MULTI)}")
    if per is not None and v_shaped and per != 2:
        raise ArgumentError(f"pipeline_parallel(schedule={name!r}) holds exactly 2 stages per "
                            f"rank, in a V (got stages_per_rank={per})")
    if per == 1 and multi:
        raise ArgumentError(f"pipeline_parallel(schedule={name!r}) needs stages_per_rank >= 2 "
                            "(a rank's stages are interleaved)")
    return Schedule(name, per or (2 if multi else 1))


def v_shaped_names() -> str:
    """The V-shaped schedules, for a message."""
    return ", ".join(_V_SHAPED)


def _sum_and_count(result: Any, target: Any) -> tuple[torch.Tensor, Any]:
    if isinstance(result, tuple) and len(result) == 2:
        return result[0], result[1]
    if isinstance(result, torch.Tensor) and result.ndim == 0:
        items = len(target) if isinstance(target, torch.Tensor) and target.ndim else 1
        return result * items, items  # a mean over the microbatch's samples
    raise LossError(f"pipeline_parallel's loss must return a scalar loss (the mean over the "
                    f"microbatch's samples) or (loss_sum, num_items); got {type(result).__name__}")


@attrs.define(eq=False)
class PipelineRun:
    """One rank's stages of a pipeline and the schedule that runs them.

    Attributes:
        group: the pipeline group's process group.
        rank: this rank's place in it.
        size: ranks in the group.
        schedule: the schedule, resolved (:class:`Schedule`).
        microbatches: microbatches each batch is cut into.
        stages: the stage indices this rank holds.
        modules: the module each of those stages runs.
        total: stages in the pipeline.
        kind: "decoder" (batches of input_ids, labels, attention_mask) or "sequential"
            (batches ``(inputs, target)``).
        loss: ``loss(output, target)`` on the last stage (None: Transformers' causal LM loss).
        device: where the stages run.
        group_sizes: each optimizer param group's parameters before the model was cut.
        context: under ``context_parallel`` too, this rank's slice of every sequence (each
            stage runs the slice; ``predict`` gathers the logits whole).
    """

    group: Any = attrs.field(repr=False)
    rank: int
    size: int
    schedule: Schedule
    microbatches: int
    stages: list[int]
    modules: list[nn.Module] = attrs.field(repr=False)
    total: int
    kind: str
    loss: Loss | None = attrs.field(default=None, repr=False)
    device: torch.device = torch.device("cpu")
    #: parameters in each optimizer param group before the model was cut (what a checkpoint
    #: records, so that it loads at another layout)
    group_sizes: list[int] = attrs.field(factory=list)
    context: ContextSplit | None = attrs.field(default=None, repr=False)
    #: samples in each of the loader's batches, when known (a shorter batch, an epoch's last,
    #: is padded up to the microbatches; without a loader no batch may be smaller than them)
    batch_size: int | None = None
    _built: dict[Any, Any] = attrs.field(factory=dict, repr=False)
    _counts: list[torch.Tensor] = attrs.field(factory=list, repr=False)

    def __deepcopy__(self, memo: dict[int, Any]) -> PipelineRun:
        return self  # process groups and stages cannot be copied

    # -- the batch ------------------------------------------------------------------------

    def parts(self, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """The first stage's inputs, the keyword inputs every stage takes, and the target.

        Raises:
            ConflictError: a batch this pipeline cannot route, naming what it accepts.
        """
        if self.kind == "sequential":
            if not isinstance(batch, (tuple, list)) or len(batch) not in (1, 2):
                raise ConflictError(f"pipeline_parallel of an nn.Sequential takes batches "
                                    f"(inputs, target) or (inputs,); got a "
                                    f"{type(batch).__name__}")
            return (batch[0],), {}, batch[1] if len(batch) == 2 else None
        if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor):
            raise ConflictError(f"pipeline_parallel of a Transformers decoder takes mapping "
                                f"batches with 'input_ids' (and 'labels', 'attention_mask'); "
                                f"got a {type(batch).__name__}")
        other = sorted(set(batch) - {"input_ids", "labels", "attention_mask"})
        if other:
            raise ConflictError(f"pipeline_parallel routes 'input_ids' to the first stage, "
                                f"'attention_mask' to every stage and 'labels' to the last; this "
                                f"batch also has {other}, which no stage would be given")
        if self.context is not None:  # this rank's slice: the whole sequence's positions and
            part = self.context.split(batch)  # labels shifted before the cut, no padding mask
            return (part["input_ids"],), {"position_ids": part["position_ids"]}, \
                part.get("labels")
        mask = batch.get("attention_mask")
        labels = batch.get("labels")
        target = None
        if isinstance(labels, torch.Tensor):  # shifted before the cut, as the model shifts
            target = next_token_labels(labels)
        return (batch["input_ids"],), ({"attention_mask": mask} if mask is not None else {}), \
            target

    def _filled(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any
                ) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """A decoder batch its microbatches do not divide, padded up to a multiple of them
        (under the causal LM loss, not a ``loss=`` of the user's):
        the last sample repeated with its labels all ``-100`` (the loss is a token sum, so
        the padding adds no loss, no count and no gradient); outputs are cut back by the
        caller. Any other batch as it is.

        Raises:
            ConflictError: any other batch the microbatches do not divide (a loss of the
                user's may average over samples, which padding would change).
        """
        size = int(args[0].shape[0])
        extra = -size % self.microbatches
        if not extra:
            return args, kwargs, target
        if self.microbatches > (self.batch_size or size):
            raise ArgumentError(f"pipeline_parallel(microbatches={self.microbatches}) cuts each "
                                f"batch into {self.microbatches} microbatches; a batch of {size} "
                                "samples cannot fill them (each needs a sample); use "
                                f"microbatches <= {size} or larger batches")
        if self.kind != "decoder" or self.loss is not None:
            raise ConflictError(f"pipeline_parallel cuts each batch into {self.microbatches} "
                                f"microbatches; a batch of {size} samples does not divide (only "
                                "a decoder's batch under the causal LM token-sum loss is padded: "
                                "a loss of your own may average over samples): use a batch size "
                                f"that is a multiple of {self.microbatches}, drop_last=True, or "
                                "another microbatches=")

        def grown(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or not value.ndim or value.shape[0] != size:
                return value
            return torch.cat([value, value[-1:].expand(extra, *value.shape[1:])])

        if target is not None:
            target = torch.cat([target, target.new_full((extra, *target.shape[1:]), IGNORE)])
        return tuple(grown(a) for a in args), {k: grown(v) for k, v in kwargs.items()}, target

    # -- the schedule ---------------------------------------------------------------------

    def _loss(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        result = causal_lm_loss(output, target) if self.loss is None else self.loss(output, target)
        loss, items = _sum_and_count(result, target)
        self._counts.append(torch.as_tensor(items, device=loss.device, dtype=torch.float64))
        return loss

    def _schedule(self, args: tuple[Any, ...], kwargs: dict[str, Any], with_loss: bool) -> Any:
        """The schedule for microbatches shaped as these, built once per shape."""
        from torch.distributed.pipelining import PipelineStage

        shapes = tuple((tuple(v.shape), v.dtype) for v in [*args, *kwargs.values()]
                       if isinstance(v, torch.Tensor))
        key = (shapes, with_loss)
        if key not in self._built:
            stages = [PipelineStage(module, index, self.total, self.device, group=self.group)
                      for module, index in zip(self.modules, self.stages, strict=True)]
            built = self.schedule.build(stages, n_microbatches=self.microbatches,
                                        loss_fn=self._loss if with_loss else None,
                                        scale_grads=False)
            if self.schedule.v_shaped and not with_loss:
                _forward_only(built)
            self._built[key] = built
        return self._built[key]

    def _shared(self, losses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's loss sum and count, on every rank of the group (only the rank of the
        last stage computed them)."""
        pair = torch.zeros(2, dtype=torch.float64, device=self.device)
        if losses:
            pair[0] = torch.stack([loss.detach().double() for loss in losses]).sum()
            # the counts of these losses: a stage's first run also computes a loss to learn
            # its shapes, whose count comes first
            pair[1] = torch.stack(self._counts[-len(losses):]).sum().to(pair.device)
        self._counts.clear()
        dist.all_reduce(pair, group=self.group)
        return pair[0], pair[1]

    def train(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of ``batch`` through the pipeline (gradients summed into
        this rank's parameters); the batch's loss sum and labelled-token count."""
        args, kwargs, target = self.parts(batch)
        if target is None:
            raise LossError("pipeline_parallel computes the loss on the last stage from the "
                            "batch's labels, which this batch lacks")
        args, kwargs, target = self._filled(args, kwargs, target)
        losses: list[torch.Tensor] = []
        self._counts.clear()
        self._schedule(args, kwargs, True).step(*args, target=target, losses=losses,
                                                return_outputs=False, **kwargs)
        return self._shared(losses)

    def _forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
        """The whole batch's output, forward only: on the rank of the last stage (None on
        the others)."""
        out = self._schedule(args, kwargs, False).step(*args, **kwargs)
        return out if isinstance(out, torch.Tensor) else None

    def evaluate(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss sum and count of ``batch``, forward only, on every rank of the group."""
        args, kwargs, target = self.parts(batch)
        if target is None:
            raise LossError("pipeline_parallel evaluates the loss from the batch's labels, "
                            "which this batch lacks")
        args, kwargs, target = self._filled(args, kwargs, target)
        out = self._forward(args, kwargs)
        losses: list[torch.Tensor] = []
        self._counts.clear()
        if out is not None:
            losses.append(self._loss(out, target))
        return self._shared(losses)

    def predict(self, batch: Any) -> Any:
        """The whole model's output for ``batch`` on every rank of the group (forward only):
        logits, and for a decoder batch with labels the loss (the mean over its labelled
        tokens) in a Transformers ``CausalLMOutputWithPast``."""
        args, kwargs, target = self.parts(batch)
        size = int(args[0].shape[0])
        out = self._forward(*self._filled(args, kwargs, None)[:2])
        holder = dist.get_global_rank(self.group, self._last_rank())
        header = torch.zeros(9, dtype=torch.int64, device=self.device)  # dtype, ndim, shape
        if out is not None:
            header[0], header[1] = _DTYPES.index(out.dtype), out.ndim
            header[2:2 + out.ndim] = torch.tensor(out.shape)
        dist.broadcast(header, src=holder, group=self.group)
        if out is None:
            ndim = int(header[1])
            out = torch.empty(tuple(header[2:2 + ndim].tolist()), dtype=_DTYPES[int(header[0])],
                              device=self.device)
        dist.broadcast(out, src=holder, group=self.group)
        out = out[:size]  # without the samples a short batch was padded with
        if self.kind == "sequential":
            return out
        if self.context is not None:  # each rank's slice of the sequence, gathered whole
            out = self.context.whole(out, self.context.lengths[0])
            labels = batch.get("labels")
            target = next_token_labels(labels) if isinstance(labels, torch.Tensor) else None
        from transformers.modeling_outputs import CausalLMOutputWithPast

        loss = None
        if target is not None:
            total, count = causal_lm_loss(out, target)
            loss = total / count.clamp(min=1)
        return CausalLMOutputWithPast(loss=loss, logits=out)

    def _last_rank(self) -> int:
        """The group rank that holds the last stage."""
        for rank in range(self.size):
            if self.total - 1 in self.schedule.stages_on(rank, self.size):
                return rank
        raise AssertionError("no rank holds the last stage")


def _forward_only(schedule: Any) -> None:
    """Keep only the forward work of a V-shaped schedule's plan (its forwards, the sends and
    receives of activations, and the forward half of each overlapped pair), in its order.

    torch 2.13 runs the V-shaped schedules only with backward (its check of a plan wants a
    backward for every microbatch, and its runtime hands the gradients of the two stages a
    rank holds to each other), so its forward-only pass is this: the same placement and the
    same order of sends and receives between each pair of ranks, minus the backward work,
    which only ever made a rank wait longer.
    """
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    keep = {Kind.FORWARD, Kind.SEND_F, Kind.RECV_F}
    plan: dict[int, list[Any]] = {}
    for rank, actions in schedule.pipeline_order_with_comms.items():
        plan[rank] = []
        for action in actions:
            parts = action.sub_actions or [action] if action is not None else []
            plan[rank] += [part for part in parts if part.computation_type in keep]
    schedule.pipeline_order_with_comms = plan


#: the dtypes an output is sent as between ranks (its index in this tuple)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
