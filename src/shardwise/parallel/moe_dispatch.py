# Expert parallelism: each rank holds a slice of every expert stack; tokens travel by all-to-all.
"""The experts module of a mixture of experts split over the ranks of an ``ep`` group.

An experts module (Transformers 5's ``*Experts``: ``forward(hidden_states, top_k_index,
top_k_weights)``, weights stacked with the expert first, ``gate_up_proj`` ``[E, 2I, H]``,
``down_proj`` ``[E, H, I]``, biases ``[E, ...]``) keeps ``E / ep`` experts on each rank,
its stacks DTensors sharded on dim 0 over the group (so checkpoints and exports keep the
model's names and whole shapes). Its forward becomes: each (token, choice) pair is sent to
the rank of its expert (``all_to_all_single``, uneven counts, autograd through it), the
module's own forward runs on the received rows against the local stacks (each row one
expert, weight 1: the model's own expert math, whichever implementation it selects), the
results come back by the reverse all-to-all and are weighed by the router's weights and
summed per token, as the module does.

The experts are split over data ranks (those reading different batches: every rank when
nothing else splits the model). With fewer ranks per group than data ranks, the groups are
replicas of each other: data ranks ``g * ep ... g * ep + ep - 1`` form group ``g``, and the
stacks are DTensors on a 2-D mesh ``(ep_replicate, ep)``, replicated over the first
dimension (or sharded again across it by FSDP2, :meth:`ExpertSplit.shard_over_replicas`).

Gradients: a rank's experts see every rank of its group's tokens, so their gradient sums
the ``ep`` ranks' losses where data parallelism averages; on the way back the local
stacks' gradient is summed over the replicas (an all-reduce over ``ep_replicate``, every
micro-batch: a sum of sums under accumulation) and scaled by ``1 / data ranks``, so it
equals the global batch's mean as the other weights' averaged one does.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ExpertSplit", "split_experts", "expert_splits", "expert_stacks", "expert_count",
           "is_expert_stack", "by_expert", "held_numel"]

#: the experts' mesh dimension: a DTensor on a mesh with it is an expert stack
EP = "ep"


def is_expert_stack(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert stack :func:`split_experts` split: a DTensor on the
    experts' mesh (known by its ``ep`` dimension, which survives ``module.to()`` and FSDP2
    re-registering the parameter, where an attribute would not)."""
    mesh = getattr(param, "device_mesh", None)
    return mesh is not None and EP in (getattr(mesh, "mesh_dim_names", None) or ())


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; on the way back the gradient summed over ``replicas`` (a process
    group, or None) and scaled by ``factor``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: float, replicas: Any) -> torch.Tensor:
        ctx.factor, ctx.replicas = factor, replicas
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad * ctx.factor
        if ctx.replicas is not None:
            dist.all_reduce(grad, group=ctx.replicas)
        return grad, None, None


class _LocalExperts:
    """The experts module seen with this rank's stacks and expert count: what its own
    forward reads (every other attribute is the module's)."""

    def __init__(self, module: nn.Module, stacks: dict[str, torch.Tensor], count: int) -> None:
        self.__dict__.update(stacks)
        self.__dict__["num_experts"] = count
        self.__dict__["_module"] = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)


def by_expert(local_count: int, copies: int) -> bool:
    """Whether FSDP2 splits a rank's ``local_count`` experts across ``copies`` replicas by
    expert (dim 0): when they divide; else by each expert's rows (dim 1), since splitting
    fewer experts than replicas by expert would leave some replicas none and others a whole
    expert (torchtitan splits dim 1 there too)."""
    return local_count % copies == 0


