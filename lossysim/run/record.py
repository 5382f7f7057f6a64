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
from ..pp.stages import Pipeline
from ..traffic import CLASSES
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
              disagreement: dict, config: ExperimentConfig, pipeline: Optional[Pipeline] = None) -> dict:
    """A logged training step: the window's averages (``Window.flush``), the clock, traffic so far
    (every stage's TP traffic) and rank divergence; with pipeline stages, ``pp_row``'s columns."""
    stages = [network] if pipeline is None else pipeline.networks
    row = {"step": step, "split": "train", "time_s": time.time() - started, **averages,
           **clock_row(state, network, step, config, pipeline), "lr": lr, **traffic(*stages),
           "disagreement": disagreement["prediction"], "hidden_rel_diff": disagreement["hidden_rel_diff"]}
    if pipeline is not None:
        row.update(pp_traffic(pipeline.boundary_networks()))
    return row


def eval_row(step: int, split: str, started: float, scores: dict, state: TrainState,
             train_net: LossyNetwork, eval_net: LossyNetwork, config: ExperimentConfig,
             pipeline: Optional[Pipeline] = None) -> dict:
    """An evaluation: its scores, this evaluation's traffic, and the training clock it happened at."""
    now = clock(state, train_net, config, pipeline)
    stages = [eval_net] if pipeline is None else pipeline.eval_networks
    return {"step": step, "split": split, "time_s": time.time() - started,
            "sim_time_s": now["sim_time_s"], "sim_time_s_ideal_nic": now["sim_time_s_ideal_nic"],
            "loss": scores["loss"], "accuracy": scores["accuracy"],
            **traffic(*stages), "disagreement": scores["disagreement"],
            "hidden_rel_diff": scores["hidden_rel_diff"],
            **(pp_traffic([b.network for b in pipeline.eval_boundaries]) if pipeline is not None else {})}


def traffic(*networks: LossyNetwork) -> dict:
    """Packets sent and lost per direction so far over ``networks`` (a pipeline's stages), and the loss
    rate over their lossy directions."""
    row = {}
    lost_total = sent_total = 0
    for network in networks:
        for entry in network.summary():
            d = entry["direction"]
            row[f"packets_sent_{d}"] = row.get(f"packets_sent_{d}", 0) + entry["sent"]
            row[f"packets_lost_{d}"] = row.get(f"packets_lost_{d}", 0) + entry["lost"]
            if d in network.lossy:
                sent_total += entry["sent"]
                lost_total += entry["lost"]
    for d in ("fwd", "bwd"):
        row.setdefault(f"packets_sent_{d}", 0)
        row.setdefault(f"packets_lost_{d}", 0)
    row["observed_loss_rate"] = lost_total / sent_total if sent_total else 0.0
    return row


def pp_traffic(boundaries: list[LossyNetwork]) -> dict:
    """The boundaries' packets: activations (``pp_fwd``) and their gradients (``pp_bwd``) sent and lost
    so far, and the loss rate over their lossy directions (``observed_loss_rate_pp``)."""
    found = traffic(*boundaries)
    row = {f"packets_{kind}_pp_{d}": found[f"packets_{kind}_{d}"] for kind in ("sent", "lost") for d in ("fwd", "bwd")}
    row["observed_loss_rate_pp"] = found["observed_loss_rate"]
    return row


# -- the simulated clock ------------------------------------------------------------------------

def _networks(network: LossyNetwork, pipeline: Optional[Pipeline]) -> list[LossyNetwork]:
    """Replica 0's training networks: ``network`` alone, or every stage's and every boundary's."""
    return [network] if pipeline is None else [*pipeline.networks, *pipeline.boundary_networks()]


def _comm(networks: list[LossyNetwork]) -> dict:
    """The networks' clocks summed (one network's clock as it is)."""
    clocks = [network.clock() for network in networks]
    return clocks[0] if len(clocks) == 1 else {key: sum(c[key] for c in clocks) for key in clocks[0]}


def clock_mark(step: int, compute_s: float, network: LossyNetwork, pipeline: Optional[Pipeline] = None) -> dict:
    """The clock at ``step``, kept so the next train row can report per-step rates since it."""
    return {"step": step, "compute_s": compute_s, **_comm(_networks(network, pipeline))}


