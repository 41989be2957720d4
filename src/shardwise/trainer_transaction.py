# The Trainer's checkpoint-N folders as shardwise transactions: locked, checksummed, published in one rename.
"""What the Trainer on shardwise does around the Trainer's own ``_save_checkpoint`` and loads.

The Trainer writes ``output_dir/checkpoint-N`` file by file and deletes old ones with
``rmtree``: a crash leaves a half-written folder that ``resume_from_checkpoint=True`` then
picks, and two jobs on one ``output_dir`` write into each other. On shardwise a save is the
same transaction as ``sw.save``'s (:mod:`shardwise.checkpoint.transaction`):

1. rank 0 takes ``output_dir``'s writer lock (another writer is named and refused), puts
   back or clears what an interrupted save left, and makes ``.tmp.checkpoint-N``;
2. the Trainer's own ``_save_checkpoint`` writes ``checkpoint-N`` inside it (its files,
   layout, best-model tracking and ``trainer_state.json`` unchanged);
3. rank 0 writes ``checksums.json`` (a SHA-256 of every file, sealed), renames the folder to
   ``checkpoint-N`` (a re-save of step N sets the published one aside first, never deleting
   it before), and applies ``save_total_limit`` as the Trainer does, each deletion a rename
   out of the published names first.

Before the Trainer loads a checkpoint (``resume_from_checkpoint``,
``load_best_model_at_end``) every rank verifies its files against ``checksums.json``: a
flipped bit, a missing or extra-linked file, a forged manifest is a ``CheckpointError``
naming the file. A folder without ``checksums.json`` (written by the Trainer on Accelerate)
loads unverified, with a warning.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from shardwise.checkpoint.integrity import MANIFEST, digest_in, manifest, verify
from shardwise.checkpoint.layout import write_durably
from shardwise.checkpoint.transaction import (
    TMP,
    PublishedError,
    begin,
    describe_os_error,
    publish,
    retire,
)
from shardwise.distributed import all_agree, from_main
from shardwise.errors import CheckpointError

__all__ = ["save_checkpoint", "verify_checkpoint"]

log = logging.getLogger("shardwise.checkpoint")

#: the Trainer's names (transformers.trainer_utils.PREFIX_CHECKPOINT_DIR and
#: transformers.trainer.TRAINER_STATE_NAME), fixed by its checkpoint layout
PREFIX, TRAINER_STATE = "checkpoint", "trainer_state.json"


def save_checkpoint(trainer: Any, base_save: Any, model: Any, trial: Any) -> None:
    """The Trainer's ``_save_checkpoint`` (``base_save``) as a transaction on its run
    directory; every rank calls it.

    Raises:
        CheckpointError: on every rank: another writer holds the directory, or writing or
            publishing failed (the checkpoints before it are intact), or what followed the
            publishing failed (the checkpoint is published).
    """
    env = trainer.accelerator.env
    run_dir = Path(trainer._get_output_dir(trial=trial))
    name = f"{PREFIX}-{trainer.state.global_step}"
    final, stage = run_dir / name, run_dir / f"{TMP}{name}"
    lock = begin(env, run_dir, stage, names=f"{PREFIX}-*")
    try:
        ok, problem = True, ""
        try:
            _write_staged(trainer, base_save, model, trial, run_dir, stage)
        except Exception as exc:  # every rank learns of it below: none waits for the others
            ok, problem = False, (describe_os_error(exc) if isinstance(exc, OSError)
                                  else f"{type(exc).__name__}: {exc}")
        if not all_agree(env, ok):
            raise CheckpointError(f"writing checkpoint {final} failed ({problem or 'on another rank'}); "
                                  "the checkpoints before it are intact")
        ok, problem = True, ""
        if env.is_main:
            try:
                sizes = _seal(stage / name)
                publish(run_dir, stage / name, final, trainer.state.global_step, None, sizes,
                        point_latest=False)
                stage.rmdir()
                _rotate(run_dir, trainer.args.save_total_limit, trainer.state.best_model_checkpoint)
            except PublishedError as exc:
                ok, problem = False, str(exc)
            except OSError as exc:
                published = final.is_dir() and not stage.joinpath(name).exists()
                ok, problem = False, (
                    f"checkpoint {final} was published (it loads), but what followed failed "
                    f"({describe_os_error(exc)})" if published else
                    f"publishing checkpoint {final} failed ({describe_os_error(exc)}); the "
                    "checkpoints before it are intact")
        if not all_agree(env, ok):  # nobody goes on before the checkpoint is visible
            raise CheckpointError(from_main(env, problem))
    finally:
        if lock is not None:
            lock.release()


def _write_staged(trainer: Any, base_save: Any, model: Any, trial: Any, run_dir: Path,
                  stage: Path) -> None:
    """The Trainer's own save, into ``stage``; its best checkpoint named as it will be
    published (the Trainer names what it finds under its run directory)."""
    trainer._get_output_dir = lambda trial=None: str(stage)  # read once by its save
    try:
        base_save(trainer, model, trial)
    finally:
        del trainer._get_output_dir
    state, args = trainer.state, trainer.args
    best = state.best_global_step
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if best and strategy in ("steps", "epoch", "best"):
        found = [d for d in (stage, run_dir) if (d / f"{PREFIX}-{best}").is_dir()]
        if found:
            state.best_model_checkpoint = str(run_dir / f"{PREFIX}-{best}")
    if args.should_save and (stage / f"{PREFIX}-{state.global_step}" / TRAINER_STATE).is_file():
        state.save_to_json(str(stage / f"{PREFIX}-{state.global_step}" / TRAINER_STATE))


def _seal(folder: Path) -> dict[str, int]:
    """``checksums.json`` for every file under ``folder``; their sizes.

    Raises:
        OSError: a file is a symlink, or under one, or not a regular file.
    """
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                   if not p.is_dir() or p.is_symlink())
    files = {n: digest_in(folder, n) for n in names}
    sizes = {n: (folder / n).stat().st_size for n in names}
    write_durably(folder / MANIFEST, json.dumps(manifest(files), indent=1))
    return sizes


def _rotate(run_dir: Path, limit: int | None, best: str | None) -> None:
    """``save_total_limit`` as the Trainer applies it (oldest first by modification time;
    the newest and the best are kept), each deletion a rename first."""
    if not limit or limit <= 0:
        return
    from transformers.trainer_utils import sort_checkpoints

    found = sort_checkpoints(str(run_dir), PREFIX, use_mtime=True)
    keep = {found[-1]} | ({str(Path(best))} if best else set()) if found else set()
    surplus = len(found) - max(limit, len(keep))
    for path in found:
        if surplus <= 0:
            break
        if path not in keep:
            retire(Path(path))
            surplus -= 1


def verify_checkpoint(trainer: Any, path: str | os.PathLike[str] | None) -> None:
    """Raise on every rank, naming the file, unless the checkpoint at ``path`` matches its
    ``checksums.json``; one without (the Trainer on Accelerate's) loads with a warning."""
    if path is None:
        return
    folder = Path(path)
    if not os.path.lexists(folder / MANIFEST):
        log.warning("%s has no %s (written by the Trainer on Accelerate, or damaged): loading "
                    "it unverified", folder, MANIFEST)
        return
    verify(folder, trainer.accelerator.env)
