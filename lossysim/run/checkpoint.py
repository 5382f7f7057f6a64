"""Training-state checkpoints for exact resume.

A checkpoint is a folder ``checkpoints/step-NNNNNNN`` holding one ``rank{r}.pt``
per process and a ``manifest.json`` with every file's SHA-256, written last.
It is assembled under a temporary name and renamed into place, so a folder
without a valid manifest (a process killed while writing) is never taken for a
complete checkpoint; a file whose checksum does not match is a clear error.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch

from ..io import atomic_write_json

_NAME = re.compile(r"^step-(\d{7,})$")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save(run_dir: Path, step: int, state: dict, *, rank: int = 0, world: int = 1, keep: int = 2,
         barrier: Callable[[], None] = lambda: None) -> Path:
    """Write this rank's ``state``; rank 0 seals the checkpoint once every rank has written."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:07d}"
    tmp = root / f".step-{step:07d}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    name = f"rank{rank}.pt"
    with open(tmp / name, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    barrier()
    if rank == 0:
        files = {f"rank{r}.pt": _sha256(tmp / f"rank{r}.pt") for r in range(world)}
        atomic_write_json(tmp / "manifest.json", {"step": step, "world": world, "files": files})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in complete(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def complete(run_dir: Path) -> list[Path]:
    """Sealed checkpoints (with a manifest), oldest first; half-written ones are ignored."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / "manifest.json").is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest(run_dir: Path) -> Optional[Path]:
    found = complete(run_dir)
    return found[-1] if found else None


def load(path: Path, rank: int = 0, world: int = 1, map_location=None) -> dict:
    """This rank's state from a sealed checkpoint, verified against the manifest."""
    path = Path(path)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"checkpoint {path} has no readable manifest ({err}); delete it to resume "
                         "from an older one") from None
    if manifest.get("world") != world:
        raise ValueError(f"checkpoint {path} was written by {manifest.get('world')} processes, "
                         f"this run has {world}")
    name = f"rank{rank}.pt"
    file = path / name
    if not file.is_file() or _sha256(file) != manifest["files"].get(name):
        raise ValueError(f"checkpoint file {file} is missing or corrupt (checksum mismatch); "
                         "delete the folder to resume from an older checkpoint")
    return torch.load(file, map_location=map_location, weights_only=False)
