"""What a fabric's link events (``link_event``, ``fabric.events``) do to an estimated job: the estimate's
``event_*`` columns, only when events are given (a row without them stays as it was).

The job's flows are its groups' traffic on the routes: each class's ring (tp, dp and fsdp, cp), or NCCL's
double binary tree where its all-reduce runs as one (``collisions.trees``: tp and DDP's buckets under
``algorithm=tree`` or ``auto``'s pick, the tree's edges weighted as ``fabric.load.tree_flows`` weighs them),
every pipeline boundary both ways (pp) and every pair of an expert group (ep), each rank's flow split over the
spec's channels, a class's bytes of a step (its packets sent times the payload) spread evenly over its
flows. A step is then, as ``fabric.events.run_steps`` runs it, the estimate's compute then one call of
the rest of its mean step (its communication, with its repairs) on those loads; the job runs
``event_steps`` of them from t = 0 through the events, a failed collective paying ``restart_s`` and
``restart_lost_steps`` steps redone, as training charges it. The simplification, stated: every class's
traffic is taken to be in flight during that one call, so an outage during the compute (where DP's
buckets may overlap) is met only at the call. With ``--hours H`` (``checked_over``) the events are the
hours' schedule: checked against the H hours, not refused for falling past the step's run, whose steps
meet what falls in them.
"""
from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from typing import Optional

import numpy as np

from .. import traffic
from ..config.fabric import event_schedule
from ..fabric.events import REROUTE_S, LinkSchedule, run_steps
from ..fabric.load import Flow, cable_loads, tree_flows
from ..timing.retransmission import outage_waits
from .collisions import trees

# the seconds the events are checked against beside the step's run (``--hours``' H hours; None: the run's)
CHECKED_OVER_S: Optional[float] = None


@contextlib.contextmanager
def checked_over(seconds: Optional[float]):
    """Check the estimate's link events against ``seconds`` (None: the step's run alone) while the block runs."""
    global CHECKED_OVER_S
    previous, CHECKED_OVER_S = CHECKED_OVER_S, seconds
    try:
        yield
    finally:
        CHECKED_OVER_S = previous


def _pairs(mesh, cls: str) -> list[tuple[int, int]]:
    """The (src, dst) global rank pairs a class's traffic runs between: over its axis's groups, as its
    ``TrafficClass.flows`` says."""
    declared = traffic.BY_NAME.get(cls)
    if declared is None:
        return []
    groups = mesh.groups(declared.axis)
    if declared.flows == "sends":
        return [pair for g in groups for s in range(len(g) - 1) for pair in ((g[s], g[s + 1]), (g[s + 1], g[s]))]
    if declared.flows == "all_to_all":
        return [(a, b) for g in groups for a in g for b in g if a != b]
    return [(g[i], g[(i + 1) % len(g)]) for g in groups if len(g) > 1 for i in range(len(g))]


def _flows(mesh, classes, row: dict, payload: int, channels: int, tree_classes: tuple = (),
           per_node: int = 1) -> dict[str, list[Flow]]:
    out = {}
    for cls in classes:
        sent = float(row.get(f"{cls}_packets_sent", 0.0)) * payload
        if cls in tree_classes and sent > 0:   # NCCL's trees (``collisions.trees``): the tree's edges, its own weights
            unit = tree_flows(mesh.groups(traffic.BY_NAME[cls].axis), 1.0, channels, per_node)
            if unit:
                scale = sent / sum(f.bytes for f in unit)
                out[cls] = [Flow(f.src, f.dst, f.bytes * scale, f.channel) for f in unit]
            continue
        pairs = _pairs(mesh, cls)
        if pairs and sent > 0:
            each = sent / (len(pairs) * channels)
            out[cls] = [Flow(a, b, each, c) for a, b in pairs for c in range(channels)]
    return out