def clock(state: TrainState, network: LossyNetwork, config: ExperimentConfig,
          pipeline: Optional[Pipeline] = None) -> dict:
    """The simulated cluster's clock (see docs/time_model.md): modelled (or measured) compute, simulated
    communication with its repairs, and a restart for every collective the transport gave up on;
    beside it the same run's clock under the ideal nic (one resend and one round trip per loss, never
    a failure). A failure noticed here is charged once, into ``state``: ``restart_s`` plus
    ``restart_lost_steps`` steps at the run's mean step time so far. With pipeline stages the compute
    and traffic of a step are its schedule's time (``pipeline_s``), failures any stage's or boundary's,
    and ``comm_s`` the traffic time of every stage and boundary summed (not all of it on the path)."""
    networks = _networks(network, pipeline)
    comm = _comm(networks)
    failures = sum(n.totals()["failures"] for n in networks)
    if pipeline is None:
        busy, busy_ideal = state.compute_s + comm["comm_s"], state.compute_s + comm["comm_s_ideal_nic"]
    else:
        busy, busy_ideal = state.pipeline_s, state.pipeline_s_ideal_nic
    if failures > state.failures:
        per_step = busy / max(state.step, 1)
        state.restart_s += (failures - state.failures) * (config.restart_s + config.restart_lost_steps * per_step)
        state.failures = failures
    # with stages a stage's all-to-alls are in its forward and backward: the schedule's step holds them
    ep_s, ep_s_ideal_nic = (state.ep_s, state.ep_s_ideal_nic) if pipeline is None else (0.0, 0.0)
    return {"sim_time_s": busy + ep_s + state.dp_s + state.cp_s + state.restart_s,
            "sim_time_s_ideal_nic": busy_ideal + ep_s_ideal_nic + state.dp_s + state.cp_s_ideal_nic,
            "restart_s": state.restart_s, "failures": failures, **comm}


def clock_row(state: TrainState, network: LossyNetwork, step: int, config: ExperimentConfig,
              pipeline: Optional[Pipeline] = None) -> dict:
    """Simulated time per step since the last row, the cumulative clock, and the waits on retransmission
    timers per link class (so the time can be recomputed for other timers); marks this row. With
    pipeline stages: ``pipeline_s_per_step`` (the schedule's step), ``pp_s_per_step`` (what the boundary
    sends add to it) and ``pp_bubble`` (the stages' idle share of it), over the steps since the last row."""
    now = clock(state, network, config, pipeline)
    last = state.last_row
    steps = max(step - last["step"], 1)
    row = {"sim_time_s": now["sim_time_s"], "sim_time_s_ideal_nic": now["sim_time_s_ideal_nic"],
           "comm_s_per_step": (now["comm_s"] - last["comm_s"]) / steps,
           "retransmit_s_per_step": (now["retransmit_s"] - last["retransmit_s"]) / steps,
           "compute_s_per_step": (state.compute_s - last["compute_s"]) / steps,
           "failures": now["failures"], **repairs_by_class(*_networks(network, pipeline))}
    if config.dp_size > 1:
        row["dp_s_per_step"] = (state.dp_s - last.get("dp_s", 0.0)) / steps
    if config.ep_size > 1:
        row["ep_s_per_step"] = (state.ep_s - last.get("ep_s", 0.0)) / steps
    if config.cp_size > 1:
        row["cp_s_per_step"] = (state.cp_s - last.get("cp_s", 0.0)) / steps
    if pipeline is not None:
        pipeline_s = state.pipeline_s - last.get("pipeline_s", 0.0)
        row.update(pipeline_s_per_step=pipeline_s / steps, pp_s_per_step=(state.pp_s - last.get("pp_s", 0.0)) / steps,
                   pp_bubble=bubble(state.pp_busy_s - last.get("pp_busy_s", 0.0), pipeline_s, pipeline.stages))
    state.last_row = clock_mark(step, state.compute_s, network, pipeline)
    if config.dp_size > 1:
        state.last_row["dp_s"] = state.dp_s
    if config.ep_size > 1:
        state.last_row["ep_s"] = state.ep_s
    if config.cp_size > 1:
        state.last_row["cp_s"] = state.cp_s
    if pipeline is not None:
        state.last_row.update(pipeline_s=state.pipeline_s, pp_s=state.pp_s, pp_busy_s=state.pp_busy_s)
    return row


def bubble(busy_s: float, pipeline_s: float, stages: int) -> float:
    """The stages' idle share of the schedule's time: 1 - busy / (stages x time)."""
    return 1.0 - busy_s / (stages * pipeline_s) if pipeline_s > 0 else 0.0


