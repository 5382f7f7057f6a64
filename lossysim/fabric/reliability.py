"""A run's worth of cable failures: how many a job meets in H hours on its fabric, which of them
interrupt it, and what they cost in GPU-hours and effective training time.

A physical cable fails (both directions down) as a Poisson process of rate 1 / ``mttf_h`` and stays
down ``repair_h``. A failure interrupts the job when the flows on the cable cannot get a path back
before their transport gives up (``events.resume_at``): a NIC's cable to its leaf never can (one NIC per
rail, single-homed), a switch's cable can once routes reconverge (``reroute_s``) if that is before the
last retry, else it cannot either (repairs take hours). An interruption costs the time the transport
takes to give up, ``restart_s``, and the work since the last checkpoint (half of ``checkpoint_s`` on
average: a failure falls uniformly in the interval); a failure routed around stalls every rank until
the first retry after the reroute. Every cable within the job's reach is taken to carry its traffic
(its nodes' NIC cables; of the switches' cables the job's share of the nodes), so the figures are an
upper bound for jobs whose flows leave cables idle. ``other_per_day``: interruptions from anything
else (GPUs, hosts, software), at their own rate.

Defaults and their sources:

- ``CABLE_MTTF_H``, 1.82 M hours: Llama 3's 35 switch-or-cable interruptions in 54 days on 16,384
  GPUs (Dubey et al. 2024) over the 49,152 physical cables of a 64-SU SuperPOD that size (node-leaf,
  leaf-spine, spine-core; ``superpod``): a calibration, and an upper bound on the cable rate since the
  35 include switches. LinkGuardian's 10,000 h (after Meza et al., IMC 2018) is the onset of corruption,
  loss a cable keeps (``cables.py``), not an outage: on 49,152 cables it would be about 3,500 outages a
  month, a hundred times what Llama 3 reports.
- ``REPAIR_H``, 48 h: most corrupting links are repaired within 2 days (Zhuo et al., SIGCOMM 2017).
- ``restart_s`` 300 s: ``ExperimentConfig.restart_s``'s assumption; ``checkpoint_s`` 1800 s an assumption.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np

from ..timing.retransmission import NIC_PRESETS, outage_waits
from ..util import stream_seed
from .events import REROUTE_S, LinkEvent, resume_at
from .graph import NIC, Fabric

LLAMA3 = {"gpus": 16384, "days": 54, "interruptions": 419, "network": 35, "nic": 7, "watchdog": 7,
          "effective": 0.90}
SUPERPOD64_CABLES = 3 * 16384
CABLE_MTTF_H = LLAMA3["days"] * 24 * SUPERPOD64_CABLES / LLAMA3["network"]
REPAIR_H = 48.0
RC_WAITS = outage_waits(NIC_PRESETS["roce-gbn-timeout"])   # NCCL_IB_TIMEOUT 20, 7 retries: 34.4 s


@dataclass(frozen=True)
class Cost:
    hours: float
    gpus: int
    cables: float                 # physical cables within the job's reach
    cable_failures: float
    interruptions: float          # cable failures that end the job's collective, plus other causes
    routed_around: float          # cable failures the job lives through, stalled
    gpu_hours_lost: float
    effective: float              # share of the hours spent on steps kept

    def row(self) -> dict:
        return asdict(self)


def cables_in_reach(fabric: Fabric, nodes: Optional[int] = None) -> tuple[list[int], list[int], float]:
    """The job's NIC cables (each physical cable by its upward direction), the fabric's switch-to-switch
    cables, and the share of those counted (the job's share of the nodes)."""
    nodes = fabric.nodes if nodes is None else int(nodes)
    fabric.check_nodes(nodes)
    order = ["nic", *dict.fromkeys(fabric.tier(s) for s in fabric.switches)]
    nic, switch = [], []
    for i, c in enumerate(fabric.cables):
        low, high = fabric.tier(c.src), fabric.tier(c.dst)
        if order.index(low) > order.index(high):
            continue
        if low == "nic":
            if int(NIC.match(c.src)[1]) < nodes:
                nic.append(i)
        else:
            switch.append(i)
    return nic, switch, nodes / fabric.nodes


def _outcome(reroute_s: float, waits: Optional[Sequence[float]], repair_s: float) -> tuple[bool, float]:
    """(interrupts, seconds lost) of one switch cable's failure: every rank waits for the first retry
    after the reroute, or the transport gives up."""
    resumed, failed = resume_at(0.0, min(reroute_s, repair_s), waits)
    return failed, resumed


def expected_cost(fabric: Fabric, hours: float, nodes: Optional[int] = None, gpus: Optional[int] = None,
                  mttf_h: float = CABLE_MTTF_H, repair_h: float = REPAIR_H, reroute_s: float = REROUTE_S["ecmp"],
                  waits: Optional[Sequence[float]] = RC_WAITS, restart_s: float = 300.0,
                  checkpoint_s: float = 1800.0, other_per_day: float = 0.0) -> Cost:
    """The expected figures of ``hours`` of a job of ``gpus`` (default a GPU per NIC) on ``nodes``
    (default all) of ``fabric``."""
    _check(hours, mttf_h, repair_h, restart_s, checkpoint_s, other_per_day)
    nic, switch, share = cables_in_reach(fabric, nodes)
    gpus = len(nic) if gpus is None else int(gpus)
    rate = hours / mttf_h
    nic_failures, switch_failures = len(nic) * rate, len(switch) * share * rate
    interrupts, stall = _outcome(reroute_s, waits, repair_h * 3600)
    give_up = sum(waits) if waits is not None else 0.0
    per_interruption = give_up + restart_s + checkpoint_s / 2
    interruptions = nic_failures + (switch_failures if interrupts else 0.0) + other_per_day * hours / 24
    around = 0.0 if interrupts else switch_failures
    lost_s = interruptions * per_interruption + around * stall
    return Cost(hours, gpus, len(nic) + len(switch) * share, nic_failures + switch_failures, interruptions,
                around, gpus * lost_s / 3600, max(0.0, 1 - lost_s / (hours * 3600)))


def draw_failures(fabric: Fabric, hours: float, seed: int = 0, nodes: Optional[int] = None,
                  mttf_h: float = CABLE_MTTF_H, repair_h: float = REPAIR_H) -> list[LinkEvent]:
    """Cable failures over ``hours`` drawn at ``seed``: onsets Poisson per physical cable (one failing
    again only after its repair), each a ``down`` event for ``repair_h`` (cut at the run's end), in time
    order. The switch cables counted are the job's share, drawn as a fixed subset of them."""
    _check(hours, mttf_h, repair_h, 0.0, 0.0, 0.0)
    nic, switch, share = cables_in_reach(fabric, nodes)
    rng = np.random.default_rng(stream_seed(seed, fabric.name, "cable-failures"))
    switch = list(np.asarray(switch)[rng.permutation(len(switch))[:round(share * len(switch))]])
    cables = np.array(sorted(nic + [int(c) for c in switch]), dtype=int)
    run_s, repair_s = hours * 3600, repair_h * 3600
    counts = rng.poisson(hours / mttf_h, size=len(cables))
    events = []
    for cable, count in zip(cables[counts > 0], counts[counts > 0]):
        ready = 0.0
        for at in np.sort(rng.uniform(0, run_s, size=count)):
            if at < ready:
                continue                     # still in repair: the onset is the same outage
            events.append(LinkEvent(fabric.cables[cable].name, "down", float(at), min(repair_s, run_s - at)))
            ready = at + repair_s
    return sorted(events, key=lambda e: e.at)


def drawn_cost(fabric: Fabric, events: Sequence[LinkEvent], hours: float, nodes: Optional[int] = None,
               gpus: Optional[int] = None, reroute_s: float = REROUTE_S["ecmp"],
               waits: Optional[Sequence[float]] = RC_WAITS, restart_s: float = 300.0, checkpoint_s: float = 1800.0,
               seed: int = 0) -> Cost:
    """The figures of one draw (``draw_failures``): each failure interrupts or is routed around by
    the same rules as ``expected_cost``, an interruption losing the work since a checkpoint at a
    uniform point of its interval (drawn at ``seed``)."""
    nic, switch, share = cables_in_reach(fabric, nodes)
    gpus = len(nic) if gpus is None else int(gpus)
    rng = np.random.default_rng(stream_seed(seed, fabric.name, "checkpoint-phase"))
    give_up = sum(waits) if waits is not None else 0.0
    interruptions, around, lost_s = 0, 0, 0.0
    for event in events:
        c = fabric.cables[fabric.cable(event.cable)]
        ends_it, stall = ((True, 0.0) if "nic" in (fabric.tier(c.src), fabric.tier(c.dst))
                          else _outcome(reroute_s, waits, event.duration))
        if ends_it:
            interruptions += 1
            lost_s += give_up + restart_s + rng.uniform(0, checkpoint_s)
        else:
            around += 1
            lost_s += stall
    return Cost(hours, gpus, len(nic) + len(switch) * share, len(events), interruptions, around,
                gpus * lost_s / 3600, max(0.0, 1 - lost_s / (hours * 3600)))


def llama3_rates() -> dict:
    """Llama 3's reported interruptions per day: all causes and switch-or-cable alone."""
    days = LLAMA3["days"]
    return {"all_per_day": LLAMA3["interruptions"] / days, "network_per_day": LLAMA3["network"] / days,
            "other_per_day": (LLAMA3["interruptions"] - LLAMA3["network"]) / days}


def _check(hours, mttf_h, repair_h, restart_s, checkpoint_s, other_per_day) -> None:
    for name, value, low in (("hours", hours, 0), ("mttf_h", mttf_h, 0), ("repair_h", repair_h, 0)):
        if not isinstance(value, (int, float)) or math.isnan(value) or not value > low or math.isinf(value):
            raise ValueError(f"{name}={value!r} must be a number > 0")
    for name, value in (("restart_s", restart_s), ("checkpoint_s", checkpoint_s), ("other_per_day", other_per_day)):
        if not isinstance(value, (int, float)) or math.isnan(value) or value < 0 or math.isinf(value):
            raise ValueError(f"{name}={value!r} must be a number >= 0")
