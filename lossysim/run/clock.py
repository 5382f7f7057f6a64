"""The simulated cluster's clock as a run records it (see docs/time_model.md): the networks' clocks summed,
a failure's restart charged, the per-step rates of a metrics row and summary.json's ``sim_time``."""
from __future__ import annotations

from typing import Optional

from .. import axes
from ..config import ExperimentConfig
from ..net import LossyNetwork, cable_events
from ..pp.record import bubble
from ..pp.stages import Pipeline
from .state import TrainState


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
          pipeline: Optional[Pipeline] = None, failed: Optional[int] = None) -> dict:
    """The simulated cluster's clock (see docs/time_model.md): modelled (or measured) compute, simulated
    communication with its repairs, and a restart for every collective the transport gave up on;
    beside it the same run's clock under the ideal nic (one resend and one round trip per loss, never
    a failure). A failure noticed here is charged once, into ``state``: ``restart_s`` plus
    ``restart_lost_steps`` steps at the run's mean step time so far. With pipeline stages the compute
    and traffic of a step are its schedule's time (``pipeline_s``), failures any stage's or boundary's,
    and ``comm_s`` the traffic time of every stage and boundary summed (not all of it on the path).
    ``failed``: the job's failed collectives, every network's (``run.failures.count``); None: replica 0's
    TP and pipeline networks' alone (a caller without the run's parts)."""
    networks = _networks(network, pipeline)
    comm = _comm(networks)
    if failed is None:
        failed = sum(n.totals()["failures"] for n in networks)
    failures = failed + cable_events.failures()
    if pipeline is None:
        busy, busy_ideal = state.compute_s + comm["comm_s"], state.compute_s + comm["comm_s_ideal_nic"]
    else:
        busy, busy_ideal = state.pipeline_s, state.pipeline_s_ideal_nic
    if failures > state.failures:
        per_step = busy / max(state.step, 1)
        state.restart_s += (failures - state.failures) * (config.restart_s + config.restart_lost_steps * per_step)
        state.failures = failures
    return {"sim_time_s": _added(state, busy, "sim_time_s", pipeline) + state.restart_s,
            "sim_time_s_ideal_nic": _added(state, busy_ideal, "sim_time_s_ideal_nic", pipeline),
            "restart_s": state.restart_s, "failures": failures, **comm}


def _added(state: TrainState, seconds: float, column: str, pipeline: Optional[Pipeline]) -> float:
    """``seconds`` plus every axis's counters that add to the clock's ``column`` (``Counter.clock``), in their
    ``clock_order``; with stages, not those the schedule holds (``scheduled``)."""
    added = sorted((c for c in axes.counters() if column in c.clock), key=lambda c: c.clock_order)
    for counter in added:
        if not (counter.scheduled and pipeline is not None):
            seconds = seconds + getattr(state, counter.name)
    return seconds


def _rated(config: ExperimentConfig) -> list:
    """The counters whose rate per step a train row reports: those of every axis the run spreads over."""
    return [c for axis in axes.AXES if axis.used(config) for c in axis.counters if c.per_step]


def clock_row(state: TrainState, network: LossyNetwork, step: int, config: ExperimentConfig,
              pipeline: Optional[Pipeline] = None, failed: Optional[int] = None) -> dict:
    """Simulated time per step since the last row, the cumulative clock, and the waits on retransmission
    timers per link class (so the time can be recomputed for other timers); marks this row. Every used
    axis's counters per step (``dp_s_per_step``, ...); with pipeline stages: ``pipeline_s_per_step`` (the
    schedule's step), ``pp_s_per_step`` (what the boundary sends add to it) and ``pp_bubble`` (the stages'
    idle share of it), over the steps since the last row."""
    now = clock(state, network, config, pipeline, failed)
    last = state.last_row
    steps = max(step - last["step"], 1)
    row = {"sim_time_s": now["sim_time_s"], "sim_time_s_ideal_nic": now["sim_time_s_ideal_nic"],
           "comm_s_per_step": (now["comm_s"] - last["comm_s"]) / steps,
           "retransmit_s_per_step": (now["retransmit_s"] - last["retransmit_s"]) / steps,
           "compute_s_per_step": (state.compute_s - last["compute_s"]) / steps,
           "failures": now["failures"], **repairs_by_class(*_networks(network, pipeline))}
    rated = _rated(config)
    for counter in rated:
        row[counter.per_step] = (getattr(state, counter.name) - last.get(counter.name, 0.0)) / steps
    if pipeline is not None:
        pipeline_s = state.pipeline_s - last.get("pipeline_s", 0.0)
        row.update(pipeline_s_per_step=pipeline_s / steps, pp_s_per_step=(state.pp_s - last.get("pp_s", 0.0)) / steps,
                   pp_bubble=bubble(state.pp_busy_s - last.get("pp_busy_s", 0.0), pipeline_s, pipeline.stages))
    state.last_row = clock_mark(step, state.compute_s, network, pipeline)
    for counter in rated:
        state.last_row[counter.name] = getattr(state, counter.name)
    if pipeline is not None:
        state.last_row.update(pipeline_s=state.pipeline_s, pp_s=state.pp_s, pp_busy_s=state.pp_busy_s)
    return row


def repairs_by_class(*networks: LossyNetwork) -> dict:
    """Timer waits so far per link class (``timeouts_intra``, ``timeouts_inter``) over ``networks``."""
    row = {"timeouts_intra": 0, "timeouts_inter": 0}
    for network in networks:
        for entry in network.summary(by=("link_class",)):
            key = f"timeouts_{entry['link_class']}"
            row[key] = row.get(key, 0) + entry["timeouts"]
    return row


def sim_time_summary(state: TrainState, network: LossyNetwork, config: ExperimentConfig,
                     pipeline: Optional[Pipeline] = None, failed: Optional[int] = None) -> dict:
    """summary.json's ``sim_time``: the clock's totals and rates per step, repairs and failures (``failed``:
    as ``clock`` takes it)."""
    steps = max(state.step, 1)
    now = clock(state, network, config, pipeline, failed)
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
