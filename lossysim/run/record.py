"""What a run writes: metrics.jsonl rows (with the simulated clock) and summary.json.

The files and their keys are described in docs/run_directory.md; reports read only them.
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Optional

import torch
import transformers

from .. import __version__
from ..config import ExperimentConfig
from ..data import EVAL_SPLITS
from ..io import append_jsonl, atomic_write_text, read_jsonl
from ..net import LossyNetwork
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


def train_row(step: int, started: float, averages: dict, state: TrainState, network: LossyNetwork, lr: float,
              disagreement: dict, config: ExperimentConfig) -> dict:
    """A logged training step: the window's averages (``Window.flush``), the clock, traffic so far
    and rank divergence."""
    return {"step": step, "split": "train", "time_s": time.time() - started, **averages,
            **clock_row(state, network, step, config), "lr": lr, **traffic(network),
            "disagreement": disagreement["prediction"], "hidden_rel_diff": disagreement["hidden_rel_diff"]}


def eval_row(step: int, split: str, started: float, scores: dict, state: TrainState,
             train_net: LossyNetwork, eval_net: LossyNetwork, config: ExperimentConfig) -> dict:
    """An evaluation: its scores, this evaluation's traffic, and the training clock it happened at."""
    now = clock(state, train_net, config)
    return {"step": step, "split": split, "time_s": time.time() - started,
            "sim_time_s": now["sim_time_s"], "sim_time_s_ideal_nic": now["sim_time_s_ideal_nic"],
            "loss": scores["loss"], "accuracy": scores["accuracy"],
            **traffic(eval_net), "disagreement": scores["disagreement"],
            "hidden_rel_diff": scores["hidden_rel_diff"]}


def traffic(network: LossyNetwork) -> dict:
    """Packets sent and lost per direction so far, and the loss rate over the lossy directions."""
    row = {}
    lost_total = sent_total = 0
    for entry in network.summary():
        d = entry["direction"]
        row[f"packets_sent_{d}"], row[f"packets_lost_{d}"] = entry["sent"], entry["lost"]
        if d in network.lossy:
            sent_total += entry["sent"]
            lost_total += entry["lost"]
    for d in ("fwd", "bwd"):
        row.setdefault(f"packets_sent_{d}", 0)
        row.setdefault(f"packets_lost_{d}", 0)
    row["observed_loss_rate"] = lost_total / sent_total if sent_total else 0.0
    return row


# -- the simulated clock ------------------------------------------------------------------------

def clock_mark(step: int, compute_s: float, network: LossyNetwork) -> dict:
    """The clock at ``step``, kept so the next train row can report per-step rates since it."""
    return {"step": step, "compute_s": compute_s, **network.clock()}


def clock(state: TrainState, network: LossyNetwork, config: ExperimentConfig) -> dict:
    """The simulated cluster's clock (see docs/time_model.md): modelled (or measured) compute, simulated
    communication with its repairs, and a restart for every collective the transport gave up on;
    beside it the same run's clock under the ideal nic (one resend and one round trip per loss, never
    a failure). A failure noticed here is charged once, into ``state``: ``restart_s`` plus
    ``restart_lost_steps`` steps at the run's mean step time so far."""
    comm = network.clock()
    failures = network.failures()
    if failures > state.failures:
        per_step = (state.compute_s + comm["comm_s"]) / max(state.step, 1)
        state.restart_s += (failures - state.failures) * (config.restart_s + config.restart_lost_steps * per_step)
        state.failures = failures
    return {"sim_time_s": state.compute_s + comm["comm_s"] + state.dp_s + state.restart_s,
            "sim_time_s_ideal_nic": state.compute_s + comm["comm_s_ideal_nic"] + state.dp_s,
            "restart_s": state.restart_s, "failures": failures, **comm}


def clock_row(state: TrainState, network: LossyNetwork, step: int, config: ExperimentConfig) -> dict:
    """Simulated time per step since the last row, the cumulative clock, and the waits on retransmission
    timers per link class (so the time can be recomputed for other timers); marks this row."""
    now = clock(state, network, config)
    last = state.last_row
    steps = max(step - last["step"], 1)
    row = {"sim_time_s": now["sim_time_s"], "sim_time_s_ideal_nic": now["sim_time_s_ideal_nic"],
           "comm_s_per_step": (now["comm_s"] - last["comm_s"]) / steps,
           "retransmit_s_per_step": (now["retransmit_s"] - last["retransmit_s"]) / steps,
           "compute_s_per_step": (state.compute_s - last["compute_s"]) / steps,
           "failures": now["failures"], **repairs_by_class(network)}
    if config.dp_size > 1:
        row["dp_s_per_step"] = (state.dp_s - last.get("dp_s", 0.0)) / steps
    state.last_row = clock_mark(step, state.compute_s, network)
    if config.dp_size > 1:
        state.last_row["dp_s"] = state.dp_s
    return row