def columns(config, job, row: dict) -> dict:
    """The ``event_*`` columns of an estimate's ``row`` (empty without link events)."""
    if not str(config.link_event or "").strip():
        return {}
    spec = job.tp[0][0].spec
    routes = spec.cables.routes
    flows = _flows(config.mesh(), job.classes, row, spec.payload_bytes, spec.channels, trees(config),
                   routes.per_node)
    loads = {cls: cable_loads(routes, f) for cls, f in flows.items()}
    total = sum(loads.values()) if loads else np.zeros(len(routes.fabric.cables))
    compute_s, step_s = float(row["compute_s"]), float(row["step_mean_s"])
    steps = int(config.event_steps)
    run_s = steps * step_s
    span = max(run_s, CHECKED_OVER_S or 0.0)
    try:
        event_schedule(config, span)            # the run's end: known once its step is
    except ValueError as error:
        raise ValueError(f"{error} ({steps} event_steps of {step_s:.4g} s)") from None
    # open-ended events last through the stalls and restarts the run pays past its event-free end
    horizon = max(100 * run_s + 100 * float(config.restart_s) + 1.0, span)
    schedule = event_schedule(config, horizon)
    drop = spec.transport == "drop"
    waits = outage_waits(spec.nic_model, int(config.ib_timeout), rtt_s=2 * spec.link_inter.alpha)
    run = run_steps(schedule, total, steps, compute_s, step_s - compute_s, waits, REROUTE_S[config.reroute],
                    restart_s=float(config.restart_s), lost_steps=int(config.restart_lost_steps),
                    max_failures=max(steps, 100), drop=drop)
    return {"link_event": config.link_event, "reroute": config.reroute, "ib_timeout": int(config.ib_timeout),
            "event_flows": describe(schedule, routes, flows), "event_steps": steps,
            "event_free_job_s": run_s, "event_job_s": run.end_s, "event_step_s": run.end_s / steps,
            "event_steps_slowed": run.slowed_steps, "event_calls_later": run.later_calls,
            "event_calls_dropped": run.dropped_calls, "event_failures": run.failures,
            "event_restarts": run.failures, "event_stalled_s": run.stalled_s, "event_slowed_s": run.slowed_s,
            "event_restart_s": run.restart_s}


def describe(schedule: LinkSchedule, routes, flows: dict[str, list[Flow]]) -> str:
    """Per event cable, the flows (queue pairs or sprayed shares) of each class routed over it, either
    way: ``leaf0-spine9: dp 16 flows, pp 0 flows``."""
    named = {}
    for index, events in sorted(schedule.events.items()):
        named.setdefault(events[0].cable, set()).add(index)
    parts = []
    for name, cables in named.items():
        counts = defaultdict(float)
        for cls, class_flows in flows.items():
            for f in class_flows:
                for route in routes.connection(f.src, f.dst, f.channel):
                    if cables.intersection(route.cables):
                        counts[cls] += 1.0 / route.modulus if routes.spray else 1.0
        text = ", ".join(f"{cls} {_count(n)} flows" for cls, n in sorted(counts.items())) or "no flows"
        parts.append(f"{name}: {text}")
    return " | ".join(parts)


def _count(n: float) -> str:
    return f"{n:.0f}" if math.isclose(n, round(n)) else f"{n:.3g}"


def report(row: dict) -> str:
    """The line the estimate prints after its table, for a row with link events."""
    return (f"link events ({row['transport']}, {row['nic']}, reroute {row['reroute']}, ib_timeout {row['ib_timeout']}):"
            f" {row['event_flows']}; over {row['event_steps']} steps: {row['event_job_s']:.6g} s "
            f"(without events {row['event_free_job_s']:.6g} s; {row['event_step_s']:.4g} s a step), "
            f"{row['event_steps_slowed']} steps slowed, {row['event_calls_later']} calls ended later, "
            f"{row['event_calls_dropped']} calls dropped packets, {row['event_failures']} collectives failed, "
            f"{row['event_restarts']} restarts ({row['event_restart_s']:.6g} s)")
