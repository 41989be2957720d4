# The lifecycle matrix (tests/conftest.py's LAYOUTS, run by tests/distributed/test_lifecycle.py) holds every
# transform that distributes a model.
import pytest

import shardwise as sw

from conftest import LAYOUTS

pytest.importorskip("transformers")


def test_every_distributing_transform_is_in_the_matrix():
    """A transform that spreads the model over ranks, or keeps replicas in step, is a layout:
    the matrix must hold it (add one line to LAYOUTS)."""
    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    import shardwise.deepspeed_engine.transform  # noqa: F401  (its transform class)

    distributing = {cls for cls in subclasses(sw.transforms.Transform)  # shardwise's own
                    if cls.distributes and "factory_name" in vars(cls)
                    and cls.__module__.startswith("shardwise.")}
    covered = {type(part) for layout in LAYOUTS.values() for part in layout.parts}
    assert len(distributing) >= 8
    missing = sorted(cls.factory_name for cls in distributing - covered)
    assert missing == [], f"no lifecycle row for {missing}: add it to LAYOUTS"
