"""Training-state checkpoints for exact resume, and the trained model's export.

A checkpoint is a folder ``checkpoints/step-NNNNNNN`` holding one ``rank{r}.pt``
per process and a ``manifest.json`` with every file's SHA-256, written last.
It is assembled under a temporary name and renamed into place, so a folder
without a valid manifest (a process killed while writing) is never taken for a
complete checkpoint; a file whose checksum does not match is a clear error.

A rank's file is a dict of named parts, each one saved by its owner's
``state_dict`` (``save_training`` and ``resume`` list them): model, optimiser,
scheduler, scaler, metric window, every random stream, both networks, the run's
progress as a plain dict (``progress``) and, with data parallelism, ``dp``: the
other replicas this process runs and the data-parallel networks; with pipeline
stages, ``pp``: every later stage's and every boundary's networks (training and
evaluation) and the later stages' replicated streams. A new kind of parallelism
adds a part; the format stays.

Files hold only tensors and plain values (dicts, lists, numbers, strings), and
are read with ``torch.load(weights_only=True)``: a file that needs anything else
to unpickle (code a shared results folder could smuggle in) is refused before
any of it runs, checksum or not. Every checkpoint lossysim has written loads so.
``export_model`` writes the gathered HF model (``checkpoint/``) at the end of a run.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

from .. import axes
from ..config import NON_SEMANTIC, ExperimentConfig, upgrade
from ..io import atomic_write_json
from ..models.pretrained import quiet_transformers
from ..pp.stages import stage_layout
from ..tp import gather_full_model
from .state import TrainState, Window

if TYPE_CHECKING:
    from .build import Parts

log = logging.getLogger(__name__)

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
    try:
        # The manifest's checksums come from whoever wrote the folder: they prove nothing about safety.
        return torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"checkpoint file {file} holds more than tensors and plain values (not written by "
                         "lossysim, or altered), so it was not loaded; delete the folder to resume from an "
                         "older checkpoint") from None
    except (RuntimeError, EOFError) as err:  # not a torch file at all, though its checksum matches
        raise ValueError(f"checkpoint file {file} is not a readable checkpoint "
                         f"({str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}); "
                         "delete the folder to resume from an older checkpoint") from None


# -- what a training checkpoint holds ----------------------------------------------------------

def save_training(run_dir: Path, parts: "Parts", state: TrainState, window: Window, config: ExperimentConfig,
                  rank: int = 0, barrier: Callable[[], None] = lambda: None) -> Path:
    """Checkpoint everything an exact resume needs, at ``state.step``; every rank writes its own file."""
    group = parts.model.group
    contents = {
        "config": _resumable(config), "progress": state.state_dict(),
        "model": parts.model.state_dict(), "optimizer": parts.optimizer.state_dict(),
        "scheduler": parts.scheduler.state_dict(), "scaler": parts.scaler.state_dict(),
        "window": window.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "replicated": group.rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        "train_net": parts.train_net.state_dict(), "eval_net": parts.eval_net.state_dict(),
    }
    for axis, hooks in _saving(parts):   # each axis's own state, under its name (cp's rides in the model's)
        saved = hooks.save(parts)
        if saved is not None:
            contents[axis.name] = saved
    return save(run_dir, state.step, contents, rank=rank, world=_world(config), keep=config.keep_checkpoints,
                barrier=barrier)


def resume(run_dir: Path, parts: "Parts", window: Window, config: ExperimentConfig,
           rank: int = 0) -> Optional[TrainState]:
    """Load the newest complete checkpoint into ``parts`` and ``window``; its progress, None if there is none.
    It is read onto the CPU whatever the run's device: a generator's state must be a CPU byte tensor (CUDA's
    too), and every part copies its own tensors to where they live (parameters, optimizer state, counters)."""
    found = [str(latest(run_dir) or "")]
    if config.backend == "dist":  # every rank loads the checkpoint rank 0 chose
        dist.broadcast_object_list(found, src=0)
    if not found[0]:
        log.info("no complete checkpoint in %s: starting from step 0", run_dir)
        return None
    saved = load(Path(found[0]), rank, _world(config), map_location="cpu")
    check_same_experiment(saved["config"], config, found[0],
                          None if parts.pipeline is None else sum(parts.pipeline.layout))
    parts.model.load_state_dict(saved["model"])
    parts.optimizer.load_state_dict(saved["optimizer"])
    parts.scheduler.load_state_dict(saved["scheduler"])
    parts.scaler.load_state_dict(saved["scaler"])
    window.load_state_dict(saved["window"])
    torch.set_rng_state(saved["rng"]["torch"].cpu())
    if saved["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["rng"]["cuda"])
    parts.model.group.load_rng_state(saved["rng"]["replicated"])
    parts.train_net.load_state_dict(saved["train_net"])
    parts.eval_net.load_state_dict(saved["eval_net"])
    for axis, hooks in _saving(parts):
        if axis.name in saved:   # (the same experiment: what it saved then, it would save now)
            hooks.load(parts, saved[axis.name])
    state = TrainState.from_dict(saved["progress"])
    log.info("resumed from %s at step %d", found[0], state.step)
    return state


def _saving(parts: "Parts") -> list:
    """The axes whose part this run holds and whose ``record`` module saves state (``save``, ``load``)."""
    out = []
    for axis in axes.AXES:
        hooks = axis.hooks() if axis.part and getattr(parts, axis.part, None) is not None else None
        if hooks is not None and hasattr(hooks, "save"):
            out.append((axis, hooks))
    return out


def check_same_experiment(written: dict, config: ExperimentConfig, where, layers: Optional[int] = None) -> None:
    """Refuse (a ValueError naming the first setting that differs) to continue ``where``, written with the
    settings ``written``, as the run ``config``. ``layers``: the model's depth, so that a ``pp_layout``
    spelling out the even split is the default's (as ``microbatches`` equal to ``pp_size`` is)."""
    expected = _canonical(_resumable(config), layers)
    written = {k: v for k, v in upgrade(written).items() if k not in NON_SEMANTIC}
    got = _canonical(written, layers)
    if got != expected:
        key = next(k for k in got if got[k] != expected.get(k))
        raise ValueError(f"{where} was written with {key}={written[key]!r}, this run has "
                         f"{key}={getattr(config, key)!r}: resume needs the same experiment")


