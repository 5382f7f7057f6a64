"""Experiment tracking: what metrics.jsonl holds, mirrored to TensorBoard and/or Weights & Biases.

``report_to`` takes Hugging Face Trainer's key and values: ``none`` (the default), ``tensorboard``,
``wandb``, or several (``tensorboard,wandb`` or a YAML list). metrics.jsonl stays the record;
trackers are views of it. Scalars are tagged ``<split>/<metric>`` (``train/loss``,
``validation_matched/accuracy``) at the row's optimizer step, and the resolved config is logged
once. TensorBoard event files go into ``<run dir>/tensorboard``. W&B is an optional extra
(``pip install 'lossysim[wandb]'``) and honours its own environment (``WANDB_MODE=offline``,
``WANDB_PROJECT``, default project ``lossysim``); its files go into ``<run dir>/wandb``.
Only the main process (rank 0) tracks.
"""
from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Iterable, Optional

import yaml

from ..config import parse_report_to

EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb"}   # tracker -> the package it needs


def _require(tracker: str) -> None:
    package = EXTRAS[tracker]
    if importlib.util.find_spec(package) is None:
        raise ValueError(f"report_to={tracker} needs the {package} package, which is not installed: "
                         f"pip install 'lossysim[{tracker}]'")


def require(report_to) -> tuple[str, ...]:
    """The trackers ``report_to`` names; a one-line ValueError when one's package is not installed."""
    names = parse_report_to(report_to)
    for name in names:
        _require(name)
    return names


def _scalars(row: dict) -> dict[str, float]:
    split = row.get("split", "train")
    return {f"{split}/{key}": float(value) for key, value in row.items()
            if key not in ("step", "split") and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


class Tracker:
    """Sends rows (metrics.jsonl's) to every configured tracker."""

    def __init__(self, sinks: Iterable = ()):
        self.sinks = list(sinks)

    def log(self, row: dict) -> None:
        if not self.sinks:
            return
        scalars = _scalars(row)
        for sink in self.sinks:
            sink.log(scalars, int(row["step"]))

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


class _TensorBoard:
    def __init__(self, run_dir: Path, config: dict, resume_step: int):
        from torch.utils.tensorboard import SummaryWriter
        # purge_step: a resumed run hides the events the killed run wrote after its checkpoint
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"),
                                    purge_step=resume_step + 1 if resume_step else None)
        if not resume_step:
            text = yaml.safe_dump(config, sort_keys=False)
            self.writer.add_text("config", "```yaml\n" + text + "```", global_step=0)

    def log(self, scalars: dict, step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run_dir: Path, config: dict, resume_step: int):
        import wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "lossysim"), name=config.get("name"),
                              dir=str(run_dir), config=config, reinit="finish_previous")

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def open_tracker(report_to, run_dir, config: dict, resume_step: int = 0) -> Tracker:
    """A Tracker for ``report_to`` writing under ``run_dir``; ``resume_step`` > 0 continues a run."""
    names = require(report_to)
    run_dir = Path(run_dir)
    sinks = []
    try:
        for name in names:
            sinks.append((_TensorBoard if name == "tensorboard" else _WandB)(run_dir, config, resume_step))
    except BaseException:
        Tracker(sinks).close()
        raise
    return Tracker(sinks)


def read_tensorboard(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Scalars in ``<run_dir>/tensorboard``: tag -> [(step, value), ...] (for tests and notebooks)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(Path(run_dir) / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def read_tensorboard_text(run_dir, tag: str = "config") -> Optional[str]:
    """The text logged under ``tag`` (the config), or None."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(Path(run_dir) / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    for name in (tag, f"{tag}/text_summary"):
        if name in events.Tags().get("tensors", []):
            return events.Tensors(name)[0].tensor_proto.string_val[0].decode()
    return None
