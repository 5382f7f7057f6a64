"""summary.json: how a run ended and what it measured, every used axis's section (``lossysim.axes``: its
``record`` module's ``summary``), every traffic class's packets and every training network's NCCL choices.

The keys are described in docs/run_directory.md; reports read only them.
"""
from __future__ import annotations

import platform
import time
from typing import Optional

import torch
import transformers

from .. import __version__, axes
from ..config import ExperimentConfig
from ..data import EVAL_SPLITS
from ..net import LossyNetwork
from ..pp.stages import Pipeline
from ..traffic import CLASSES
from .clock import sim_time_summary
from .fabric_record import fabric_summary
from .metrics import used
from .state import TrainState


def summary(status: str, diverged_at: Optional[dict], config: ExperimentConfig, dataset: str,
            state: TrainState, train_net: LossyNetwork, eval_net: LossyNetwork, started: float,
            pipeline: Optional[Pipeline] = None, failed: Optional[int] = None) -> dict:
    """How the run ended and what it measured (``failed``: the job's failed collectives, ``run.clock.clock``'s)."""
    final, seen, reached = state.final, state.train_disagreement, state.reached or {}
    return {
        "status": status, "error": None, "name": config.name, "dataset": dataset,
        "config": config.to_dict(), "mesh": config.mesh().describe(), "steps": state.step,
        "wall_time_s": time.time() - started,
        "tokens_per_s": state.tokens / max(state.train_time, 1e-9),
        "final": final, "best": state.best,
        "packets": {"train": train_net.summary(), "eval": eval_net.summary()},
        "packets_by_class": {"train": train_net.summary(by=("direction", "link_class")),
                             "eval": eval_net.summary(by=("direction", "link_class"))},
        "packets_by_site": {"train": train_net.summary(by=("site", "direction")),
                            "eval": eval_net.summary(by=("site", "direction"))},
        "disagreement": {
            "final_eval": max((f["disagreement"] for f in final.values()), default=None),
            "final_eval_hidden_rel_diff": max((f["hidden_rel_diff"] for f in final.values()), default=None),
            "mean_train": sum(seen) / len(seen) if seen else None,
        },
        "diverged_at": diverged_at, "versions": versions(),
        "sim_time": sim_time_summary(state, train_net, config, pipeline, failed),
        "time_to_accuracy": {"target": config.target_accuracy, "split": EVAL_SPLITS[0],
                             "step": reached.get("step"), "sim_time_s": reached.get("sim_time_s"),
                             "sim_time_s_ideal_nic": reached.get("sim_time_s_ideal_nic")},
    }


def sections(parts, config: ExperimentConfig, state: TrainState) -> dict:
    """Every used axis's summary.json section (``Axis.summary``): its ``record`` module's ``summary``, or
    without one its settings and its counters per step."""
    out = {}
    for axis in axes.AXES:
        if not axis.summary or not axis.used(config):
            continue
        hooks = axis.hooks()
        part = getattr(parts, axis.part, None) if axis.part else None
        if hooks is not None and hasattr(hooks, "summary"):
            if part is not None:
                out[axis.summary] = hooks.summary(part, config, state)
            continue
        steps = max(state.step, 1)
        out[axis.summary] = {**{s.field: getattr(config, s.field) for s in axis.settings},
                             **{c.per_step: getattr(state, c.name) / steps for c in axis.counters if c.per_step}}
    return out


def fabric(parts, config: ExperimentConfig) -> dict:
    """summary.json's ``fabric`` section (``fabric_record``), only on a fabric: a run without one writes
    the summary it wrote before."""
    return {"fabric": fabric_summary(parts, config)} if parts.train_net.spec.cables is not None else {}


def traffic_summary(parts, config: ExperimentConfig) -> dict:
    """summary.json's ``traffic``: every class (``lossysim.traffic``) the run sent, per direction: packets
    sent and lost, the observed loss rate and whether the direction may lose packets (``lossy``). Replica
    0's TP and every used axis's (its ``record`` module's ``traffic``: its networks and their summaries)."""
    stages = [parts.train_net] if parts.pipeline is None else parts.pipeline.networks
    carriers = {"tp": (stages, [n.summary() for n in stages])}
    for _, part, hooks in used(parts, config):
        if hasattr(hooks, "traffic"):
            carriers.update(hooks.traffic(part))
    out = {}
    for cls in CLASSES:
        networks, summaries = carriers.get(cls.name, ([], []))
        if not networks:
            continue
        per = {}
        for kind in cls.directions:
            sent = sum(e["sent"] for s in summaries for e in s if e["direction"] == kind.direction)
            lost = sum(e["lost"] for s in summaries for e in s if e["direction"] == kind.direction)
            per[kind.direction] = {"sent": sent, "lost": lost, "observed_loss_rate": lost / sent if sent else 0.0,
                                   "lossy": kind.direction in networks[0].lossy}
        out[cls.name] = per
    return out


def collectives(parts, config: ExperimentConfig) -> list[dict]:
    """summary.json's ``collectives``: every training network's ``LossyNetwork.choices()`` (one record per
    site, direction, collective and message size), each tagged with the ``network`` it ran on, in the
    traffic classes' order: ``tp`` (stage ``s``'s: ``tp.stage{s}``), then every used axis's (its ``record``
    module's ``collectives``: ``pp.boundary{b}``, ``dp.tp{t}``, ...)."""
    pipeline = parts.pipeline
    tagged = {"tp": [("tp", parts.train_net)] if pipeline is None else
              [(f"tp.stage{s}", n) for s, n in enumerate(pipeline.networks)]}
    for _, part, hooks in used(parts, config):
        if hasattr(hooks, "collectives"):
            tagged.update(hooks.collectives(part))
    return [{"network": name, **choice} for cls in CLASSES for name, n in tagged.get(cls.name, [])
            for choice in n.choices()]


def failure(config: ExperimentConfig, err: BaseException, started: float) -> dict:
    """The summary of a run an exception ended."""
    message = f"{type(err).__name__}: {err}".splitlines()[0]
    return {"status": "failed", "error": message, "name": config.name, "config": config.to_dict(),
            "steps": 0, "wall_time_s": time.time() - started, "versions": versions()}


def versions() -> dict:
    return {"lossysim": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}
