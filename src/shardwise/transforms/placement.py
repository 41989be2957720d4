# place(): move the model to the env's device and keep the optimizer bound to its parameters.
"""Placement (the pipeline adds it; usable alone)."""

from __future__ import annotations

from typing import ClassVar

import attrs

from shardwise._params import param_names, rebind_optimizer, unwrap
from shardwise.bundle import Bundle
from shardwise.env import Env
from shardwise.meta_init import weights_pending
from shardwise.transforms.base import Stage, Transform

__all__ = ["Place", "place"]


@attrs.frozen(repr=False)
class Place(Transform):
    """Move the model to ``bundle.env.device`` and re-bind the optimizer's param groups.

    Every pipeline applies it; an optimizer that already holds state is refused.

    Example:
        >>> bundle = sw.place()(sw.Bundle(model, optimizer, env=sw.detect()))
    """

    stage: ClassVar[Stage] = Stage.PLACEMENT
    factory_name: ClassVar[str] = "place"

    def __call__(self, bundle: Bundle) -> Bundle:
        bundle = self._record(bundle)
        if bundle.engine.owns_optimizer:
            return bundle
        names = param_names(bundle.model)
        # a model whose weights init_on_meta(weights=) reads later is allocated then
        if not bundle.engine.places_parameters and weights_pending(unwrap(bundle.model)) is None:
            bundle.model.to(bundle.env.device)
        rebind_optimizer(bundle.optimizer, names, bundle.model)
        return bundle

    def describe(self, env: Env) -> str:
        return f"model on {env.device}; optimizer param groups re-bound to its parameters"


#: the public factory: the class itself, so its defaults are written once
place = Place
