# Checksums of every file of a checkpoint: written when it is saved, verified before it is loaded.
"""Integrity of checkpoints: a SHA-256 of each file in ``checksums.json``.

Each rank hashes the files it wrote (its DCP shards and RNG file; rank 0 also DCP's
``.metadata`` and ``shardwise.json``); rank 0 writes the manifest, with a digest of the
manifest itself. Before a load, the ranks share the verification of the files (file i on
rank i mod world size) and agree on the outcome, so a flipped bit anywhere is a
``CheckpointError`` naming the file on every rank.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardwise.env import Env
from shardwise.errors import CheckpointError

__all__ = ["MANIFEST", "digests_of", "write_manifest", "verify"]

MANIFEST = "checksums.json"
_CHUNK = 8 * 2**20
_MAX_MANIFEST_BYTES = 64 * 2**20


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def digests_of(root: Path, rank: int) -> dict[str, str]:
    """Digests of the files ``rank`` wrote under ``root``, by relative path."""
    names = [p for p in root.glob(f"__{rank}_*.distcp")]
    names.append(root / "rng" / f"rank_{rank:05d}.json")
    if rank == 0:
        names += [root / ".metadata", root / "shardwise.json"]
    return {str(p.relative_to(root)): _digest(p) for p in names if p.is_file()}


def _gathered(env: Env, value: Any) -> list[Any]:
    """``value`` from every rank (in-process objects between this job's own ranks)."""
    if not (env.is_distributed and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, value)
    return out


def _sealed(files: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_manifest(root: Path, env: Env, mine: dict[str, str]) -> dict[str, Any] | None:
    """Gather every rank's digests; rank 0 gets the manifest to write (others None)."""
    files: dict[str, str] = {}
    for part in _gathered(env, mine):
        files.update(part)
    if not env.is_main:
        return None
    return {"files": files, "sealed": _sealed(files)}


def _read_manifest(path: Path) -> dict[str, str] | None:
    manifest = path / MANIFEST
    if not manifest.is_file():
        return None  # written before checksums were recorded
    if manifest.stat().st_size > _MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{manifest} is larger than {_MAX_MANIFEST_BYTES} bytes")
    try:
        data = json.loads(manifest.read_text())
        files = data["files"]
        sealed = data["sealed"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest} is corrupt ({type(exc).__name__})") from None
    if not isinstance(files, dict) or _sealed(files) != sealed:
        raise CheckpointError(f"{manifest} does not match its own checksum: it is corrupt")
    return files


def verify(path: Path, env: Env) -> None:
    """Raise on every rank, naming the file, unless every file of the manifest is intact.

    The ranks split the files between them; a checkpoint without a manifest (written before
    checksums were recorded) is not verified.
    """
    problem = ""
    try:
        files = _read_manifest(path)
        rank, world = (env.rank, env.world_size) if env.is_distributed and dist.is_initialized() \
            else (0, 1)
        for i, (name, expected) in enumerate(sorted((files or {}).items())):
            if i % world != rank:
                continue
            target = (path / name).resolve()
            if path.resolve() not in target.parents or not target.is_file():
                problem = f"{path / name} is missing: the checkpoint is partial or corrupt"
            elif _digest(target) != expected:
                problem = (f"{path / name} does not match its checksum (the file is damaged): "
                           "the checkpoint is partial or corrupt")
            if problem:
                break
    except CheckpointError as exc:
        problem = str(exc)
    except OSError as exc:
        problem = f"reading {path} failed ({type(exc).__name__}: {exc})"
    problems = [p for p in _gathered(env, problem) if p]
    if problems:
        raise CheckpointError(problems[0])
