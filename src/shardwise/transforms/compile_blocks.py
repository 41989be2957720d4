# compile(): regional torch.compile — each repeated block compiled once and reused — or the whole model.
"""``torch.compile`` as a transform, in torchtitan's order (after activation checkpointing,
before FSDP2/DDP)."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import attrs
from torch import nn

from shardwise._text import short
from shardwise.bundle import Bundle
from shardwise.env import Env
from shardwise.errors import ArgumentError, ConflictError
from shardwise.policies import Policy, select
from shardwise.transforms._checks import boolean, optional_boolean, to_policy
from shardwise.transforms.base import Stage, Transform

__all__ = ["Compile", "compile", "MODES"]

log = logging.getLogger(__name__)

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_MARK = "_shardwise_compiled"


def _mode(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and value not in MODES:
        raise ArgumentError(f"compile() 'mode' must be None or one of {', '.join(MODES)} "
                            f"(got {short(value)})")


def _backend(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ArgumentError(f"compile() 'backend' must be a torch.compile backend name such as "
                            f"'inductor', 'aot_eager' or 'eager' (got {short(value)})")


def backends() -> list[str]:
    """The backends torch.compile knows here (importing torch._dynamo: about a second)."""
    import torch._dynamo

    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def _no_training_cache(model: nn.Module) -> None:
    """A Transformers model builds a KV cache in every forward while ``config.use_cache`` is
    True, training too; each layer then fills a different cache slot and is compiled again
    (one graph per layer, and past torch's recompile limit the rest run eagerly). Training
    never reads it: it is switched off, as Transformers does for gradient checkpointing."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) is True:
        config.use_cache = False  # type: ignore[union-attr]
        log.warning("compile(): %s.config.use_cache set to False (a KV cache built in training "
                    "forwards makes every layer a new graph); set it back before generate()",
                    type(model).__name__)


@attrs.frozen(repr=False)
class Compile(Transform):
    """Compile the model with ``torch.compile``: by default regionally, each block the policy
    selects compiled in place (``nn.Module.compile``), so identical blocks share one compiled
    graph and the cold start does not grow with the number of layers.

    Applied after ``checkpoint_activations`` (a checkpointed block is compiled with its
    recomputation) and before ``shard``/``replicate``/``tensor_parallel``'s wrappers run
    (torchtitan's order); parameter names do not change, so checkpoints and exports are the
    same as without it. In one process it compiles too.

    Args:
        policy: the blocks to compile (regional); default :func:`shardwise.auto`.
        mode: torch.compile's mode (``"default"``, ``"reduce-overhead"``, ``"max-autotune"``,
            ``"max-autotune-no-cudagraphs"``) or None.
        dynamic: torch.compile's ``dynamic`` (None: decided by torch on a recompile).
        fullgraph: refuse graph breaks inside a compiled region.
        backend: a torch.compile backend (``"inductor"``, ``"aot_eager"``, ``"eager"``, ...).
        regional: ``False`` compiles the whole model as one region (``model.compile()``).

    Example:
        >>> pipe = sw.pipeline(sw.compile(), sw.shard())   # each LlamaDecoderLayer compiled once
    """

    policy: Policy = attrs.field(default=None, converter=lambda value: to_policy(value, "compile"))
    mode: str | None = attrs.field(default=None, kw_only=True, validator=_mode)
    dynamic: bool | None = attrs.field(default=None, kw_only=True, validator=optional_boolean)
    fullgraph: bool = attrs.field(default=False, kw_only=True, validator=boolean)
    backend: str = attrs.field(default="inductor", kw_only=True, validator=_backend)
    regional: bool = attrs.field(default=True, kw_only=True, validator=boolean)
    stage: ClassVar[Stage] = Stage.COMPILE
    factory_name: ClassVar[str] = "compile"

    def check(self, env: Env) -> None:
        """Raises ArgumentError for a backend torch.compile does not know here."""
        known = backends()
        if self.backend not in known:
            raise ArgumentError(f"compile() 'backend' {self.backend!r} is not a torch.compile "
                                f"backend here; accepted: {', '.join(known)}")

    def excludes(self) -> dict[str, str]:
        out = {"deepspeed": "DeepSpeed's engine wraps and drives the model itself; shardwise "
               "does not compile under it (untested here): drop one, or compile the model "
               "before passing it"}
        if self.backend != "eager":
            out["tensor_parallel"] = (
                f"blocks of a tensor-parallel model compiled with the {self.backend!r} backend "
                "fail in backward on torch 2.13 (AOTAutograd hands DTensor's redistribute a "
                "plain tensor: 'Tensor' object has no attribute '_local_tensor'); "
                "backend='eager' (dynamo alone) works, or drop one of them")
        return out

    def options(self) -> dict[str, Any]:
        """The keyword arguments handed to torch.compile."""
        return {"backend": self.backend, "mode": self.mode, "dynamic": self.dynamic,
                "fullgraph": self.fullgraph}

    def regions(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The modules compiled: the policy's blocks, or the model itself."""
        if not self.regional:
            return [("", model)]
        return select(self.policy, model, user=repr(self))

    def __call__(self, bundle: Bundle) -> Bundle:
        bundle = self._record(bundle)
        _no_training_cache(bundle.model)
        for name, module in self.regions(bundle.model):
            if getattr(module, _MARK, False):
                raise ConflictError(f"{self!r}: {name or 'the model'} ({type(module).__name__}) "
                                    "is compiled already")
            module.compile(**self.options())  # in place: names and the module tree unchanged
            setattr(module, _MARK, True)
        return bundle

    def describe(self, env: Env) -> str:
        options = f"backend {self.backend}" + (f", mode {self.mode}" if self.mode else "") + \
            (", fullgraph" if self.fullgraph else "") + \
            (f", dynamic={self.dynamic}" if self.dynamic is not None else "")
        if not self.regional:
            return (f"torch.compile of the whole model as one region ({options}); a "
                    "Transformers model's config.use_cache is set to False")
        return (f"regional torch.compile: each block chosen by {self.policy!r} compiled in place, "
                f"identical blocks sharing one graph (compiled once per distinct block); "
                f"{options}; parameter names unchanged; a Transformers model's "
                "config.use_cache is set to False (no KV cache in training forwards)")


#: the public factory: the class itself, so its defaults are written once
compile = Compile  # noqa: A001
