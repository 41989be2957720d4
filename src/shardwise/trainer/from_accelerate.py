# What of Accelerate itself the Trainer seam uses: its state as state only, its batch split, refusals.
"""Accelerate's own pieces the Trainer on shardwise relies on, kept apart from the
accelerator object (``trainer/accelerator.py``): Accelerate's ``AcceleratorState``
initialised as state only (TRL's ``accelerate.utils`` helpers ask it), its
``DataLoaderConfiguration`` describing shardwise's loaders, its ``BatchSamplerShard`` for a
loader on a trainer's own sampler, and what the accelerator refuses by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import MethodType
from typing import Any

from torch import nn
from torch.utils.data import DataLoader

from shardwise.data import DeviceLoader
from shardwise.env import variables_hidden
from shardwise.parallel.mesh import data_share
from shardwise.transforms.data_distribution import DistributeData

__all__ = ["REFUSED", "accelerate_precision", "amp_forward", "bridge_accelerate_state",
           "dataloader_config", "foreign_sampler", "restore_forward", "skip_batches",
           "split_as_accelerate"]


#: what the Trainer's accelerator refuses by name, and which feature would need it
REFUSED = {
    "deepspeed_ulysses_dl_adapter": "DeepSpeed's Ulysses sequence parallelism "
    "(parallelism_config sp_backend='deepspeed') is not run by the Trainer on shardwise; use "
    "sw.context_parallel() in a loop of your own",
    "save_state": "Accelerate's own checkpoint format is not written by shardwise; the Trainer "
    "saves its checkpoints itself (as transactions), and sw.save writes shardwise's",
    "load_state": "Accelerate's own checkpoint format is not read by shardwise; resume with "
    "trainer.train(resume_from_checkpoint=...)",
    "accumulate": "the Trainer runs its own accumulation windows; a loop of your own uses "
    "sw.accumulate_gradients(n)",
}


def amp_forward(model: nn.Module,
                autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None) -> None:
    """``model.forward`` as Accelerate's mixed precision makes it: run under ``autocast``
    (none where the engine casts the parameters) and every bf16/fp16 tensor it returns in
    fp32, so a loss the Trainer or TRL computes outside the model (a reward model's, a
    preference loss) is computed in fp32 as on Accelerate."""
    from accelerate.utils import convert_to_fp32

    restore_forward(model)  # prepared again (for evaluation first, then for training)
    original = model.forward
    # the function, called on ``self``: a deep copy of the model runs its own parameters
    function = original.__func__ if isinstance(original, MethodType) and \
        original.__self__ is model else None

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with contextlib.nullcontext() if autocast is None else autocast():
            out = original(*args, **kwargs) if function is None else \
                function(self, *args, **kwargs)
        return convert_to_fp32(out)

    model._shardwise_forward = original  # type: ignore[assignment]
    model.forward = MethodType(forward, model)


def restore_forward(model: nn.Module) -> None:
    """Undo :func:`amp_forward` (``unwrap_model(keep_fp32_wrapper=False)``)."""
    original = getattr(model, "_shardwise_forward", None)
    if original is not None:
        model.forward = original
        del model._shardwise_forward


def accelerate_precision(precision: str | None) -> str:
    return {"bf16": "bf16", "fp16": "fp16"}.get(precision or "", "no")


def bridge_accelerate_state(env: Any, precision: str | None) -> None:
    """Accelerate's ``AcceleratorState`` initialised as state only, from the process group
    TrainingArguments started (its ``PartialState``) and the pipeline's precision, with no
    plugin: TRL calls ``accelerate.utils`` helpers (``gather_object``,
    ``broadcast_object_list``) that ask it, and nothing of Accelerate decides placement,
    precision or wrapping (no ``Accelerator`` is built, nothing is prepared by it)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import TorchDynamoPlugin

    if not PartialState._shared_state:
        PartialState(cpu=env.device.type == "cpu")
    wanted = accelerate_precision(precision)
    if not AcceleratorState._shared_state:
        with variables_hidden(*_PLUGIN_SWITCHES):
            AcceleratorState(mixed_precision=wanted, cpu=env.device.type == "cpu",
                             dynamo_plugin=TorchDynamoPlugin(backend="no"),
                             _from_accelerator=True)
    AcceleratorState._shared_state["_mixed_precision"] = wanted


#: what `accelerate launch` sets to make AcceleratorState build its FSDP, DeepSpeed or
#: Megatron plugin; shardwise's launcher reader has mapped them onto its own transforms
_PLUGIN_SWITCHES = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_MEGATRON_LM")


def dataloader_config() -> Any:
    """Accelerate's ``DataLoaderConfiguration`` saying what shardwise's loaders do: every
    rank reads its own whole batches (no dispatch from rank 0, no split of one batch)."""
    from accelerate.utils import DataLoaderConfiguration

    return DataLoaderConfiguration(split_batches=False, dispatch_batches=False,
                                   even_batches=True)


def foreign_sampler(loader: DataLoader) -> bool:
    """Whether ``loader`` draws from a sampler of a trainer's own (TRL's ``RepeatSampler``,
    which repeats each prompt for its generations), which shardwise's split cannot rebuild."""
    from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

    return loader.batch_size is not None and not isinstance(
        loader.sampler, (RandomSampler, SequentialSampler, DistributedSampler))


def split_as_accelerate(loader: DataLoader, env: Any, plan: Any) -> DeviceLoader:
    """``loader``'s own batches dealt to the data ranks in turn by Accelerate's
    ``BatchSamplerShard`` (the split the Trainer on Accelerate gives it: whole batches,
    every rank's last one full), its sampler kept as the trainer built it. Mid-epoch it
    resumes as on Accelerate (:func:`skip_batches`)."""
    from accelerate.data_loader import BatchSamplerShard

    shares, share, _ = data_share(env, DistributeData.mesh(env, plan))
    batches = BatchSamplerShard(loader.batch_sampler, num_processes=shares,
                                process_index=share, split_batches=False, even_batches=True)
    return DeviceLoader(_rebatched(loader, batches), env.device)


def skip_batches(loader: DeviceLoader, count: int) -> DeviceLoader:
    """One epoch of a :func:`split_as_accelerate` loader without its first ``count`` batches:
    their indices drawn from the sampler and dropped, no sample read, as Accelerate's
    ``skip_first_batches`` resumes the Trainer mid-epoch (the sampler's order is its own:
    mid first epoch the run continues exactly; later, as on Accelerate, the new sampler
    starts its draws again)."""
    from accelerate.data_loader import SkipBatchSampler

    inner = loader.loader
    assert isinstance(inner, DataLoader)
    return DeviceLoader(_rebatched(inner, SkipBatchSampler(inner.batch_sampler, count)),
                        loader.device)


def _rebatched(loader: DataLoader, batches: Any) -> DataLoader:
    return DataLoader(loader.dataset, batch_sampler=batches, num_workers=loader.num_workers,
                      collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                      timeout=loader.timeout, worker_init_fn=loader.worker_init_fn)
