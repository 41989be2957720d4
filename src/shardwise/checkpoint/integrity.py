# Checksums of every file of a checkpoint: written when it is saved, verified before it is loaded.
"""Integrity of checkpoints: a SHA-256 of each file in ``checksums.json``.

Each rank hashes the files it wrote (its DCP shards and RNG file; rank 0 also DCP's
``.metadata`` and ``shardwise.json``); rank 0 writes the manifest, with a digest of the
manifest itself. Before a load, the ranks share the verification of the files (file i on
rank i mod world size) and agree on the outcome, so a flipped bit anywhere is a
``CheckpointError`` naming the file on every rank. The manifest lists what the checkpoint
needs, derived from what was written (DCP's storage files from its ``.metadata``, the record,
each rank's RNG file), never from a directory listing: a file lost before it was hashed fails
the save. A listed file that is missing, a symlink (or under one), not a regular file, or
named outside the directory is damaged; so is a ``.metadata`` naming a storage file the
manifest does not list. A missing manifest is an error unless the checkpoint's
``shardwise.json`` is one written before checksums existed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardwise.checkpoint.layout import MANIFEST, META, RNG, open_regular, read_json, rng_file
from shardwise.env import Env
from shardwise.errors import CheckpointError

__all__ = ["MANIFEST", "Written", "digests_of", "manifest", "merged", "gather_written",
           "manifest_of", "required", "verify", "digest_in", "sealed"]

log = logging.getLogger("shardwise.checkpoint")

# the keys of shardwise.json in checkpoints written before checksums.json existed: those load
# unverified. Any other shardwise.json (one that records "checksums", a damaged one) needs its
# checksums.json, so a checkpoint that lost it is never loaded unverified.
_BEFORE_CHECKSUMS = {"format", "name", "train_state", "world_size", "data", "optimizer",
                     "scheduler", "scaler"}
_CHUNK = 8 * 2**20
_MAX_MANIFEST_BYTES = 64 * 2**20


def _digest(path: Path, *, follow: bool = True, below: Path | None = None) -> str:
    """The SHA-256 of the regular file ``path`` (see :func:`open_regular`)."""
    sha = hashlib.sha256()
    with open_regular(path, follow=follow, below=below) as stream:
        while chunk := stream.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


#: what a rank reports of each file it wrote: its SHA-256 and its size in bytes
Written = dict[str, tuple[str, int]]


def digests_of(root: Path, rank: int, own: str | None = None) -> Written:
    """Digests and sizes of the files ``rank`` wrote under ``root``, by relative path; rank 0
    also hashes every file of an engine's own format under ``root/own`` (written by all
    ranks, which finished before it returned). A file missing here is caught by
    :func:`manifest_of`, which knows from DCP's metadata what must be there."""
    names = [p for p in root.glob(f"__{rank}_*.distcp")]
    names.append(rng_file(root, rank))
    if rank == 0:
        names += [root / ".metadata", root / META]
        if own is not None:  # the engine's files, and any it wrote beside them (scripts)
            names += sorted(p for p in root.rglob("*") if not p.is_dir()
                            and p.name != MANIFEST and p.parent.name != RNG)
    return {str(p.relative_to(root)): (_digest(p), p.stat().st_size)
            for p in names if p.is_file()}


def _gathered(env: Env, value: Any) -> list[Any]:
    """``value`` from every rank (in-process objects between this job's own ranks)."""
    if not (env.is_distributed and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, value)
    return out


def sealed(files: dict[str, str]) -> str:
    """The digest of a manifest's file digests (what ``sealed`` in checksums.json holds)."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def manifest(files: dict[str, str]) -> dict[str, Any]:
    """``checksums.json``'s content for these file digests: the files and their seal."""
    return {"files": files, "sealed": sealed(files)}


def merged(parts: list[Any]) -> Written:
    """The ranks' reports as one (each a mapping of name -> (digest, size), as sent)."""
    every: Written = {}
    for part in parts:
        every.update({name: (str(sha), int(size)) for name, (sha, size) in part.items()})
    return every


def gather_written(env: Env, mine: Written) -> Written:
    """Every rank's reports (a collective); what rank 0 builds the manifest from."""
    return merged(_gathered(env, mine))


def required(root: Path, world_size: int, written: Written, own: str | None) -> set[str]:
    """Every file the checkpoint in ``root`` needs: DCP's storage files as its ``.metadata``
    lists them (an engine's own format: what it wrote), the record and each rank's RNG."""
    from shardwise.checkpoint.safe_reader import storage_files

    needed = {META, *(f"{RNG}/{rng_file(Path(), r).name}" for r in range(world_size))}
    if own is None:
        return needed | {".metadata"} | storage_files(root)
    return needed | set(written)  # the engine's files, and any it wrote beside them


