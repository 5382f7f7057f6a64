"""metrics.jsonl: a row per logged training step and per evaluation, with the simulated clock, the traffic
so far and every axis's own columns (``lossysim.axes``: its ``record`` module's ``train_row``, ``eval_row``).

The files and their keys are described in docs/run_directory.md; reports read only them.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from .. import axes
from ..config import ExperimentConfig
from ..io import append_jsonl, atomic_write_text, read_jsonl
from ..net.stats import packets_row as traffic
from . import failures
from .clock import clock, clock_row
from .state import TrainState
from .tracking import open_tracker


class Metrics:
    """metrics.jsonl, mirrored to the trackers ``report_to`` names; only the main process writes."""

    def __init__(self, run_dir: Path, config: ExperimentConfig, is_main: bool, resume_step: int = 0):
        self.path = run_dir / "metrics.jsonl"
        self.is_main = is_main
        self.tracker = open_tracker(config.report_to if is_main else "none", run_dir, config.to_dict(),
                                    resume_step=resume_step)

    def write(self, row: dict) -> None:
        if self.is_main:
            append_jsonl(self.path, row)
            self.tracker.log(row)

    def close(self) -> None:
        self.tracker.close()


def cut_metrics(run_dir: Path, step: Optional[int]) -> None:
    """Resuming at ``step``: drop the rows the run that died wrote after it (all of them for None)."""
    path = run_dir / "metrics.jsonl"
    if step is None:
        if path.exists():
            path.unlink()
        return
    kept = [row for row in read_jsonl(path) if row["step"] <= step] if path.exists() else []
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in kept))


def used(parts, config: ExperimentConfig) -> list:
    """The axes this run spreads over and holds a part of (``Axis.part``), each with that part and its
    ``record`` module."""
    out = []
    for axis in axes.AXES:
        part = getattr(parts, axis.part, None) if axis.part else None
        if part is not None and axis.used(config) and axis.record:
            out.append((axis, part, axis.hooks()))
    return out


def train_row(step: int, started: float, averages: dict, state: TrainState, parts, lr: float,
              disagreement: dict, config: ExperimentConfig) -> dict:
    """A logged training step: the window's averages (``Window.flush``), the clock, traffic so far
    (every stage's TP traffic) and rank divergence, then every used axis's columns."""
    network, pipeline = parts.train_net, parts.pipeline
    stages = [network] if pipeline is None else pipeline.networks
    failed = failures.count(parts, config)
    row = {"step": step, "split": "train", "time_s": time.time() - started, **averages,
           **clock_row(state, network, step, config, pipeline, failed), "lr": lr, **traffic(*stages),
           "disagreement": disagreement["prediction"], "hidden_rel_diff": disagreement["hidden_rel_diff"]}
    for _, part, hooks in used(parts, config):
        if hasattr(hooks, "train_row"):
            row.update(hooks.train_row(part, state))
    return row


def eval_row(step: int, split: str, started: float, scores: dict, state: TrainState, parts,
             config: ExperimentConfig) -> dict:
    """An evaluation: its scores, this evaluation's traffic, the training clock it happened at, and every
    used axis's columns."""
    pipeline = parts.pipeline
    now = clock(state, parts.train_net, config, pipeline, failures.count(parts, config))
    stages = [parts.eval_net] if pipeline is None else pipeline.eval_networks
    row = {"step": step, "split": split, "time_s": time.time() - started,
           "sim_time_s": now["sim_time_s"], "sim_time_s_ideal_nic": now["sim_time_s_ideal_nic"],
           "loss": scores["loss"], "accuracy": scores["accuracy"],
           **traffic(*stages), "disagreement": scores["disagreement"],
           "hidden_rel_diff": scores["hidden_rel_diff"]}
    for _, part, hooks in used(parts, config):
        if hasattr(hooks, "eval_row"):
            row.update(hooks.eval_row(part))
    return row
