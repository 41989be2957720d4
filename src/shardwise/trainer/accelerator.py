# ShardwiseAccelerator: what the Transformers Trainer asks of its Accelerator, answered by shardwise.
"""The object a Trainer on shardwise calls where it would call its ``Accelerator``.

The Trainer keeps its loop (accumulation windows, ``optimizer.step()``, the scheduler,
logging, evaluation, callbacks, checkpoints) and asks its accelerator for the distributed
mechanics: ``prepare`` (here: the pipeline the TrainingArguments give, applied to the model
and optimizer; each loader distributed as the pipeline's ``distribute_data`` says),
``backward``, ``no_sync``, ``clip_grad_norm_``, ``gather_for_metrics``, ``gather``,
``pad_across_processes``, ``unwrap_model``, ``get_state_dict`` and a few flags. Anything else
it asks for is refused by name (:class:`~shardwise.errors.ConflictError` through
``AttributeError``), so a Transformers release that asks for more fails loudly, never
silently.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader

from shardwise.bundle import Bundle
from shardwise.data import DeviceLoader
from shardwise.distributed import leave_at_exit, leave_group
from shardwise.errors import ArgumentError
from shardwise.metrics import gather_for_metrics
from shardwise.parallel.mesh import data_share
from shardwise.pipelines import Pipeline
from shardwise.trainer.checkpoint_files import read_deferred
from shardwise.trainer.from_accelerate import (
    REFUSED,
    accelerate_precision,
    amp_forward,
    bridge_accelerate_state,
    dataloader_config,
    foreign_sampler,
    restore_forward,
    skip_batches,
    split_as_accelerate,
)
from shardwise.transforms.base import plan_for
from shardwise.transforms.data_distribution import DistributeData

__all__ = ["ShardwiseAccelerator"]


@attrs.define
class _GradientState:
    """The part of Accelerate's ``GradientState`` the Trainer reads and sets: it runs its own
    accumulation windows and tells the accelerator when a window ends."""

    sync_gradients: bool = True
    end_of_dataloader: bool = False
    plugin_kwargs: dict[str, Any] = attrs.Factory(dict)

    def _set_sync_gradients(self, sync: bool) -> None:
        self.sync_gradients = sync


@attrs.frozen
class _State:
    """The part of Accelerate's ``AcceleratorState`` the Trainer reads: no FSDP or DeepSpeed
    plugin (shardwise's engines run those), the process layout."""

    distributed_type: Any
    num_processes: int
    process_index: int
    device: torch.device
    mixed_precision: str
    fsdp_plugin: Any = None
    deepspeed_plugin: Any = None


class _Tracked:
    """A distributed loader that tells the accelerator when it is iterated (the loader
    ``gather_for_metrics`` drops the padding of) and when its last batch is out."""

    def __init__(self, loader: DeviceLoader, owner: ShardwiseAccelerator,
                 foreign: bool = False) -> None:
        self.loader, self.owner, self.foreign = loader, owner, foreign

    def __iter__(self) -> Iterator[Any]:
        state = self.owner.gradient_state
        self.owner.active = self.loader
        state.end_of_dataloader = False
        last = len(self.loader) - 1
        for index, batch in enumerate(self.loader):
            state.end_of_dataloader = index == last
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def skip(self, batches: int) -> _Tracked:
        """Start the epoch the Trainer sets next after ``batches`` of this rank's batches: the
        sampler starts part-way through the epoch's order, reading none of them. A loader on
        a trainer's own sampler skips as on Accelerate (their indices drawn and dropped)."""
        if self.foreign:
            return _Tracked(skip_batches(self.loader, batches), self.owner, foreign=True)
        self.skipped = batches
        return self

    def set_epoch(self, epoch: int) -> None:
        skipped, self.skipped = self.skipped, 0
        if skipped:
            self.loader.resume(epoch, skipped)
        else:
            self.loader.set_epoch(epoch)

    skipped = 0

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


def _distributed_type(pipe: Pipeline) -> Any:
    from accelerate.utils import DistributedType

    env = pipe.env
    if not env.is_distributed:
        return DistributedType.NO
    return DistributedType.MULTI_GPU if env.device.type == "cuda" else DistributedType.MULTI_CPU


class ShardwiseAccelerator:
    """What ``transformers.Trainer`` calls on ``self.accelerator``, run by ``pipe``.

    Built by :func:`shardwise.on_shardwise`'s ``create_accelerator_and_postprocess`` from
    the Trainer's TrainingArguments; a user does not build one.
    """

    def __init__(self, pipe: Pipeline) -> None:
        self.pipe = pipe
        self.env = pipe.env
        self.bundle: Bundle | None = None
        self.active: DeviceLoader | None = None
        self.gradient_state = _GradientState()
        self.state = _State(_distributed_type(pipe), pipe.env.world_size, pipe.env.rank,
                            pipe.env.device, "no")
        self.distributed_type = self.state.distributed_type
        self._models: list[nn.Module] = []
        #: a resume's weights folder, read once the pipeline has distributed the model
        self.pending_weights: Path | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self._synced = False  # a backward has synchronised gradients
        self._skipping = False  # inside no_sync
        self.parallelism_config = None
        # the pipeline's (trainer_pipeline: Accelerate's split and seeds)
        self.data = next((t for t in pipe.transforms if isinstance(t, DistributeData)),
                         DistributeData(split="batches", global_seed=True))
        # what the pipeline's settings record (the tensor-parallel mesh the data splits by),
        # known before the model is prepared: the Trainer prepares its loaders first
        self.plan = plan_for(pipe.env, pipe.transforms)
        # TrainingArguments started the group (Accelerate's PartialState) and leave it standing
        leave_at_exit()
        bridge_accelerate_state(self.env, self.plan.precision)
        self.dataloader_config = dataloader_config()

    # -- what the Trainer reads --------------------------------------------------------------

    @property
    def num_processes(self) -> int:
        return self.env.world_size

    @property
    def process_index(self) -> int:
        return self.env.rank

    @property
    def local_process_index(self) -> int:
        return self.env.local_rank

    @property
    def is_main_process(self) -> bool:
        return self.env.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.env.local_rank == 0

    @property
    def device(self) -> torch.device:
        return self.env.device

    @property
    def use_distributed(self) -> bool:
        return self.env.is_distributed

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Never: no loss scaler runs under the Trainer on shardwise (fp16 is refused)."""
        return False

    @property
    def mixed_precision(self) -> str:
        """The pipeline's precision in Accelerate's words ("no", "bf16", "fp16")."""
        return accelerate_precision(self.state.mixed_precision)

    @property
    def torch_device_mesh(self) -> Any:
        """The prepared bundle's device mesh (None before, or without one)."""
        return None if self.bundle is None else self.bundle.mesh

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in REFUSED:
            raise AttributeError(f"the Trainer's accelerator was asked for {name!r} (by the "
                                 f"Trainer, TRL or your script): {REFUSED[name]}")
        raise AttributeError(
            f"the Trainer's accelerator was asked for {name!r} (by the Trainer, TRL or your "
            "script), which shardwise's accelerator does not provide; it answers what the "
            "tested Transformers, TRL and PEFT releases ask (see docs/training-args.md, 'Your "
            "Trainer on shardwise')")

    # -- what TRL and scripts call -------------------------------------------------------------

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on each node's main process only (Accelerate's)."""
        if self.env.local_rank == 0:
            print(*args, **kwargs)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Every tensor in ``tensor`` (a nest of them) summed, or averaged (``"mean"``),
        over the ranks, times ``scale`` (Accelerate's ``reduce``); a new tensor."""
        if reduction not in ("sum", "mean", "none"):
            raise ArgumentError(f"reduce() 'reduction' must be 'sum', 'mean' or 'none' (got "
                                f"{reduction!r})")
        world = dist.get_world_size() if dist.is_initialized() else 1

        def one(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            out = value.clone()
            if world > 1 and reduction != "none":
                dist.all_reduce(out)
                if reduction == "mean":
                    out /= world
            return out * scale if scale != 1.0 else out

        from torch.utils._pytree import tree_map

        return tree_map(one, tensor)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False
                                ) -> Iterator[Any]:
        """This rank's share of ``inputs`` (a list, tuple, dict of them or tensor), as
        Accelerate splits it: contiguous parts, the first ranks one longer; with
        ``apply_padding`` the last item repeated so every rank gets as many."""
        from accelerate.state import PartialState

        with PartialState().split_between_processes(inputs, apply_padding=apply_padding) as part:
            yield part

    def maybe_context_parallel(self, buffers: Any = None, buffer_seq_dims: Any = None,
                               no_restore_buffers: Any = None
                               ) -> contextlib.AbstractContextManager[Any]:
        """No sequence split: the Trainer on shardwise runs no context-parallel layout
        (``context_parallel`` is refused when the model is prepared)."""
        return contextlib.nullcontext()

    def clear(self, *objects: Any) -> list[Any]:
        """Accelerate's alias of :meth:`free_memory`."""
        return self.free_memory(*objects)

    # -- prepare -----------------------------------------------------------------------------

    def prepare(self, *objects: Any, device_placement: Any = None) -> Any:
        """The model and optimizer through the pipeline (together: the optimizer is
        re-bound to what the model becomes), each loader distributed; schedulers as they are."""
        models = [o for o in objects if isinstance(o, nn.Module)]
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        if len(models) > 1 or len(optimizers) > 1:
            raise ArgumentError(f"shardwise's accelerator prepares one model and one optimizer "
                                f"at a time (got {len(models)} and {len(optimizers)})")
        if optimizers and not models and self.bundle is not None:
            if optimizers[0] is not self.bundle.optimizer:  # never swap one in silently
                raise ArgumentError("the Trainer passed a new optimizer for a model shardwise "
                                    "already prepared with another; build the optimizer "
                                    "before training starts (Trainer(optimizers=...))")
            models = [self.bundle.model]
        bundle = self._prepare_model(models[0], optimizers[0] if optimizers else None) \
            if models else None
        out: list[Any] = []
        for obj in objects:
            if isinstance(obj, nn.Module) and bundle is not None:
                out.append(bundle.model)
            elif isinstance(obj, torch.optim.Optimizer) and bundle is not None:
                out.append(bundle.optimizer)
            elif isinstance(obj, DataLoader):
                out.append(self._prepare_loader(obj))
            else:
                out.append(obj)
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model: nn.Module, device_placement: Any = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """The model for evaluation alone (moved to the device, not wrapped), or prepared."""
        if evaluation_mode:
            self._amp(model)
            return model.to(self.env.device)
        return self._prepare_model(model, None).model

    def _amp(self, model: nn.Module, engine: Any = None) -> None:
        """The forward in mixed precision as Accelerate makes it (outputs in fp32); no
        autocast where the engine casts the parameters."""
        from shardwise import precision as precisions
        from shardwise.step import forward_autocast

        if self.plan.precision == "fp32":
            return
        amp_forward(model, precisions.autocast(self.plan.precision, self.env.device)
                    if engine is None else
                    forward_autocast(engine, self.plan.precision, self.env.device))

    def _prepare_model(self, model: nn.Module, optimizer: torch.optim.Optimizer | None
                       ) -> Bundle:
        if self.bundle is not None and self.bundle.model is model:
            return self.bundle
        bundle = self.pipe(model, optimizer)
        if bundle.scaler is not None:
            raise NotImplementedError("fp16 under the Trainer on shardwise is not supported yet "
                                      "(its loss scaler); use bf16 or fp32")
        if optimizer is not None and bundle.engine.stepping_optimizer(optimizer) is not optimizer:
            raise NotImplementedError("an optimizer stepped by another (ZeRO-1) under the Trainer "
                                      "on shardwise is not supported yet")
        self.bundle = bundle
        read_deferred(self, bundle.engine.unwrap(bundle.model))  # a resume's weights, sliced
        self._amp(bundle.engine.unwrap(bundle.model), bundle.engine)
        self.state = attrs.evolve(self.state, mixed_precision=bundle.plan.precision)
        bridge_accelerate_state(self.env, bundle.plan.precision)
        self._models.append(bundle.model)
        return bundle

    def _prepare_loader(self, loader: DataLoader) -> _Tracked:
        """The loader split as Accelerate splits it (whole batches in turn), each epoch's
        iteration drawing its seed from torch's global stream as Accelerate's does (so
        dropout draws the same numbers), over the pipeline's data ranks."""
        data, env = self.data, self.env
        if foreign_sampler(loader) and env.is_distributed:
            return _Tracked(split_as_accelerate(loader, env, self.plan), self, foreign=True)
        sharded = data(Bundle(model=nn.Identity(), loader=loader, env=env, plan=self.plan)).loader
        assert isinstance(sharded, DeviceLoader)
        return _Tracked(sharded, self)

    # -- the step ----------------------------------------------------------------------------

    @property
    def _engine(self) -> Any:
        if self.bundle is None:
            raise RuntimeError("the model is not prepared yet")
        return self.bundle.engine

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward's autocast at the pipeline's precision (none where the engine casts
        parameters, or for fp32)."""
        from shardwise.step import forward_autocast

        if self.bundle is None:
            return contextlib.nullcontext()
        factory = forward_autocast(self.bundle.engine, self.bundle.plan.precision, self.env.device)
        return contextlib.nullcontext() if factory is None else factory()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loss.backward(**kwargs)
        self._synced = self._synced or not self._skipping

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Gradient reduction skipped for this micro-batch where the engine can."""
        from shardwise.state import TrainState

        # the engine asks whether a synchronised backward happened yet (DDP's static graph
        # needs one before it may skip a reduction)
        asked = attrs.evolve(TrainState(), synced=self._synced)
        no_sync = self._engine.no_sync(model, asked)
        if no_sync is None:
            yield
            return
        self._skipping = True
        try:
            with no_sync():
                yield
        finally:
            self._skipping = False

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """The engine's clipping (one norm over every rank's part); the norm before it."""
        return self._engine.clip(list(parameters), max_norm, norm_type)

    # -- evaluation --------------------------------------------------------------------------

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Every rank's values of the current batch, the padding of the active loader dropped."""
        if use_gather_object or not any(isinstance(leaf, torch.Tensor)
                                         for leaf in tree_flatten(input_data)[0]):
            if not (dist.is_initialized() and dist.get_world_size() > 1):
                return input_data
            parts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(parts, input_data)
            return [item for part in parts for item in (part if isinstance(part, list)
                                                       else [part])]
        leaves = tree_flatten(input_data)[0]
        if any(isinstance(leaf, torch.Tensor) and leaf.ndim == 0 for leaf in leaves):
            return self._gather_scalars(input_data)
        return gather_for_metrics(input_data, self.active)

    def _gather_scalars(self, input_data: Any) -> Any:
        """Per-rank scalars (TRL's token counts and accuracies), gathered as the Trainer on
        Accelerate gathers them, so its logs are the same: one value per rank, and at the end
        of a loader whose dataset leaves a remainder, only the first ``remainder`` values
        (Accelerate cuts every gathered tensor to the remainder's sample count, scalars too)."""
        from torch.utils._pytree import tree_map

        remainder = self._remainder() if self.gradient_state.end_of_dataloader else 0

        def one(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            if leaf.ndim:  # a batch's values: its padding dropped, as elsewhere
                return gather_for_metrics(leaf, self.active)
            values = gather_for_metrics(leaf.reshape(1), None)
            return values[:remainder] if remainder > 0 else values

        return tree_map(one, input_data)

    def _remainder(self) -> int:
        """Accelerate's ``remainder`` of the active loader: its dataset's samples past the last
        whole global batch (0 when they divide, or the loader drops its last batch)."""
        loader = self.active
        # a loader dealt by Accelerate's BatchSamplerShard keeps its sizes on that sampler
        sizes = loader if getattr(loader, "batch_size", None) is not None \
            else getattr(loader, "batch_sampler", None)
        if loader is None or sizes is None or getattr(sizes, "drop_last", False):
            return 0
        try:
            samples = len(loader.dataset)
        except TypeError:
            return 0
        ranks, _, _ = data_share(self.env, DistributeData.mesh(self.env, self.plan))
        return int(samples % ((getattr(sizes, "batch_size", None) or 1) * ranks))

    def gather(self, tensor: Any) -> Any:
        """Every rank's ``tensor`` concatenated along the first dimension (padding kept)."""
        return gather_for_metrics(tensor, None)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0,
                             pad_first: bool = False) -> Any:
        """``tensor`` padded along ``dim`` to the largest size any rank holds."""
        if not isinstance(tensor, torch.Tensor):
            if isinstance(tensor, (list, tuple)):
                return type(tensor)(self.pad_across_processes(t, dim, pad_index, pad_first)
                                    for t in tensor)
            if isinstance(tensor, dict):
                return {k: self.pad_across_processes(v, dim, pad_index, pad_first)
                        for k, v in tensor.items()}
            return tensor
        if not (dist.is_initialized() and dist.get_world_size() > 1) or tensor.ndim == 0:
            return tensor
        size = torch.tensor([tensor.shape[dim]], device=tensor.device)
        sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
        dist.all_gather(sizes, size)
        longest = int(max(s.item() for s in sizes))
        if longest == tensor.shape[dim]:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = longest
        padded = tensor.new_full(shape, pad_index)
        index = [slice(None)] * tensor.ndim
        start = longest - tensor.shape[dim] if pad_first else 0
        index[dim] = slice(start, start + tensor.shape[dim])
        padded[tuple(index)] = tensor
        return padded

    # -- models and memory -------------------------------------------------------------------

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> nn.Module:
        """The user's module inside the engine's wrapper (a model not prepared: itself)."""
        inner = model if self.bundle is None or model is not self.bundle.model else \
            self.bundle.engine.unwrap(model)
        if not keep_fp32_wrapper:
            restore_forward(inner)
        return inner

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The module's state dict, each tensor whole (gathered where sharded)."""
        if self.bundle is None or model not in (self.bundle.model,
                                                self.bundle.engine.unwrap(self.bundle.model)):
            return model.state_dict()
        return dict(self.bundle.engine.full_state(model))

    def free_memory(self, *objects: Any) -> list[Any]:
        """Forget the prepared model (the Trainer prepares again), collect garbage."""
        self.bundle, self.active = None, None
        self._models.clear()
        gc.collect()
        return [None] * len(objects)

    def wait_for_everyone(self) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def end_training(self) -> None:
        """Leave the process group, as Accelerate's does (``Trainer.end()`` at a script's end;
        trackers are the Trainer's callbacks): a background save is joined first."""
        leave_group()  # the group shardwise started: the ranks meet, then it is destroyed
        if dist.is_initialized():
            dist.destroy_process_group()
