# Checksums of every file of a checkpoint: written when it is saved, verified before it is loaded.
"""Integrity of checkpoints: a SHA-256 of each file in ``checksums.json``.

Each rank hashes the files it wrote (its DCP shards and RNG file; rank 0 also DCP's
``.metadata`` and ``shardwise.json``); rank 0 writes the manifest, with a digest of the
manifest itself. Before a load, the ranks share the verification of the files (file i on
rank i mod world size) and agree on the outcome, so a flipped bit anywhere is a
``CheckpointError`` naming the file on every rank. A file that leads outside its checkpoint
(a symlink), or is not a regular file, is damaged; a missing manifest is an error unless the
checkpoint's ``shardwise.json`` is one written before checksums existed.
"""

from __future__ import annotations

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

__all__ = ["MANIFEST", "digests_of", "write_manifest", "verify", "sealed"]

log = logging.getLogger("shardwise.checkpoint")

# the keys of shardwise.json in checkpoints written before checksums.json existed: those load
# unverified. Any other shardwise.json (one that records "checksums", a damaged one) needs its
# checksums.json, so a checkpoint that lost it is never loaded unverified.
_BEFORE_CHECKSUMS = {"format", "name", "train_state", "world_size", "data", "optimizer",
                     "scheduler", "scaler"}
_CHUNK = 8 * 2**20
_MAX_MANIFEST_BYTES = 64 * 2**20


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open_regular(path) as stream:
        while chunk := stream.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def digests_of(root: Path, rank: int, own: str | None = None) -> dict[str, str]:
    """Digests of the files ``rank`` wrote under ``root``, by relative path; rank 0 also
    hashes every file of an engine's own format under ``root/own`` (written by all ranks,
    which finished before it returned)."""
    names = [p for p in root.glob(f"__{rank}_*.distcp")]
    names.append(rng_file(root, rank))
    if rank == 0:
        names += [root / ".metadata", root / "shardwise.json"]
        if own is not None:  # the engine's files, and any it wrote beside them (scripts)
            names += sorted(p for p in root.rglob("*") if not p.is_dir()
                            and p.name != MANIFEST and p.parent.name != RNG)
    return {str(p.relative_to(root)): _digest(p) for p in names if p.is_file()}


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


def write_manifest(root: Path, env: Env, mine: dict[str, str]) -> dict[str, Any] | None:
    """Gather every rank's digests; rank 0 gets the manifest to write (others None)."""
    files: dict[str, str] = {}
    for part in _gathered(env, mine):
        files.update(part)
    if not env.is_main:
        return None
    return {"files": files, "sealed": sealed(files)}


def _inside(path: Path, name: str) -> Path | None:
    """Where ``path/name`` leads (through symlinks), if that is inside ``path``; else None."""
    target = Path(os.path.realpath(path / name))  # a symlink loop resolves to itself
    return target if Path(os.path.realpath(path)) in target.parents else None


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
    if _inside(path, MANIFEST) is None:
        raise CheckpointError(f"{manifest} leads outside {path}: the checkpoint is corrupt")
    try:
        data = read_json(manifest, _MAX_MANIFEST_BYTES)
        files = data["files"]
        seal = data["sealed"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest} is corrupt ({type(exc).__name__}: {exc})") from None
    if not isinstance(files, dict) or sealed(files) != seal:
        raise CheckpointError(f"{manifest} does not match its own checksum: it is corrupt")
    return files


def _damage(path: Path, name: str, expected: str) -> str:
    """What is wrong with the file ``name`` of checkpoint ``path``; "" when it is intact."""
    target = _inside(path, name)
    if target is None:
        return f"{path / name} leads outside {path}: the checkpoint is partial or corrupt"
    try:
        if _digest(target) == expected:
            return ""
    except FileNotFoundError:
        return f"{path / name} is missing: the checkpoint is partial or corrupt"
    except OSError as exc:  # a directory, a FIFO, a device, a symlink loop, unreadable
        return (f"{path / name} cannot be read ({exc.strerror or exc}): the checkpoint is "
                "partial or corrupt")
    return (f"{path / name} does not match its checksum (the file is damaged): the checkpoint "
            "is partial or corrupt")


def verify(path: Path, env: Env) -> None:
    """Raise on every rank, naming the file, unless every file of the manifest is intact.

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
    except CheckpointError as exc:
        problem = str(exc)
    except (OSError, ValueError, TypeError) as exc:  # a forged manifest: odd names or digests
        problem = f"verifying {path} failed ({type(exc).__name__}: {exc})"
    problems = [p for p in _gathered(env, problem) if p]
    if problems:
        raise CheckpointError(problems[0])


#: the name tests and tools reached it by before it was shared with async saves
_sealed = sealed
