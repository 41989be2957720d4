# compile(): regional torch.compile — each repeated block compiled once and reused — or the whole model.
"""``torch.compile`` as a transform, in torchtitan's order (after activation checkpointing,
before FSDP2/DDP)."""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
from collections.abc import Mapping
from types import FrameType
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


#: backends torch lists whose package is imported only when they first compile: the packages
_PACKAGES = {"tvm": ("tvm",), "openxla": ("torch_xla",), "openxla_eval": ("torch_xla",),
             "onnxrt": ("onnxruntime", "onnx", "onnxscript"), "tensorrt": ("torch_tensorrt",),
             "torch_tensorrt": ("torch_tensorrt",), "ipex": ("intel_extension_for_pytorch",)}


def backends() -> list[str]:
    """The backends torch.compile knows here (importing torch._dynamo: about a second)."""
    import torch._dynamo

    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def unusable(backend: str) -> str | None:
    """Why a backend torch lists cannot compile here (None: it can). torch lists a backend
    whose package is missing (``tvm``, ``openxla``, ...) and fails only at the first forward;
    an entry-point backend whose package is broken fails when it is looked up."""
    import torch._dynamo

    missing = [name for name in _PACKAGES.get(backend, ()) if importlib.util.find_spec(name) is None]
    if missing:
        return f"its package {', '.join(missing)} is not installed"
    try:
        torch._dynamo.lookup_backend(backend)
    except Exception as exc:  # a plugin's own import error, whatever its type
        return f"it fails to load ({type(exc).__name__}: {short(str(exc))})"
    return None


def _usable(known: list[str]) -> list[str]:
    """The backends of ``known`` that compile here (torch's own test-only ones left out)."""
    return [b for b in known if not b.endswith("_TESTING_ONLY") and unusable(b) is None]


def _region(scope: Any) -> nn.Module | None:
    """The region ``compile`` marked that a compiled frame's locals belong to: their ``self``,
    or the module of a bound method among them (a checkpointed block's frame is
    ``_checkpointed(forward, ...)``); None when none is one of shardwise's regions."""
    if not isinstance(scope, Mapping):
        return None
    for value in (scope.get("self"), *scope.values()):
        module = getattr(value, "__self__", value)
        if isinstance(module, nn.Module) and isinstance(getattr(module, _MARK, None), str):
            return module
    return None


def _compiling_region() -> nn.Module | None:
    """The region torch is compiling now, called from within torch's logging below its
    ``_compile(code, globals, locals, ..., frame)``; None when it is not one of shardwise's."""
    caller: FrameType | None = sys._getframe(1)
    for _ in range(64):  # torch's compile call is a few frames above its logging calls
        if caller is None:
            return None
        seen = caller.f_locals
        for scope in (seen.get("locals"), getattr(seen.get("frame"), "f_locals", None)):
            module = _region(scope)
            if module is not None:
                return module
        caller = caller.f_back
    return None


class _RecompileLimitWatch(logging.Handler):
    """For the ``torch._dynamo`` logger: re-states torch's warning that a compiled frame hit
    the recompile limit naming the block, and what happens next; torch's message still goes
    where it went."""

    _HIT = re.compile(r"hit config\.(\w+) \((\d+)\)")
    _REASON = re.compile(r"last reason: (.*)")

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        hit = self._HIT.search(text)
        module = _compiling_region() if hit else None
        if hit is None or module is None:
            return
        reason = self._REASON.search(text)
        guard = reason.group(1).strip() if reason else "not reported by torch"
        log.warning("compile(): %s (%s) hit torch's recompile limit (torch._dynamo.config.%s="
                    "%s); the guard that changed: %s. From now on torch compiles no new graph "
                    "for its code (which identical blocks share) and runs it eagerly whenever "
                    "none of its compiled graphs fits (with fullgraph=True it raises instead). "
                    "Keep that input steady (pad to fixed shapes), pass compile(dynamic=True) "
                    "for changing sizes, or raise the limit",
                    getattr(module, _MARK) or "the model", type(module).__name__,
                    hit.group(1), hit.group(2), guard)


def _watch_recompile_limit() -> None:
    """Adds the watch to the ``torch._dynamo`` logger once per process (loggers are global)."""
    dynamo = logging.getLogger("torch._dynamo")
    if not any(isinstance(h, _RecompileLimitWatch) for h in dynamo.handlers):
        dynamo.addHandler(_RecompileLimitWatch())


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
        """Raises ArgumentError for a backend torch.compile does not know here, or one it
        lists whose package is missing (it would fail only at the first forward)."""
        known = backends()
        if self.backend not in known:
            raise ArgumentError(f"compile() 'backend' {self.backend!r} is not a torch.compile "
                                f"backend here; accepted: {', '.join(known)}")
        why = unusable(self.backend)
        if why is not None:
            raise ArgumentError(f"compile() 'backend' {self.backend!r} cannot compile here: "
                                f"{why}; backends that work here: {', '.join(_usable(known))}; "
                                "install its package, or choose one of those")

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
        _watch_recompile_limit()
        for name, module in self.regions(bundle.model):
            if getattr(module, _MARK, None) is not None:
                raise ConflictError(f"{self!r}: {name or 'the model'} ({type(module).__name__}) "
                                    "is compiled already")
            module.compile(**self.options())  # in place: names and the module tree unchanged
            setattr(module, _MARK, name)  # the region's name, for the recompile-limit warning
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