def _canonical(values: dict, layers: Optional[int]) -> dict:
    """``values`` with ``pp_layout`` as the blocks per stage it gives a model of ``layers`` blocks."""
    if layers is None:
        return values
    try:
        return {**values, "pp_layout": stage_layout(values.get("pp_layout"), int(values.get("pp_size", 1)), layers)}
    except (TypeError, ValueError):   # not a layout of this model: compared as written
        return values


def _resumable(config: ExperimentConfig) -> dict:
    """The settings a checkpoint must share with the run resuming from it."""
    return {k: v for k, v in config.to_dict().items() if k not in NON_SEMANTIC}


def _world(config: ExperimentConfig) -> int:
    return config.mesh().world if config.backend == "dist" else 1


# -- the trained model ------------------------------------------------------------------------

def export_model(parts: "Parts", run_dir: Path, is_main: bool) -> None:
    """The gathered HF model and tokenizer in ``run_dir/checkpoint``, verified against the in-memory
    model before it counts. Every dist rank takes part in the gather; the main process writes."""
    full = gather_full_model(parts.model) if parts.pipeline is None else parts.pipeline.full_model(parts.model)
    if not is_main:
        return
    final = run_dir / "checkpoint"
    tmp = run_dir / ".checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with quiet_transformers():   # its shard-writing and weight-loading bars, whatever --no-progress says
        full.save_pretrained(tmp)
        parts.data.tokenizer.save_pretrained(tmp)
        reloaded = type(full).from_pretrained(tmp)
    for name, tensor in full.state_dict().items():
        if not torch.equal(reloaded.state_dict()[name].to(tensor.device), tensor):
            raise RuntimeError(f"saved checkpoint differs from the trained model at {name}")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
