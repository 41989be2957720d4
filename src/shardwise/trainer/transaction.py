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
3. rank 0 writes ``shardwise-trainer.json`` (the record that shardwise wrote the folder) and
   ``checksums.json`` (a SHA-256 of every file, sealed), renames the folder to
   ``checkpoint-N`` (a re-save of step N sets the published one aside first, never deleting
   it before), and applies ``save_total_limit`` as the Trainer does, each deletion a rename
   out of the published names first; a checkpoint that is not ours to delete (read-only) is
   left under its name with a warning, as the Trainer's ``rmtree`` leaves it.

Before the Trainer loads a checkpoint (``resume_from_checkpoint``,
``load_best_model_at_end``), so before any state changes, every rank checks it: each file
against ``checksums.json`` (a flipped bit, a missing or extra-linked file, a forged
manifest), and every file in the folder listed there (the Trainer loads what it finds: a
planted ``optimizer.pt`` is refused); the pickles a resume reads after the weights
(``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``rng_state*.pth``) must load with
``weights_only=True``. Each failure is a ``CheckpointError`` naming the file. A folder
with neither ``checksums.json`` nor shardwise's record (written by the Trainer on
Accelerate) skips the checksums, with a warning; one with the record but no manifest is
refused.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import zipfile
from pathlib import Path
from typing import Any

from shardwise.checkpoint.integrity import MANIFEST, digest_in, manifest, verify
from shardwise.checkpoint.layout import read_json, write_durably
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
#: the record that shardwise wrote a checkpoint-N folder: with it, the folder's
#: checksums.json is required (deleting the manifest never turns verification off)
RECORD = "shardwise-trainer.json"
#: what a resume reads with torch.load(weights_only=True) after the model's weights (the
#: Trainer's OPTIMIZER_NAME, SCHEDULER_NAME, SCALER_NAME and its RNG files)
PICKLES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state*.pth")
_MAX_MANIFEST_BYTES = 64 * 2**20


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
    """shardwise's record, then ``checksums.json`` for every file under ``folder`` (the
    record included); their sizes.

    Raises:
        OSError: a file is a symlink, or under one, or not a regular file.
    """
    write_durably(folder / RECORD, json.dumps({"written_by": "shardwise", "manifest": MANIFEST,
                                               "layout": "transformers.Trainer checkpoint"}))
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
            blocker = _read_only(Path(path))
            if blocker:  # counted as deleted all the same: the Trainer's rmtree fails alike
                log.warning("save_total_limit: %s is left in place: %s is read-only (kept on "
                            "purpose, as the Trainer on Accelerate's rmtree keeps a read-only "
                            "folder); delete it yourself, or make it writable", path, blocker)
            else:
                retire(Path(path))
            surplus -= 1


def _read_only(folder: Path) -> Path | None:
    """What makes ``folder`` not ours to delete: the run directory, the folder, or anything
    in it that is read-only; None when there is nothing.

    Read-only means no write permission for us (``os.access``) or no write bit at all in its
    mode (``chmod a-w``, ``chmod 555``): root passes ``os.access`` everywhere, so the bits
    alone tell that a checkpoint was made read-only on purpose. A read-only file counts too,
    although its directory would let it go: someone meant it to stay. Symlinks' own modes
    mean nothing and are not read.
    """
    def read_only(path: Path) -> bool:
        mode = os.lstat(path).st_mode
        return not (os.access(path, os.W_OK)
                    and mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))

    for path in (folder.parent, folder):
        if read_only(path):
            return path
    for here, dirs, files in os.walk(folder):
        for name in sorted(dirs + files):
            path = Path(here) / name
            if not path.is_symlink() and read_only(path):
                return path
    return None


def verify_checkpoint(trainer: Any, path: str | os.PathLike[str] | None, *,
                      resuming: bool = True) -> None:
    """Raise on every rank, naming the file, unless the checkpoint at ``path`` matches its
    ``checksums.json`` and every file in it is listed there; with ``resuming``, also unless
    each pickle the resume reads after the weights loads with ``weights_only=True``. Called
    before anything is loaded. A folder with neither the manifest nor shardwise's record
    (the Trainer on Accelerate's) skips the checksums, with a warning."""
    if path is None:
        return
    folder, env = Path(path), trainer.accelerator.env
    problem = ""
    if os.path.lexists(folder / MANIFEST):
        verify(folder, env)  # every rank raises the same error
        problem = _unlisted(folder)
    elif os.path.lexists(folder / RECORD):
        problem = (f"{folder / MANIFEST} is missing, but {folder / RECORD} records that "
                   "shardwise wrote the checkpoint: its files cannot be verified (it is "
                   "damaged, or was altered); resume from another checkpoint")
    else:
        log.warning("%s has no %s (written by the Trainer on Accelerate, or damaged): loading "
                    "it unverified", folder, MANIFEST)
    if not problem and resuming:
        problem = _unloadable(folder)
    if not all_agree(env, not problem):
        said = from_main(env, problem)
        raise CheckpointError(problem or said or f"checking {folder} failed on another rank")


def _unlisted(folder: Path) -> str:
    """The first file in ``folder`` (a symlink, a FIFO: any entry but a directory) that its
    verified ``checksums.json`` does not list, in words; "" when there is none."""
    listed = read_json(folder / MANIFEST, _MAX_MANIFEST_BYTES, follow=False)["files"]
    for here, dirs, files in os.walk(folder):
        entries = files + [d for d in dirs if os.path.islink(os.path.join(here, d))]
        for name in sorted(entries):
            found = Path(here) / name
            relative = str(found.relative_to(folder))
            if relative != MANIFEST and relative not in listed:
                return (f"{found} is not listed in {folder / MANIFEST}: no checksum covers it "
                        "(copied in after the save?), and the Trainer would load it; remove "
                        "it, or resume from another checkpoint")
    return ""


def _unloadable(folder: Path) -> str:
    """The first of the Trainer's pickles in ``folder`` that ``torch.load`` refuses with
    ``weights_only=True`` (numpy's RNG types allowed, as the Trainer allows them), in
    words; "" when each loads. Storages are memory-mapped, not read."""
    import torch
    from transformers.trainer_pt_utils import safe_globals

    for pattern in PICKLES:
        for found in sorted(folder.glob(pattern)):
            if not found.is_file():
                continue
            try:
                with safe_globals():  # torch maps only its zip format; a legacy file is read
                    torch.load(found, map_location="cpu", weights_only=True,
                               mmap=zipfile.is_zipfile(found))
            except Exception as exc:  # what the Trainer's own torch.load would raise
                lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
                why = next((line for line in lines if line.startswith("WeightsUnpickler")),
                           lines[0]).split(". ")[0]  # an unpickling error's reason
                return (f"{found} cannot be loaded with torch.load(weights_only=True) "
                        f"({type(exc).__name__}: {why[:200]}): it is damaged, or a planted "
                        "pickle; nothing was loaded: resume from another checkpoint")
    return ""
