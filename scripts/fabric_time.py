"""The figures of docs/fabric.md's sections on collisions, link events and a month of cable failures.

    PYTHONPATH=. python scripts/fabric_time.py [collisions] [events] [month]

Collisions: the DP rings and pipeline boundaries of Llama-3.1-70B's and DeepSeek-V3's layouts on a
2,048-GPU SuperPOD (superpod:8), ECMP with 1 and 4 queue pairs per connection and spraying, loss-free
(the factor a fabric-free step time is multiplied by; mean of 10 hash seeds, 2 channels a connection).
Events: one step's worth of a DP ring under a flapping or downed cable, by transport. Month: 30 days on
16,384 GPUs (superpod:64) next to Llama 3's 54 days.
"""
from __future__ import annotations

import sys

import numpy as np

from lossysim.fabric import Routes, superpod
from lossysim.fabric.events import REROUTE_S, LinkSchedule, run_steps
from lossysim.fabric.load import Flow, cable_loads, ring_flows, slowdown
from lossysim.fabric.reliability import LLAMA3, expected_cost, llama3_rates
from lossysim.mesh import Mesh
from lossysim.timing.retransmission import NIC_PRESETS, outage_waits

CHANNELS = 2
LAYOUTS = {   # name: Mesh keywords (2,048 GPUs, 8 to a node)
    "llama-3.1-70b tp8 pp4 dp64 (Megatron order)": dict(tp=8, pp=4, dp=64),
    "llama-3.1-70b tp8 pp4 dp64 (Llama 3 order tp-cp-pp-dp)": dict(tp=8, pp=4, dp=64, order="tp-cp-pp-ep-dp"),
    "deepseek-v3 tp1 pp16 dp128 ep64": dict(tp=1, pp=16, dp=128, ep=64, ranks_per_node=8),
}


def _pp_flows(mesh: Mesh, bytes_: float) -> list[Flow]:
    """Every pipeline boundary's sends at once: each rank of stage s to its peer in stage s + 1."""
    stages = mesh.groups("pp")
    return [Flow(g[s], g[s + 1], bytes_ / CHANNELS, c) for g in stages for s in range(len(g) - 1)
            for c in range(CHANNELS)]


def collisions() -> None:
    pod = superpod(8)
    print(f"{'layout':58} {'traffic':8} {'ecmp q1':>8} {'ecmp q4':>8} {'spray':>6}")
    for name, keywords in LAYOUTS.items():
        mesh = Mesh(ranks_per_node=keywords.pop("ranks_per_node", 8), **keywords)
        for traffic, flows in (("dp ring", ring_flows(mesh.groups("dp"), 64 * 2**20, CHANNELS)),
                               ("pp send", _pp_flows(mesh, 64 * 2**20))):
            q1 = np.mean([slowdown(Routes(pod, 8, seed=s), flows) for s in range(10)])
            q4 = np.mean([slowdown(Routes(pod, 8, seed=s, qps_per_connection=4), flows) for s in range(10)])
            spray = slowdown(Routes(pod, 8, spray=True), flows)
            print(f"{name:58} {traffic:8} {q1:8.2f} {q4:8.2f} {spray:6.2f}", flush=True)


def events() -> None:
    """1,000 steps of 10 s (8 s compute, then 2 s of the DP rings, Llama 3 order) under a flap of
    one leaf-spine cable the rings cross (every 307 s, down 5 s), and under a NIC cable down 60 s."""
    pod = superpod(8)
    mesh = Mesh(tp=8, pp=4, dp=64, ranks_per_node=8, order="tp-cp-pp-ep-dp")
    loads = cable_loads(Routes(pod, 8), ring_flows(mesh.groups("dp"), 64 * 2**20, CHANNELS))
    uplink = next(pod.cables[i].name for i in np.flatnonzero(loads)
                  if pod.tier(pod.cables[i].src) == "leaf" and pod.tier(pod.cables[i].dst) == "spine")
    nic = next(pod.cables[i].name for i in np.flatnonzero(loads) if pod.tier(pod.cables[i].src) == "nic")
    run_s = 40000.0
    cases = {f"{uplink} flaps (307 s, 5 s down), ecmp reroute 1 s": ([f"{uplink}:flap:at=108.5,period=307,down=5"], "ecmp"),
             f"{uplink} flaps, no reroute": ([f"{uplink}:flap:at=108.5,period=307,down=5"], "none"),
             f"{nic} down 60 s at 1000 s": ([f"{nic}:down:at=1000,for=60"], "ecmp")}
    print(f"{'case':64} {'nic':17} {'end_s':>9} {'failures':>8} {'stalled_s':>9} {'restarts_s':>10}")
    for case, (given, reroute) in cases.items():
        schedule = LinkSchedule(pod, given, run_s)
        for nic_name in ("irn", "roce-gbn", "tcp", "ideal"):
            run = run_steps(schedule, loads, 1000, 8.0, 2.0, outage_waits(NIC_PRESETS[nic_name], rtt_s=20e-6),
                            REROUTE_S[reroute], checkpoint_every=100, restart_s=300.0)
            print(f"{case:64} {nic_name:17} {run.end_s:9.1f} {run.failures:8d} {run.stalled_s:9.2f} "
                  f"{run.restart_s:10.1f}", flush=True)


def month() -> None:
    pod = superpod(64)
    other = llama3_rates()["other_per_day"]
    print(f"Llama 3: {LLAMA3['interruptions']} interruptions in {LLAMA3['days']} days on {LLAMA3['gpus']} GPUs "
          f"({LLAMA3['network']} switch or cable), over {100 * LLAMA3['effective']:.0f}% effective")
    print(f"{'setting':58} {'cable_fail':>10} {'interrupt':>9} {'around':>6} {'GPU-h lost':>10} {'effective':>9}")
    for name, kwargs in (("54 days, cables only", dict(hours=54 * 24)),
                         ("54 days, + Llama 3's other causes", dict(hours=54 * 24, other_per_day=other)),
                         ("30 days, cables only", dict(hours=720)),
                         ("30 days, + other causes, checkpoint 30 min", dict(hours=720, other_per_day=other)),
                         ("30 days, + other causes, checkpoint 10 min", dict(hours=720, other_per_day=other,
                                                                             checkpoint_s=600)),
                         ("30 days, cables only, no reroute", dict(hours=720, reroute_s=REROUTE_S["none"])),
                         ("30 days, cables only, mttf 10,000 h (corruption onsets)", dict(hours=720, mttf_h=1e4))):
        c = expected_cost(pod, **kwargs)
        print(f"{name:58} {c.cable_failures:10.1f} {c.interruptions:9.1f} {c.routed_around:6.1f} "
              f"{c.gpu_hours_lost:10.0f} {100 * c.effective:8.1f}%", flush=True)


if __name__ == "__main__":
    chosen = sys.argv[1:] or ["collisions", "events", "month"]
    for part in chosen:
        {"collisions": collisions, "events": events, "month": month}[part]()
