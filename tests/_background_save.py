# A background save's training and resume runs, for one process and for ranks alike.
"""Shared by tests/unit/test_background_save.py and tests/distributed/test_async_save.py:
:func:`train` and :func:`resume` are what each rank runs there (``run_distributed`` pickles
them by reference, so they live in a module the ranks import by name)."""

import shardwise as sw
from shardwise.testing import full_state

from conftest import build_lm

STEPS = 6


def batches_of(bundle):
    while True:
        yield from bundle.loader


def train(path, parts, blocking):
    """6 optimizer steps; saves at steps 2 and 4 (keep_last=1). Returns the weights as they
    were when each save was asked for, and at the end."""
    bundle = build_lm(parts)
    state, asked, handles = bundle.init(), {}, []
    batches = batches_of(bundle)
    while state.step < STEPS:
        state, out = bundle.step(state, next(batches))
        if out.stepped and state.step in (2, 4):
            state = bundle.check(state)
            asked[state.step] = full_state(bundle.model)
            handles.append(sw.save(path, bundle, state, keep_last=1, blocking=blocking))
    state = bundle.check(state)
    first_done_when_second_returned = handles[0].done() if not blocking else True
    published = [h.result() if not blocking else h for h in handles]
    return {"asked": asked, "end": full_state(bundle.model), "published": [p.name for p in published],
            "first_done": first_done_when_second_returned,
            "handle": repr(handles[-1]) if not blocking else ""}


def resume(path, parts):
    bundle = build_lm(parts)
    state = sw.load(path, bundle)
    loaded = full_state(bundle.model)
    batches = batches_of(bundle)
    while state.step < STEPS:
        state, _ = bundle.step(state, next(batches))
    bundle.check(state)
    return {"step_loaded": sw.latest_checkpoint(path).name, "loaded": loaded,
            "end": full_state(bundle.model)}