def held_numel(shape: tuple[int, ...], size: int, copies: int) -> int:
    """Elements of an expert stack of ``shape`` one rank holds: its ``1/size`` of the
    experts, split again across ``copies`` replicas by FSDP2 (as :func:`by_expert` says;
    ``copies == 1``: whole)."""
    local = shape[0] // size
    rest = math.prod(shape[1:])
    if copies == 1:
        return local * rest
    if by_expert(local, copies) or len(shape) < 2:
        return -(-local // copies) * rest
    return local * -(-shape[1] // copies) * math.prod(shape[2:])


def expert_count(module: nn.Module) -> int:
    """The ``num_experts`` an experts module declares."""
    return int(getattr(module, "num_experts"))  # noqa: B009 (an attribute of the module's class)


def expert_stacks(module: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of an experts module, each a stack over its ``num_experts`` experts.

    Raises:
        ValueError: a parameter whose first dimension is not the expert count (named).
    """
    count = expert_count(module)
    stacks = dict(module.named_parameters(recurse=False))
    odd = [f"{name} {tuple(p.shape)}" for name, p in module.named_parameters()
           if "." in name or p.dim() == 0 or p.shape[0] != count]
    if odd:
        raise ValueError(f"{type(module).__name__} holds parameters that are not stacks of its "
                         f"{count} experts: {', '.join(odd)}")
    return stacks


class ExpertSplit:
    """The ``ep`` group of one experts module and its dispatch."""

    def __init__(self, module: nn.Module, mesh: Any) -> None:
        copies, size = mesh.shape
        self.module, self.mesh, self.group, self.size = module, mesh, mesh["ep"].get_group(), size
        #: the replica group the dispatch sums the expert gradients over (None: one group,
        #: or FSDP2 reduces them across the replicas)
        self.replicas = mesh["ep_replicate"].get_group() if copies > 1 else None
        self.world = copies * size  # the divisor that makes the sum a global mean
        self.count = expert_count(module)
        self.local_count = self.count // size
        self.forward = type(module).forward

    def _stacks(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The local stacks, in the activations' dtype (FSDP2's parameter cast under
        ``mixed_precision``; the gradient returns in the stacks' own), their gradient scaled."""
        stacks = {name: _ScaleGrad.apply(param.to_local(), 1.0 / self.world,  # type: ignore[attr-defined]
                                         self.replicas)
                  for name, param in self.module.named_parameters(recurse=False)}
        return {name: stack.to(dtype) if stack.is_floating_point() else stack
                for name, stack in stacks.items()}

    def shard_over_replicas(self, shard: Any) -> None:
        """Hand the expert stacks to FSDP2 over the replica dimension (``shard(module,
        mesh)``: ``fully_shard``'s call): each rank then holds ``1 / data ranks`` of every stack
        between steps (its ``E / ep`` experts, sharded again across the replicas), gathered
        within the replica dimension for the forward; FSDP2 averages their gradient across
        the replicas, so the dispatch scales by ``1 / ep`` and all-reduces nothing. The
        stacks become DTensors on the 1-D ``ep`` mesh first (FSDP2 composes its dimension
        with a model-parallel one on the same parent mesh, as it does tensor parallel's)."""
        from torch.distributed.tensor import DTensor, Shard

        if self.replicas is None:
            return
        if not by_expert(self.local_count, self.mesh.shape[0]):
            shard = functools.partial(  # a 1-D stack (a bias per expert) by expert still
                shard, placement=lambda param: Shard(1) if param.ndim > 1 else None)
        for name, param in list(self.module.named_parameters(recurse=False)):
            local = DTensor.from_local(param.to_local(), self.mesh["ep"], [Shard(0)],  # type: ignore[attr-defined]
                                       run_check=False)
            setattr(self.module, name, nn.Parameter(local, requires_grad=param.requires_grad))
        shard(self.module, self.mesh["ep_replicate"])
        self.replicas, self.world = None, self.size

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_to_all_single

        tokens, width = hidden_states.shape
        choices = top_k_index.shape[-1]
        experts = top_k_index.reshape(-1)
        order = torch.argsort(experts, stable=True)  # grouped by expert, so by rank
        token_of = torch.div(order, choices, rounding_mode="floor")
        ranks = torch.div(experts[order], self.local_count, rounding_mode="floor")
        send = torch.bincount(ranks, minlength=self.size)
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send, group=self.group)
        sent, received = send.tolist(), receive.tolist()
        rows = all_to_all_single(hidden_states.new_empty(sum(received), width),
                                 hidden_states[token_of], received, sent, group=self.group)
        local = (experts[order] - ranks * self.local_count).to(top_k_index.dtype)
        local_in = local.new_empty(sum(received))
        dist.all_to_all_single(local_in, local, received, sent, group=self.group)
        ones = torch.ones(sum(received), 1, dtype=top_k_weights.dtype, device=rows.device)
        stacks = self._stacks(rows.dtype)
        done = self.forward(_LocalExperts(self.module, stacks, self.local_count), rows,
                            local_in[:, None], ones)
        if not sum(received):  # no row for this rank's experts: the output must still
            # hang on the rows and the stacks, or this rank's backward would skip the two
            # all-to-alls the others run (a hang), and the stacks would get no gradient
            # (in one process their rows get zeros, which AdamW decays and counts)
            done = done + (rows.sum() + sum(stack.sum() for stack in stacks.values())) * 0
        back = all_to_all_single(hidden_states.new_empty(tokens * choices, width), done,
                                 sent, received, group=self.group)
        weights = top_k_weights.reshape(-1)[order, None]
        weighed = (back * weights).to(hidden_states.dtype)
        return torch.zeros_like(hidden_states).index_add(0, token_of, weighed)


def split_experts(module: nn.Module, mesh: Any) -> ExpertSplit:
    """Split ``module``'s expert stacks over the ``(ep_replicate, ep)`` ``mesh`` (each rank
    its ``E / ep`` experts, scattered from rank 0's copy, the same on every replica) and
    route its forward through the dispatch."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    split = ExpertSplit(module, mesh)
    for name, param in expert_stacks(module).items():
        sharded = distribute_tensor(param.detach(), mesh, [Replicate(), Shard(0)])
        setattr(module, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    module.forward = split
    return split


def expert_splits(model: nn.Module) -> list[ExpertSplit]:
    """The dispatch of every experts module :func:`split_experts` split in ``model``."""
    return [split for module in model.modules()
            if isinstance(split := module.__dict__.get("forward"), ExpertSplit)]