def manifest_of(root: Path, world_size: int, written: Written,
                own: str | None = None) -> tuple[dict[str, Any], dict[str, int]]:
    """``checksums.json`` for the files the checkpoint needs, and their sizes.

    Raises:
        OSError: a file the checkpoint needs was not reported written (lost, or never
            written), or DCP's metadata cannot be read.
    """
    try:
        needed = required(root, world_size, written, own)
    except CheckpointError as exc:
        raise OSError(str(exc)) from None
    missing = sorted(needed - set(written))
    if missing:
        raise OSError(f"{root / missing[0]} is needed by the checkpoint but was not written "
                      f"({len(missing)} file(s) missing: {', '.join(missing[:5])})")
    files = {name: written[name][0] for name in sorted(needed)}
    return manifest(files), {n: written[n][1] for n in needed}


def _plain(name: Any) -> bool:
    """A path relative to the checkpoint that stays inside it, whatever the links."""
    parts = name.split("/") if isinstance(name, str) else [""]
    return not name.startswith("/") and all(p not in ("", ".", "..") for p in parts) \
        and "\\" not in name and "\0" not in name


def _predates_checksums(path: Path) -> bool:
    try:
        meta = read_json(path / META)
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and set(meta) <= _BEFORE_CHECKSUMS


def _read_manifest(path: Path) -> dict[str, str] | None:
    manifest = path / MANIFEST
    if not os.path.lexists(manifest) and _predates_checksums(path):
        log.info("%s has no %s (written before checksums were recorded): loading it "
                 "unverified", path, MANIFEST)
        return None
    if not os.path.lexists(manifest):
        raise CheckpointError(f"{manifest} is missing: the checkpoint is partial or corrupt "
                              f"(its {META} is not one written before checksums existed)")
    try:
        data = read_json(manifest, _MAX_MANIFEST_BYTES, follow=False)
        files = data["files"]
        seal = data["sealed"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest} is corrupt ({type(exc).__name__}: "
                              f"{getattr(exc, 'strerror', None) or exc})") from None
    if not isinstance(files, dict) or sealed(files) != seal:
        raise CheckpointError(f"{manifest} does not match its own checksum: it is corrupt")
    odd = [name for name in files if not _plain(name)]
    if odd:
        raise CheckpointError(f"{manifest} lists {str(odd[0])[:80]!r}, which is not a file "
                              "inside the checkpoint: it is corrupt")
    return files


def _damage(path: Path, name: str, expected: str) -> str:
    """What is wrong with the file ``name`` of checkpoint ``path``; "" when it is intact: a
    regular file, reached through no symlink, whose digest is the expected one."""
    try:
        if digest_in(path, name) == expected:
            return ""
    except FileNotFoundError:
        return f"{path / name} is missing: the checkpoint is partial or corrupt"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return (f"{path / name} is, or lies under, a symbolic link; a checkpoint's files are "
                    "regular files inside it: the checkpoint is partial or corrupt")
        # a directory, a FIFO, a device, unreadable
        return (f"{path / name} cannot be read ({exc.strerror or exc}): the checkpoint is "
                "partial or corrupt")
    return (f"{path / name} does not match its checksum (the file is damaged): the checkpoint "
            "is partial or corrupt")


def digest_in(path: Path, name: str) -> str:
    """The SHA-256 of ``path/name``, a regular file reached through no symlink.

    Raises:
        OSError: a component is a symlink (ELOOP), or the file is not a regular file.
    """
    return _digest(path / name, follow=False, below=path)


def _unlisted_storage(path: Path, files: dict[str, str] | None) -> str:
    """A storage file DCP's ``.metadata`` names that the manifest does not list, or ""."""
    from shardwise.checkpoint.safe_reader import storage_files

    if files is None or ".metadata" not in files:
        return ""
    unlisted = sorted(storage_files(path) - set(files))
    return (f"{path / '.metadata'} names {unlisted[0]!r}, which {path / MANIFEST} does not "
            "list: the checkpoint is corrupt") if unlisted else ""


def verify(path: Path, env: Env) -> None:
    """Raise on every rank, naming the file, unless every file of the manifest is intact and
    every storage file DCP's metadata names is one of them.

    The ranks split the files between them. A checkpoint without a manifest is verified only
    in that it must be one written before checksums existed (by its ``shardwise.json``).
    """
    problem = ""
    try:
        files = _read_manifest(path)
        rank, world = (env.rank, env.world_size) if env.is_distributed and dist.is_initialized() \
            else (0, 1)
        for i, (name, expected) in enumerate(sorted((files or {}).items())):
            if i % world == rank:
                problem = _damage(path, name, expected)
            if problem:
                break
        if not problem and rank == 0:
            problem = _unlisted_storage(path, files)
    except CheckpointError as exc:
        problem = str(exc)
    except (OSError, ValueError, TypeError) as exc:  # a forged manifest: odd names or digests
        problem = f"verifying {path} failed ({type(exc).__name__}: {exc})"
    problems = [p for p in _gathered(env, problem) if p]
    if problems:
        raise CheckpointError(problems[0])


#: the name tests and tools reached it by before it was shared with async saves
_sealed = sealed
