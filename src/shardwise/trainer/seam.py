# sw.Trainer and sw.on_shardwise: a Transformers Trainer whose distributed mechanics are a shardwise pipeline.
"""The Transformers Trainer on shardwise (needs ``transformers``).

The seam is the Trainer's own ``create_accelerator_and_postprocess``: it builds the object
the Trainer calls for every distributed mechanic. On shardwise it builds a
:class:`~shardwise.trainer.accelerator.ShardwiseAccelerator` from the same TrainingArguments
(read as :func:`shardwise.from_training_args` reads them, without the ``sw.fit`` options).
The prepared model's forward runs in the pipeline's precision with its outputs in fp32, as
Accelerate makes it (the Trainer's loss outside the model is fp32 on both), and a resumed
epoch starts part-way through its order (``get_resumed_dataloader``): two public hooks of
the Trainer. For a sharded model (FSDP2) four of its checkpoint steps (``_save``,
``_save_optimizer_and_scheduler``, ``_load_optimizer_and_scheduler``, ``_load_best_model``)
go through :mod:`shardwise.trainer.checkpoint_files`, which gathers whole tensors into the
Trainer's own files; with an unsharded model they are the Trainer's. The loop, callbacks,
compute_metrics, best model, early stopping, report_to and the checkpoint layout stay the
Trainer's.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import transformers

from shardwise._text import short
from shardwise.configured import trainer_pipeline
from shardwise.errors import ArgumentError, ConfigError, EnvError
from shardwise.trainer.accelerator import ShardwiseAccelerator
from shardwise.transforms.base import plan_for

__all__ = ["TESTED_TRANSFORMERS", "Trainer", "on_shardwise"]

#: the Transformers releases the Trainer on shardwise is tested with (major.minor)
TESTED_TRANSFORMERS = ("5.25",)


def _check_version(found: str = transformers.__version__) -> None:
    """Refuse a Transformers major version no test has run (its Trainer may ask its
    accelerator for what shardwise's does not answer)."""
    tested = {v.split(".")[0] for v in TESTED_TRANSFORMERS}
    if found.split(".")[0] not in tested:
        raise EnvError(f"transformers {found} is not a tested major version for the Trainer on "
                       f"shardwise (tested: {', '.join(TESTED_TRANSFORMERS)}); install "
                       f"transformers {'/'.join(sorted(tested))}.x, or train with sw.fit")


#: TrainingArguments whose engines do not run under the Trainer on shardwise yet
_NOT_YET = {
            "fp16": "fp16's loss scaler"}


def _refuse_not_yet(args: Any) -> None:
    from transformers.integrations import is_deepspeed_zero3_enabled

    if getattr(args, "deepspeed", None) and is_deepspeed_zero3_enabled():
        raise ConfigError.at("TrainingArguments", "deepspeed with zero_optimization.stage=3 is "
                             "not supported by the Trainer on shardwise: TrainingArguments turns "
                             "on DeepSpeed's zero.Init, so from_pretrained builds a model "
                             "DeepSpeed has partitioned; use fsdp=\"full_shard\" (FSDP2, the same "
                             "sharding) or stage 1/2")
    for name, what in _NOT_YET.items():
        value = getattr(args, name, None)
        if value not in (None, False, "", [], {}):
            raise ConfigError.at("TrainingArguments", f"{name}={short(value)} is not supported "
                                 f"by the Trainer on shardwise yet ({what}); use "
                                 "sw.from_training_args(args) with sw.fit, or the Trainer on "
                                 "Accelerate")


def _create_accelerator(self: Any) -> None:
    """The Trainer's ``create_accelerator_and_postprocess``, on shardwise."""
    _check_version()
    _refuse_not_yet(self.args)
    pipe = trainer_pipeline(self.args)
    if plan_for(pipe.env, pipe.transforms).size("cp") > 1:  # the Trainer's loss: whole sequences
        raise ConfigError.at("TrainingArguments", "parallelism_config's cp_size/sp_size is not "
                             "supported by the Trainer on shardwise yet (its compute_loss runs "
                             "the model on whole sequences, which context_parallel would split "
                             "without shifting the labels); use sw.from_training_args(args) "
                             "with sw.fit or your own loop")
    self.accelerator = ShardwiseAccelerator(pipe)
    self.gather_function = self.accelerator.gather_for_metrics
    if "use_gather_object" in inspect.signature(self.gather_function).parameters:
        self.gather_function = functools.partial(
            self.gather_function, use_gather_object=self.args.eval_use_gather_object)
    self.is_deepspeed_enabled = False
    self.is_fsdp_enabled = False
    if pipe.env.rank == 0:  # the Trainer's console: what runs, once, before training
        print(pipe.explain(), flush=True)


def _resumed(base: type) -> Any:
    def get_resumed_dataloader(self: Any, dataloader: Any, num_batches: int) -> Any:
        """The epoch resumed by shardwise's sampler, which starts part-way through the
        epoch's order (no batch is read to be skipped)."""
        if not hasattr(dataloader, "skip"):  # a loader the accelerator did not prepare
            return base.get_resumed_dataloader(self, dataloader, num_batches)  # type: ignore[attr-defined]
        return dataloader.skip(num_batches)
    return get_resumed_dataloader


def _checkpoints(base: type) -> dict[str, Any]:
    """The Trainer's checkpoints as transactions (:mod:`shardwise.trainer.transaction`:
    locked, checksummed, published in one rename, verified before a load), and four of its
    steps through :mod:`shardwise.trainer.checkpoint_files` when the model is sharded."""
    from shardwise.trainer import checkpoint_files as sharded_files
    from shardwise.trainer import transaction as transaction

    def _save(self: Any, output_dir: str | None = None, state_dict: Any = None) -> None:
        if not sharded_files.sharded(self):
            return base._save(self, output_dir, state_dict=state_dict)  # type: ignore[attr-defined]
        sharded_files.save_model_files(self, base._save, output_dir, state_dict)  # type: ignore[attr-defined]

    def _save_optimizer_and_scheduler(self: Any, output_dir: str) -> None:
        if not sharded_files.sharded(self):
            return base._save_optimizer_and_scheduler(self, output_dir)  # type: ignore[attr-defined]
        sharded_files.save_optimizer_and_scheduler(self, output_dir)

    def _load_optimizer_and_scheduler(self: Any, checkpoint: str | None) -> None:
        if not sharded_files.sharded(self):
            return base._load_optimizer_and_scheduler(self, checkpoint)  # type: ignore[attr-defined]
        sharded_files.load_optimizer_and_scheduler(self, checkpoint)

    def _load_best_model(self: Any) -> None:
        transaction.verify_checkpoint(self, self.state.best_model_checkpoint, resuming=False)
        if not sharded_files.sharded(self):
            return base._load_best_model(self)  # type: ignore[attr-defined]
        sharded_files.load_best_model(self)

    def _save_checkpoint(self: Any, model: Any, trial: Any) -> None:
        transaction.save_checkpoint(self, base._save_checkpoint, model, trial)  # type: ignore[attr-defined]

    def _load_from_checkpoint(self: Any, resume_from_checkpoint: str, model: Any = None) -> None:
        transaction.verify_checkpoint(self, resume_from_checkpoint)
        if sharded_files.deferred_weights(self, resume_from_checkpoint, model):
            return  # read into each rank's shards once the pipeline has distributed the model
        base._load_from_checkpoint(self, resume_from_checkpoint, model)  # type: ignore[attr-defined]

    return {"_save": _save, "_save_optimizer_and_scheduler": _save_optimizer_and_scheduler,
            "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler,
            "_load_best_model": _load_best_model, "_save_checkpoint": _save_checkpoint,
            "_load_from_checkpoint": _load_from_checkpoint}


def on_shardwise(cls: type) -> type:
    """``cls`` (``transformers.Trainer`` or a subclass: TRL's SFTTrainer, your own) with its
    distributed mechanics run by shardwise instead of Accelerate.

    The pipeline is ``sw.from_training_args(trainer.args)``: DDP, FSDP2, precision,
    accumulation and clipping as the arguments say, and the loaders distributed by
    shardwise's resumable sampler. The Trainer's loop, callbacks and checkpoints stay.

    Raises:
        ArgumentError: ``cls`` is not a Trainer class.
        EnvError: an untested major version of Transformers (when the Trainer is built).

    Example:
        >>> from trl import SFTTrainer
        >>> trainer = sw.on_shardwise(SFTTrainer)(model=model, args=args, train_dataset=data)
        >>> trainer.train()
    """
    if not (isinstance(cls, type) and issubclass(cls, transformers.Trainer)):
        raise ArgumentError(f"on_shardwise() takes transformers.Trainer or a subclass (got "
                            f"{cls!r})")
    if getattr(cls, "_on_shardwise", False):
        return cls
    namespace = {"create_accelerator_and_postprocess": _create_accelerator,
                 "get_resumed_dataloader": _resumed(cls), **_checkpoints(cls),
                 "_on_shardwise": True,
                 "__module__": cls.__module__, "__doc__": cls.__doc__}
    return type(cls.__name__, (cls,), namespace)


#: ``transformers.Trainer`` on shardwise: ``sw.Trainer(model=..., args=..., ...)`` as the
#: Trainer is called (the same arguments), its distributed mechanics run by shardwise
Trainer = on_shardwise(transformers.Trainer)
Trainer.__module__, Trainer.__qualname__ = __name__, "Trainer"
Trainer.__doc__ = """``transformers.Trainer`` with its distributed mechanics run by shardwise
    instead of Accelerate: called with the Trainer's own arguments (see its documentation);
    the pipeline comes from ``args`` as :func:`shardwise.from_training_args` reads them.

    Example:
        >>> trainer = sw.Trainer(model=model, args=args, train_dataset=train,
        ...                      eval_dataset=val, compute_metrics=compute_metrics)
        >>> trainer.train()
    """
