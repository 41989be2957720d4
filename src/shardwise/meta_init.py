# init_on_meta(): only rank 0 materialises the weights; the others build the model on meta.
"""Loading a model larger than one process's share of host memory (Accelerate's
``fsdp_cpu_ram_efficient_loading``)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from shardwise.env import Env, detect

__all__ = ["init_on_meta", "is_rank0_weights", "materialise_from_rank0"]

_MARK = "_shardwise_rank0_weights"
M = TypeVar("M", bound=nn.Module)


def init_on_meta(factory: Callable[[], M], *, env: Env | None = None) -> M:
    """Build the model with real weights on rank 0 only; every other rank builds it on the
    meta device (no memory). ``shard()`` or ``replicate()`` then gives each rank its
    weights from rank 0: sharded ranks receive only their shards.

    Args:
        factory: builds the model, e.g. ``lambda: AutoModelForCausalLM.from_pretrained(p)``:
            rank 0 loads the weights; on the other ranks Transformers' ``from_pretrained``
            reads only the config and builds the same model on the meta device.
        env: defaults to :func:`shardwise.detect`.

    Example:
        >>> model = sw.init_on_meta(lambda: MyModel(config))
        >>> bundle = sw.pipeline(sw.shard())(model, torch.optim.AdamW(model.parameters()))
    """
    env = env or detect()
    if env.is_main:
        model = factory()
    else:
        with torch.device("meta"), _from_pretrained_on_meta():
            model = factory()
    setattr(model, _MARK, True)
    return model


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
