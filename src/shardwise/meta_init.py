# init_on_meta(): only rank 0 materialises the weights; the others build the model on meta.
"""Loading a model larger than one process's share of host memory (Accelerate's
``fsdp_cpu_ram_efficient_loading``)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from shardwise.env import Env, detect
from shardwise.errors import CheckpointError

__all__ = ["init_on_meta", "is_rank0_weights", "materialise_from_rank0", "weights_pending",
           "read_pending_weights"]

_MARK = "_shardwise_rank0_weights"
_WEIGHTS = "_shardwise_weights_from"
M = TypeVar("M", bound=nn.Module)


def init_on_meta(factory: Callable[[], M], *, env: Env | None = None,
                 weights: str | os.PathLike[str] | None = None) -> M:
    """Build the model with real weights on rank 0 only; every other rank builds it on the
    meta device (no memory). ``shard()`` or ``replicate()`` then gives each rank its
    weights from rank 0: sharded ranks receive only their shards.

    With ``weights`` (a folder of Hugging Face safetensors), no rank holds the whole model
    at any time: every rank builds the parameters on the meta device (buffers real, so
    non-persistent ones such as a rotary embedding's are computed as usual), and the
    pipeline, once its transforms have spread the model (``shard``, ``tensor_parallel``,
    ``pipeline_parallel``), allocates each rank's parts and reads only those slices from the
    files (:func:`shardwise.load_pretrained`); under a layout that keeps the whole model on
    every rank (``replicate``) each rank reads it before the transforms.

    Args:
        factory: builds the model, e.g. ``lambda: AutoModelForCausalLM.from_pretrained(p)``:
            rank 0 loads the weights; on the other ranks (on every rank with ``weights``)
            Transformers' ``from_pretrained`` reads only the config and builds the same model
            on the meta device.
        env: defaults to :func:`shardwise.detect`.
        weights: the folder of safetensors files the pipeline reads the weights from.

    Raises:
        CheckpointError: ``weights`` is not a folder.

    Example:
        >>> model = sw.init_on_meta(lambda: MyModel(config))
        >>> bundle = sw.pipeline(sw.shard())(model, torch.optim.AdamW(model.parameters()))
        >>> model = sw.init_on_meta(lambda: AutoModelForCausalLM.from_pretrained(p), weights=p)
    """
    env = env or detect()
    if weights is not None:
        if not Path(weights).is_dir():
            raise CheckpointError(f"init_on_meta(weights={str(weights)!r}): not a folder of "
                                  "safetensors files")
        with _parameters_on_meta(), _from_pretrained_on_meta():
            model = factory()
        setattr(model, _WEIGHTS, Path(weights))
        return model
    if env.is_main:
        model = factory()
    else:
        with torch.device("meta"), _from_pretrained_on_meta():
            model = factory()
    setattr(model, _MARK, True)
    return model


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Inside it, every parameter a module registers moves to the meta device (a tied one,
    already there, stays the same object); buffers stay where they are made."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        held = module._parameters.get(name)
        if held is not None and not held.is_meta:
            module._parameters[name] = nn.Parameter(held.to("meta"),
                                                    requires_grad=held.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def weights_pending(model: nn.Module) -> Path | None:
    """The folder :func:`init_on_meta` was given for ``model``'s weights, until read."""
    return getattr(model, _WEIGHTS, None)


def read_pending_weights(model: nn.Module, root: nn.Module, env: Env, device: torch.device) -> None:
    """Allocate ``model``'s meta tensors on ``device`` (its real buffers kept) and read this
    rank's slices of the weights from the folder :func:`init_on_meta` was given; every rank
    calls it. ``root`` is the module the folder was recorded on.

    Raises:
        CheckpointError: files that do not fit the model (named), on every rank.
    """
    from shardwise.checkpoint.hf_files import agreed, export_state, read_hf_files

    folder = weights_pending(root)
    if folder is None:
        return
    delattr(root, _WEIGHTS)
    # every rank allocates, or all raise: the read below is a collective
    agreed(env, "cannot allocate the model's parts", lambda: _allocate(model, device))
    with torch.no_grad():
        read_hf_files(env, export_state(model, None), folder)


def _allocate(model: nn.Module, device: torch.device) -> None:
    """``model``'s meta tensors allocated (uninitialised) on ``device``; its real buffers
    kept, and a parameter two modules share (tied embeddings) still one after it
    (``to_empty`` gives each module a new one)."""
    kept = {(id(owner), name): buffer for owner in model.modules()
            for name, buffer in owner._buffers.items()
            if buffer is not None and not buffer.is_meta}
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in model.modules():
        for name, param in owner._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((owner, name))
    model.to_empty(device=device)
    for owner in model.modules():
        for name in owner._buffers:
            if (id(owner), name) in kept:
                owner._buffers[name] = kept[(id(owner), name)].to(device)
    for shared in places.values():
        first_owner, first_name = shared[0]
        for owner, name in shared[1:]:
            owner._parameters[name] = first_owner._parameters[first_name]


@contextlib.contextmanager
def _from_pretrained_on_meta() -> Iterator[None]:
    """Inside it, Transformers' ``from_pretrained`` builds the model from its config alone,
    on the meta device, reading no weight file (and not refusing the meta device, as
    Transformers 5 does when called under one)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:  # the factory cannot call it without importing it first
        try:
            import transformers
        except ImportError:
            yield
            return
    library: Any = transformers
    base = library.PreTrainedModel
    original = base.__dict__["from_pretrained"]
    major = int(str(library.__version__).split(".")[0])

    def from_config(cls: Any, path: str | os.PathLike[str], *args: Any, config: Any = None,
                    **kwargs: Any) -> Any:
        if config is None or isinstance(config, (str, os.PathLike)):
            config = cls.config_class.from_pretrained(config or path)
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if dtype is None and major < 5:  # 4.x loads in torch's default dtype, 5.x as saved
            dtype = torch.get_default_dtype()
        options = {} if dtype in (None, "auto") else {"dtype" if major >= 5 else "torch_dtype": dtype}
        model = cls._from_config(config, **options)
        model.eval()  # as from_pretrained returns it
        return model

    base.from_pretrained = classmethod(from_config)
    try:
        yield
    finally:
        base.from_pretrained = original


def is_rank0_weights(model: nn.Module) -> bool:
    """Whether :func:`init_on_meta` built ``model`` (its weights live on rank 0 only)."""
    return bool(getattr(model, _MARK, False))


def materialise_from_rank0(model: nn.Module, env: Env,
                           full: dict[str, torch.Tensor] | None) -> None:
    """Allocate meta tensors on ``env.device`` and fill every rank from rank 0.

    ``full`` is rank 0's full state dict taken before sharding (None elsewhere). Sharded
    parameters receive only their shards; buffers (also non-persistent ones) are broadcast.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not env.is_main:
        model.to_empty(device=env.device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    state: dict[str, Any] = dict(full) if env.is_main and full is not None else {}
    set_model_state_dict(model, state, options=options)
    for buffer in model.buffers():
        dist.broadcast(buffer.data, src=0)
    delattr(model, _MARK)
