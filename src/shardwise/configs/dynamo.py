# Accelerate's dynamo_config and TrainingArguments' torch_compile* mapped onto sw.compile().
"""Compile settings from configs -> ``compile(...)``.

Accelerate's ``dynamo_config`` (``dynamo_backend``, ``dynamo_mode``, ``dynamo_use_fullgraph``,
``dynamo_use_dynamic``, ``dynamo_use_regional_compilation``; the ``ACCELERATE_DYNAMO_*``
variables and ``--dynamo_backend`` say the same) and TrainingArguments' ``torch_compile``,
``torch_compile_backend``, ``torch_compile_mode``. Both compile the whole model unless told
otherwise (Accelerate's default, and the Trainer's), so ``regional`` follows what they say.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardwise._config_source import Source
from shardwise.transforms.base import Transform
from shardwise.transforms.compile_blocks import MODES, backends, compile, unusable

__all__ = ["KEYS", "dynamo_transforms", "compile_of"]

KEYS = {"dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic",
        "dynamo_use_regional_compilation"}


def compile_of(src: Source, backend: Any, mode: Any, *, where: str, fullgraph: bool = False,
               dynamic: bool | None = None, regional: bool = False) -> Transform:
    """``compile(...)`` for a backend and mode as configs write them (any case; mode
    ``default`` or none)."""
    name = src.text(f"{where}backend", backend).strip().lower()
    known = backends()
    if name not in known:
        raise src.fail(f"{where}backend", backend, f"a torch.compile backend here: {', '.join(known)}"
                       " (or no)")
    problem = unusable(name)
    if problem is not None:
        raise src.fail(f"{where}backend", backend, f"a backend that compiles here ({name} cannot: "
                       f"{problem}), or no")
    chosen = None
    if mode is not None:
        chosen = src.choice(f"{where}mode", mode, [m.upper() for m in MODES]).lower()
    return src.build(f"{where}backend", backend, compile, None, backend=name,
                     mode=None if chosen == "default" else chosen, fullgraph=fullgraph,
                     dynamic=dynamic, regional=regional)


def dynamo_transforms(src: Source, block: Mapping[str, Any],
                      where: str = "dynamo_config.") -> list[Transform]:
    """The ``dynamo_config`` block: ``compile(...)``, or nothing for backend ``no``."""
    src.check_keys(block, KEYS, where.rstrip("."))
    backend = block.get("dynamo_backend")
    if backend is None or (isinstance(backend, str) and backend.strip().lower() in ("no", "")) \
            or backend is False:
        return []

    def flag(key: str, default: bool) -> bool:
        value = block.get(key)
        return default if value is None else src.boolean(f"{where}{key}", value)

    dynamic = block.get("dynamo_use_dynamic")
    return [compile_of(src, backend, block.get("dynamo_mode"), where=f"{where}dynamo_",
                       fullgraph=flag("dynamo_use_fullgraph", False),
                       dynamic=None if dynamic is None else src.boolean(
                           f"{where}dynamo_use_dynamic", dynamic),
                       regional=flag("dynamo_use_regional_compilation", False))]