def repairs_by_class(network: LossyNetwork) -> dict:
    """Timer waits so far per link class (``timeouts_intra``, ``timeouts_inter``)."""
    row = {"timeouts_intra": 0, "timeouts_inter": 0}
    for entry in network.summary(by=("link_class",)):
        row[f"timeouts_{entry['link_class']}"] = entry["timeouts"]
    return row


def _sim_time_summary(state: TrainState, network: LossyNetwork, config: ExperimentConfig) -> dict:
    steps = max(state.step, 1)
    now = clock(state, network, config)
    sent = {row["direction"]: row for row in network.summary()}
    return {"total_s": now["sim_time_s"], "total_s_ideal_nic": now["sim_time_s_ideal_nic"],
            "compute_s_per_step": state.compute_s / steps,
            "comm_s_per_step": now["comm_s"] / steps, "ideal_comm_s_per_step": now["ideal_comm_s"] / steps,
            "retransmit_s_per_step": now["retransmit_s"] / steps,
            "retransmitted_packets": sum(row["resent"] for row in sent.values()),
            "missing_packets": sum(row["missing"] for row in sent.values()),
            "failures": now["failures"], "restart_s": now["restart_s"], **repairs_by_class(network),
            "compute": config.compute, "algorithm": config.algorithm, "transport": config.transport,
            "nic": config.nic}


# -- data parallelism -----------------------------------------------------------------------------

def dp_traffic(dp) -> dict:
    """Data-parallel packets (DDP's gradient buckets; FSDP's gathers and reduce-scatters) sent and lost so
    far over every data-parallel group, and their loss rate."""
    sent = lost = 0
    for summary in dp.summaries():
        for entry in summary:
            sent, lost = sent + entry["sent"], lost + entry["lost"]
    return {"packets_sent_dp": sent, "packets_lost_dp": lost, "observed_loss_rate_dp": lost / sent if sent else 0.0}


def dp_row(dp, state: TrainState) -> dict:
    """A train row's data-parallel columns: traffic and the replicas' drift (kept in ``state``)."""
    drift = dp.drift()
    state.drift.append(drift)
    return {**dp_traffic(dp), "drift": drift}


def dp_summary(dp, config: ExperimentConfig, state: TrainState) -> dict:
    """summary.json's ``data_parallel``: layout, buckets, traffic per link class, drift and time."""
    by_class: dict = {}
    for summary in dp.summaries(by=("link_class",)):
        for entry in summary:
            merged = by_class.setdefault(entry["link_class"], {"sent": 0, "lost": 0})
            merged["sent"] += entry["sent"]
            merged["lost"] += entry["lost"]
    for merged in by_class.values():
        merged["observed_loss_rate"] = merged["lost"] / merged["sent"] if merged["sent"] else 0.0
    return {"dp_size": config.dp_size, "tp_size": config.tp_size, "buckets": len(dp.buckets),
            "bucket_mb": config.dp_bucket_mb, "overlap": config.dp_overlap, "sync_every": config.dp_sync_every,
            "lossy_traffic": config.lossy_traffic, **dp_traffic(dp), "packets_by_class": by_class,
            **({"mode": config.dp_mode} if config.dp_mode != "ddp" else {}),
            "drift_final": dp.drift(), "drift_max": max(state.drift, default=0.0),
            "dp_s_per_step": state.dp_s / max(state.step, 1)}


# -- summary.json ---------------------------------------------------------------------------------

def summary(status: str, diverged_at: Optional[dict], config: ExperimentConfig, dataset: str,
            state: TrainState, train_net: LossyNetwork, eval_net: LossyNetwork, started: float) -> dict:
    """How the run ended and what it measured."""
    final, seen, reached = state.final, state.train_disagreement, state.reached or {}
    return {
        "status": status, "error": None, "name": config.name, "dataset": dataset,
        "config": config.to_dict(), "steps": state.step,
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
        "sim_time": _sim_time_summary(state, train_net, config),
        "time_to_accuracy": {"target": config.target_accuracy, "split": EVAL_SPLITS[0],
                             "step": reached.get("step"), "sim_time_s": reached.get("sim_time_s"),
                             "sim_time_s_ideal_nic": reached.get("sim_time_s_ideal_nic")},
    }


def failure(config: ExperimentConfig, err: BaseException, started: float) -> dict:
    """The summary of a run an exception ended."""
    message = f"{type(err).__name__}: {err}".splitlines()[0]
    return {"status": "failed", "error": message, "name": config.name, "config": config.to_dict(),
            "steps": 0, "wall_time_s": time.time() - started, "versions": versions()}


def versions() -> dict:
    return {"lossysim": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}