def repairs_by_class(*networks: LossyNetwork) -> dict:
    """Timer waits so far per link class (``timeouts_intra``, ``timeouts_inter``) over ``networks``."""
    row = {"timeouts_intra": 0, "timeouts_inter": 0}
    for network in networks:
        for entry in network.summary(by=("link_class",)):
            key = f"timeouts_{entry['link_class']}"
            row[key] = row.get(key, 0) + entry["timeouts"]
    return row


def _sim_time_summary(state: TrainState, network: LossyNetwork, config: ExperimentConfig,
                      pipeline: Optional[Pipeline] = None) -> dict:
    steps = max(state.step, 1)
    now = clock(state, network, config, pipeline)
    networks = _networks(network, pipeline)
    sent = [row for n in networks for row in n.summary()]
    return {"total_s": now["sim_time_s"], "total_s_ideal_nic": now["sim_time_s_ideal_nic"],
            "compute_s_per_step": state.compute_s / steps,
            "comm_s_per_step": now["comm_s"] / steps, "ideal_comm_s_per_step": now["ideal_comm_s"] / steps,
            "retransmit_s_per_step": now["retransmit_s"] / steps,
            "retransmitted_packets": sum(row["resent"] for row in sent),
            "missing_packets": sum(row["missing"] for row in sent),
            "failures": now["failures"], "restart_s": now["restart_s"], **repairs_by_class(*networks),
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


# -- expert parallelism ---------------------------------------------------------------------------

def ep_traffic(ep) -> dict:
    """Replica 0's expert all-to-alls (``ep_dispatch``, ``ep_combine``, both directions; every TP rank's
    group): packets sent and lost so far, and their loss rate over the lossy ones (``observed_loss_rate_ep``)."""
    row, sent_lossy, lost_lossy = {}, 0, 0
    for name, rows in ep.summaries().items():
        row[f"packets_sent_{name}"] = sum(r["sent"] for r in rows)
        row[f"packets_lost_{name}"] = sum(r["lost"] for r in rows)
        sent_lossy += sum(r["sent"] for r in rows if r["configured_loss_rate"] > 0)
        lost_lossy += sum(r["lost"] for r in rows if r["configured_loss_rate"] > 0)
    row["observed_loss_rate_ep"] = lost_lossy / sent_lossy if sent_lossy else 0.0
    return row


def ep_summary(ep, config: ExperimentConfig, state: TrainState) -> dict:
    """summary.json's ``expert_parallel``: the layout, replica 0's all-to-alls per class by direction and link
    class, and their seconds per step."""
    return {"ep_size": config.ep_size, "edp_size": config.dp_size // config.ep_size, **ep_traffic(ep),
            "packets_by_class": ep.summaries(by=("direction", "link_class")),
            "ep_s_per_step": state.ep_s / max(state.step, 1)}


# -- pipeline parallelism -------------------------------------------------------------------------

def pp_summary(pipeline: Pipeline, config: ExperimentConfig, state: TrainState) -> dict:
    """summary.json's ``pipeline``: the layout (stages, schedule, micro-batches, blocks per stage, rank
    order), the bubble and the boundary sends' time per step, and every boundary's and stage's traffic."""
    steps = max(state.step, 1)
    return {"pp_size": config.pp_size, "pp_schedule": config.pp_schedule, "microbatches": config.n_microbatches,
            "stage_layers": list(pipeline.layout),
            "bubble": bubble(state.pp_busy_s, state.pipeline_s, pipeline.stages),
            "pipeline_s_per_step": state.pipeline_s / steps, "pp_s_per_step": state.pp_s / steps,
            **pp_traffic(pipeline.boundary_networks()),
            "packets_by_boundary": [n.summary(by=("direction", "link_class")) for n in pipeline.boundary_networks()],
            "packets_by_stage": [n.summary() for n in pipeline.networks]}


# -- context parallelism --------------------------------------------------------------------------

def cp_traffic(networks: list[LossyNetwork]) -> dict:
    """The context groups' packets: keys and values (``cp_fwd``) and their gradients (``cp_bwd``) sent and
    lost so far, and the loss rate over their lossy directions (``observed_loss_rate_cp``)."""
    found = traffic(*networks)
    row = {f"packets_{kind}_cp_{d}": found[f"packets_{kind}_{d}"] for kind in ("sent", "lost") for d in ("fwd", "bwd")}
    row["observed_loss_rate_cp"] = found["observed_loss_rate"]
    return row


def cp_summary(context, config: ExperimentConfig, state: TrainState) -> dict:
    """summary.json's ``context_parallel``: the layout, what the exchanges added per step, and every
    context group's traffic per direction and link class."""
    return {"cp_size": config.cp_size, "cp_mode": config.cp_mode, "cp_s_per_step": state.cp_s / max(state.step, 1),
            **cp_traffic(context.train_networks.cp),
            "packets_by_group": [n.summary(by=("direction", "link_class")) for n in context.train_networks.cp]}


# -- every traffic class ---------------------------------------------------------------------------

def traffic_summary(network: LossyNetwork, pipeline: Optional[Pipeline], dp, ep=None, context=None) -> dict:
    """summary.json's ``traffic``: every class (``lossysim.traffic``) the run sent, per direction: packets
    sent and lost, the observed loss rate and whether the direction may lose packets (``lossy``). Replica
    0's TP, pipeline, expert (every TP rank's ep group) and context traffic, every data-parallel group's."""
    carriers = {"tp": [network] if pipeline is None else pipeline.networks,
                "pp": pipeline.boundary_networks() if pipeline is not None else [],
                "fsdp" if dp.fsdp else "dp": dp.networks if dp.dp_size > 1 else [],
                "cp": context.train_networks.cp if context is not None else []}
    experts = ep.summaries() if ep is not None and ep.mesh.ep > 1 else {}
    carriers.update({name: [ep.groups[0].train[name]] for name in experts})
    out = {}
    for cls in CLASSES:
        networks = carriers.get(cls.name, [])
        if not networks:
            continue
        if cls.axis == "dp":
            summaries = dp.summaries()
        elif cls.axis == "ep":   # (dist: gathered over the TP group)
            summaries = [experts[cls.name]]
        else:
            summaries = [n.summary() for n in networks]
        per = {}
        for kind in cls.directions:
            sent = sum(e["sent"] for s in summaries for e in s if e["direction"] == kind.direction)
            lost = sum(e["lost"] for s in summaries for e in s if e["direction"] == kind.direction)
            per[kind.direction] = {"sent": sent, "lost": lost, "observed_loss_rate": lost / sent if sent else 0.0,
                                   "lossy": kind.direction in networks[0].lossy}
        out[cls.name] = per
    return out


# -- NCCL's choices -------------------------------------------------------------------------------

def collectives(network: LossyNetwork, pipeline: Optional[Pipeline] = None, dp=None, context=None) -> list[dict]:
    """summary.json's ``collectives``: every training network's ``LossyNetwork.choices()`` (one record per
    site, direction, collective and message size), each tagged with the ``network`` it ran on: ``tp``
    (stage ``s``'s: ``tp.stage{s}``), ``pp.boundary{b}`` (stage b to b+1), ``dp.tp{t}`` (TP position t's
    data-parallel group; this process's alone on ``dist``), ``cp.tp{t}`` (TP position t's context group)."""
    named = [("tp", network)] if pipeline is None else [(f"tp.stage{s}", n) for s, n in enumerate(pipeline.networks)]
    if pipeline is not None:
        named += [(f"pp.boundary{b}", n) for b, n in enumerate(pipeline.boundary_networks())]
    if dp is not None and dp.dp_size > 1:
        kind = "fsdp" if dp.fsdp else "dp"
        named += [(f"{kind}.tp{t}" if len(dp.stage_networks) == 1 else f"{kind}.stage{s}.tp{t}", n)
                  for s, stage in enumerate(dp.stage_networks) for t, n in enumerate(stage)]
    if context is not None:
        named += [(f"cp.tp{t}", n) for t, n in zip(context.tp_positions, context.train_networks.cp)]
    return [{"network": name, **choice} for name, n in named for choice in n.choices()]


# -- summary.json ---------------------------------------------------------------------------------

def summary(status: str, diverged_at: Optional[dict], config: ExperimentConfig, dataset: str,
            state: TrainState, train_net: LossyNetwork, eval_net: LossyNetwork, started: float,
            pipeline: Optional[Pipeline] = None) -> dict:
    """How the run ended and what it measured."""
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
        "sim_time": _sim_time_summary(state, train_net, config, pipeline),
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
