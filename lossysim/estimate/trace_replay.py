"""Replaying a profiler trace (``estimate.trace``) through the lossy network: the user's own job, its own
calls, its own compute, on the layout the flags describe (docs/estimate.md, "Estimate your own job").

**Classes.** Each process group's axis and traffic class, and each call's network, are the layout's
(``trace_layout.Layout``: the mesh axis whose group it is). A group that is no axis's group (the world group
of a 3-D job), a collective the network has no model of (broadcast, barrier, ...) and an all-to-all (an
expert group is no axis of the mesh's: ``ep`` lives inside dp) are not sent: they are counted, named and take
no time (their traced time on gloo or in an NCCL kernel is mostly waiting for peers, which the replay models
itself).

**Networks.** Each group's calls go through ``LossyNetwork.simulate`` on its network, at sites
``<class>.<collective><k>`` (the k-th call of the step on that network), every packet a candidate: the same
code, transports, clock and statistics as every estimate (``accounting.Tally`` counts them). With every
rank's trace every group is simulated; one mirrored file simulates the traced rank's groups, each standing
for its alike groups (their counts multiplied; the slowest of them is not modelled).

**The clock.** Per rank, the traced step is its compute stream's work and its calls. A call is issued
when its rank's stream reached it; it starts when every member has issued it and its group's previous
call has ended (a send when both ends have), and takes its simulated seconds. A pause of the compute
stream that ends when one of the rank's calls ends is a wait for it: on the replay's clock the stream
resumes when that call's simulated end (plus the traced reaction) comes, or at once if it has ended; every
other interval keeps its traced length (``compute: trace``), or that length scaled so a step's compute is
the named model's (``--trace`` with a model: ``compute: modelled``). What overlaps in the trace overlaps on
the clock; a step ends when the last rank's stream and calls do. Each simulated step replays one traced
step, in turn.
"""
from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch

from .. import traffic
from ..config import ExperimentConfig
from ..net import LossyNetwork
from ..net.algorithms import COLLECTIVES
from .accounting import CLASSES, Tally, held_elements, intervals, mark
from .blast import describe
from .trace import Call, Trace
from .trace_layout import Layout, Place

US = 1e-6


@dataclasses.dataclass
class _Transfer:
    """One call as the group made it: its members' issues (seconds from their step's start), where it goes."""
    id: int
    call: Call
    cls: Optional[str]
    place: Optional[Place]
    direction: str
    pair: Optional[tuple]
    stream: tuple
    issues: dict = dataclasses.field(default_factory=dict)
    ends: dict = dataclasses.field(default_factory=dict)      # traced ends, per member


class _Point(NamedTuple):
    t: float            # seconds from the rank's step start (scaled)
    kind: str           # "issue" | "wait"
    transfer: int
    a: float = 0.0      # a wait: the pause's start, and the reaction after the call's traced end
    react: float = 0.0


class Replay(Tally):
    """A trace's steps on one config's networks: ``run(steps)`` simulates them and returns the row."""

    def __init__(self, trace: Trace, config: ExperimentConfig, scale: float = 1.0):
        super().__init__()   # the estimate's tallies: the same sums, choices and elements lost
        self.trace, self.config, self.scale = trace, config, scale
        self.layout = Layout(trace, config)
        self.steps = [self._step(j) for j in range(trace.steps)]
        self.networks: dict = {}

    # -- the traced steps ---------------------------------------------------------------------------
    def _step(self, j: int) -> dict:
        """Step ``j``'s transfers (in issue order), each rank's points, and what is not sent."""
        transfers, keys, counts = [], {}, defaultdict(int)
        skipped = defaultdict(lambda: [0, 0])
        for rank, rt in sorted(self.trace.ranks.items()):
            t0 = rt.steps[j][0]
            for call in rt.calls[j]:
                ranks = self.trace.groups[call.group]
                if call.kind in ("send", "recv"):
                    src, dst = (call.rank, call.peer) if call.kind == "send" else (call.peer, call.rank)
                    base = ("p2p", src, dst)
                else:
                    base = ("group", call.group)
                key = (*base, counts[(rank, base)])
                counts[(rank, base)] += 1
                t = keys.get(key)
                if t is None:
                    t = keys[key] = self._transfer(len(transfers), call, ranks, base)
                    transfers.append(t)
                    if t.place is None:
                        name = f"{t.call.kind} on process group {call.group} ({self._why(t.call)})"
                        skipped[name][0] += 1
                        skipped[name][1] += call.bytes
                t.issues[rank] = (call.issue - t0) * US * self.scale
                t.ends[rank] = (call.end - t0) * US * self.scale
        points = {rank: self._points(rt, j, transfers, keys) for rank, rt in self.trace.ranks.items()}
        ends = {rank: (rt.steps[j][1] - rt.steps[j][0]) * US * self.scale for rank, rt in self.trace.ranks.items()}
        return {"transfers": transfers, "points": points, "ends": ends, "skipped": dict(skipped)}

    def _why(self, call: Call) -> str:
        """Why a call is not sent."""
        if call.kind == "all_to_all":
            return "the replay does not send all-to-alls (an MoE job: its named shape and --ep-size)"
        if call.kind not in COLLECTIVES:
            return "the network has no model of it"
        if self.layout.axis.get(call.group) is None:
            return f"the group is no axis's group of {self.layout.mesh.name}"
        return "a send between stages that are not neighbours" if call.kind == "send" else "a group of one"

    def _transfer(self, index: int, call: Call, ranks: tuple, base: tuple) -> _Transfer:
        kind = "send" if call.kind == "recv" else call.kind
        as_sent = dataclasses.replace(call, kind=kind, rank=base[1], peer=base[2]) if kind == "send" else call
        place, pair, direction = (None, None, "fwd") if kind not in COLLECTIVES else self.layout.place(as_sent, ranks)
        cls = place.cls if place else None
        stream = base if kind == "send" else ("group", call.group)
        return _Transfer(index, dataclasses.replace(call, kind=kind), cls, place, direction, pair, stream)

    def _points(self, rt, j: int, transfers: list, keys: dict) -> list:
        """A rank's issues and waits in step ``j``, in traced order (seconds from its step's start)."""
        t0, scale = rt.steps[j][0], self.scale * US
        mine = [t for t in transfers if rt.rank in t.issues]
        points = [_Point(t.issues[rt.rank], "issue", t.id) for t in mine]
        # the pauses: before the stream's first work, between its works and after its last
        edges = [(t0, t0), *rt.busy[j], (rt.steps[j][1], rt.steps[j][1])]
        gaps = [(edges[i][1], edges[i + 1][0]) for i in range(len(edges) - 1)]
        by_end = sorted(mine, key=lambda t: t.ends[rt.rank])
        ends = [t.ends[rt.rank] for t in by_end]
        waits = set()
        for a, b in gaps:
            a, b = (a - t0) * scale, (b - t0) * scale
            if b <= a:
                continue
            # the call that ended last in the pause, of those issued before it
            first, last = bisect.bisect_left(ends, a), bisect.bisect_right(ends, b)
            t = next((t for t in reversed(by_end[first:last]) if t.issues[rt.rank] <= a), None)
            if t is not None:
                points.append(_Point(b, "wait", t.id, a, b - t.ends[rt.rank]))
                waits.add(t.id)
        # What a rank receives, it uses: where the message was already there in the trace (its sender was
        # early), the work after its traced end waits for it all the same on the replay's clock.
        points += [_Point(t.ends[rt.rank], "wait", t.id, t.ends[rt.rank]) for t in mine if t.id not in waits
                   and t.call.kind == "send" and t.call.peer == rt.rank]
        points.sort(key=lambda p: (p.t, p.kind == "wait"))
        return points

    # -- the network --------------------------------------------------------------------------------
    def _network(self, place: Place) -> LossyNetwork:
        net = self.networks.get(place.key)
        if net is None:
            net = self.networks[place.key] = LossyNetwork(place.spec)
        return net

    def _simulate(self, step: dict) -> dict:
        """Each transfer's [with loss, loss-free] seconds on its network (skipped ones: none)."""
        seconds, index = {}, defaultdict(int)
        copies = self._copies()
        for t in step["transfers"]:
            if t.place is None:
                continue
            net = self._network(t.place)
            k = index[(t.place.key, t.call.kind)]
            index[(t.place.key, t.call.kind)] += 1
            dtype = getattr(torch, t.call.dtype)
            per_packet, _ = net.packets(t.call.numel, dtype)
            before = mark(net)
            delivery = net.simulate(f"{t.cls}.{t.call.kind}{k}", t.direction, t.call.numel, dtype, t.call.kind,
                                    deliver=False, pair=t.pair)
            after = mark(net)
            seconds[t.id] = [after[0] - before[0], after[1] - before[1]]
            held = t.call.numel if t.call.kind == "send" else held_elements(t.call.kind, net.ranks, t.call.numel)
            self.lost(t.cls, t.direction, delivery, per_packet, t.call.numel, held,
                      copies.get(t.place.key[0], 1), t.call.kind)
        return seconds

    def _copies(self) -> dict:
        """Per class, the groups one simulated group stands for: 1 with every rank's trace; with one
        mirrored file, its axis's groups (the world over the axis's size)."""
        if not self.trace.mirrored:
            return {}
        sizes = self.layout.mesh.sizes
        return {cls.name: self.layout.mesh.world // sizes[cls.axis] for cls in traffic.CLASSES}

    # -- the clock ----------------------------------------------------------------------------------
    def clock(self, step: dict, seconds: Callable[[_Transfer], float]) -> float:
        """The step's end when each transfer takes ``seconds(transfer)``: every rank's points in order,
        a wait resuming at its call's end, a call starting when its members have issued it and its stream
        is free."""
        transfers, points = step["transfers"], step["points"]
        start, end = [None] * len(transfers), [None] * len(transfers)
        issued = [dict() for _ in transfers]
        queues = defaultdict(list)
        for t in transfers:
            queues[t.stream].append(t)
        heads = dict.fromkeys(queues, 0)
        free = defaultdict(float)
        shift = dict.fromkeys(points, 0.0)
        cursor = dict.fromkeys(points, 0)
        forced = False

        def run_streams():
            for stream, queue in queues.items():
                while heads[stream] < len(queue):
                    t = queue[heads[stream]]
                    if len(issued[t.id]) < len(t.issues) and not forced:
                        break
                    if not issued[t.id]:
                        break
                    start[t.id] = max(max(issued[t.id].values()), free[stream])
                    end[t.id] = free[stream] = start[t.id] + seconds(t)
                    heads[stream] += 1

        while True:
            moved = False
            for rank, pts in points.items():
                while cursor[rank] < len(pts):
                    p = pts[cursor[rank]]
                    if p.kind == "issue":
                        issued[p.transfer][rank] = p.t + shift[rank]
                    elif end[p.transfer] is not None:
                        resumed = max(p.a + shift[rank], end[p.transfer] + p.react)
                        shift[rank] = resumed - p.t
                    elif forced:    # its call cannot end before this rank goes on: the pause stays as traced
                        pass
                    else:
                        break
                    cursor[rank] += 1
                    moved = True
            run_streams()
            if all(cursor[r] == len(p) for r, p in points.items()) and \
                    all(h == len(queues[s]) for s, h in heads.items()):
                break
            if not moved:
                if forced:
                    break
                forced = True      # a trace whose calls wait on each other in a cycle: let them go
        last = max((e for e in end if e is not None), default=0.0)
        ranks_end = [step["ends"][rank] + shift[rank] for rank in points]
        member_end = [e for t, e in zip(transfers, end) if e is not None]
        return max([*ranks_end, *member_end, last])

    # -- the row ----------------------------------------------------------------------------------
    def run(self, steps: int, tick: Optional[Callable[[], None]] = None) -> dict:
        """Simulate ``steps`` steps (step i replays traced step i mod the traced steps): per-step times,
        per class what it adds, packets, what was lost; the columns of every estimate."""
        per_step, ideal_steps, stacks = [], [], []
        added = defaultdict(lambda: np.zeros(2))
        comm, present = defaultdict(float), self.classes
        for i in range(steps):
            step = self.steps[i % len(self.steps)]
            sec = self._simulate(step)
            for t in step["transfers"]:
                if t.id in sec:
                    comm[t.cls] += sec[t.id][1]

            def at(k: int, zero=(), free=()):
                return self.clock(step, lambda t: 0.0 if t.id not in sec or t.cls in zero else
                                  sec[t.id][1 if t.cls in free else k])
            per_step.append(at(0))
            ideal_steps.append(at(1))
            stack = [at(1, zero=present)]
            for j in range(len(present)):
                stack.append(at(1, zero=present[j + 1:]) - sum(stack))
            stacks.append(stack + [per_step[-1] - ideal_steps[-1]])
            for cls in present:
                added[cls] += [per_step[-1] - at(0, free=(cls,)), ideal_steps[-1] - at(1, zero=(cls,))]
            if tick is not None:
                tick()
        for key, net in self.networks.items():
            self.count(key[0], net, self._copies().get(key[0], 1))
        return self._row(steps, np.asarray(per_step), float(np.mean(ideal_steps)), np.mean(stacks, axis=0),
                         added, comm)

    @property
    def classes(self) -> tuple:
        """The classes the trace's calls go to, in the declared order."""
        found = {t.cls for step in self.steps for t in step["transfers"] if t.cls}
        return tuple(c for c in CLASSES if c in found)

    def _row(self, steps: int, step_s, loss_free: float, stack, added: dict, comm: dict) -> dict:
        config, mesh = self.config, self.layout.mesh
        spec = config.network_spec()
        counts = self.counts(steps)
        compute_s = float(stack[0])
        per_class = self.per_class()
        calls = {cls: n for cls, (n, _) in per_class.items()}
        nbytes = {cls: b for cls, (_, b) in per_class.items()}
        skipped = {name: (row["calls"], row["bytes"]) for name, row in self.not_simulated().items()}
        row = {
            "model": "", "parameters": None, "tp_size": mesh.tp, "pp_size": mesh.pp, "dp_size": mesh.dp,
            "layout": mesh.name, "parallel_order": mesh.order, "gpus": mesh.world, "dp_mode": "", "seq": "",
            "micro_batch": "", "microbatches": "", "global_batch": "", "pp_schedule": "", "stage_layers": "",
            "dtype": self._dtype(), "grad_dtype": "", "dp_bucket_mb": "", "dp_overlap": "",
            "activation_checkpointing": "",
            "loss": spec.loss.spec, "loss_rate": spec.loss.loss_rate, "transport": spec.transport, "nic": spec.nic,
            "algorithm": spec.algorithm, "link_intra": spec.link_intra.spec, "link_inter": spec.link_inter.spec,
            "ranks_per_node": mesh.per_node, "nics_per_node": spec.nics_per_node, "lossy_links": spec.lossy_links,
            "lossy": ",".join(spec.lossy), "recovery": spec.recovery,
            "sockets": spec.sockets, "congestion": spec.congestion, "seed": spec.seed, "compute": "trace",
            "steps": steps, "collectives_per_step": sum(calls.values()), "message_bytes": "",
            "compute_s": compute_s, "loss_free_comm_s": loss_free - compute_s, "loss_free_step_s": loss_free,
            **intervals(step_s),
            "slowdown": float(step_s.mean()) / loss_free if loss_free else 1.0,
            "comm_share": 1.0 - compute_s / float(step_s.mean()) if step_s.mean() else 0.0,
            **{f"packets_{name}": sum(c[name] for c in counts.values()) for name in ("sent", "lost", "resent")},
            "elements_lost_fwd": self.elements_lost("tp", "fwd"),
            "elements_lost_bwd": self.elements_lost("tp", "bwd"),
            "failures_per_1000_steps": 1000.0 * sum(c["failures"] for c in counts.values()),
            "sampled_groups": 0, "packets_drawn": self.drawn / steps,
            "collectives": self.choice_summary(),
            "trace_steps": len(self.steps), "trace_ranks": len(self.trace.ranks),
            "not_simulated_calls": sum(n for n, _ in skipped.values()),
            "not_simulated": "; ".join(f"{name}: {n:g} per step, {b:g} B" for name, (n, b) in sorted(skipped.items())),
        }
        if spec.cables is not None:   # as every estimate's: the fabric's columns only on a fabric
            blast = self.blast.table({cls: sums["sent"] for cls, sums in self.sums.items()})
            row.update(fabric=spec.fabric, bad_link=";".join(spec.bad_link), corrupt_share=spec.corrupt_share,
                       routing=spec.routing, qps_per_connection=spec.qps_per_connection, pxn=spec.pxn,
                       lossy_cables=len(spec.cables.losses), blast_radius=describe(blast), blast=blast)
        for cls in CLASSES:
            seconds = added[cls] / steps if cls in added else np.zeros(2)
            row.update({f"{cls}_loss_free_s": float(seconds[1]), f"{cls}_repair_s": float(seconds[0]),
                        **{f"{cls}_packets_{name}": counts.get(cls, {}).get(name, 0.0)
                           for name in ("sent", "lost", "resent")},
                        f"{cls}_elements_lost": self.elements_lost(cls),
                        f"{cls}_calls": calls.get(cls, 0.0), f"{cls}_bytes": nbytes.get(cls, 0.0),
                        f"{cls}_comm_s": comm.get(cls, 0.0) / steps})
        row.update({f"stack_{name}_s": 0.0 for name in ("compute", *CLASSES, "repair")})
        for name, value in zip(("compute", *self.classes, "repair"), stack):
            row[f"stack_{name}_s"] = float(value)
        return row

    def per_class(self) -> dict:
        """Per class, the calls and bytes of a traced step (mean over the traced steps, every group)."""
        out = defaultdict(lambda: [0.0, 0.0])
        for step in self.steps:
            for t in step["transfers"]:
                if t.cls:
                    out[t.cls][0] += 1 / len(self.steps)
                    out[t.cls][1] += t.call.bytes / len(self.steps)
        return {cls: tuple(out[cls]) for cls in CLASSES if cls in out}

    def not_simulated(self) -> dict:
        """What a traced step does not send, by what and why: its calls and bytes (mean over the steps)."""
        out = defaultdict(lambda: {"calls": 0.0, "bytes": 0.0})
        for step in self.steps:
            for name, (n, b) in step["skipped"].items():
                out[name]["calls"] += n / len(self.steps)
                out[name]["bytes"] += b / len(self.steps)
        return dict(sorted(out.items()))

    def _dtype(self) -> str:
        sizes = defaultdict(int)
        for step in self.steps:
            for t in step["transfers"]:
                sizes[t.call.dtype] += t.call.bytes
        return max(sizes, key=sizes.get) if sizes else ""


def traced_compute(trace: Trace, config: ExperimentConfig) -> float:
    """Seconds of a traced step with every call free (its compute and the waits no call explains), mean
    over the traced steps."""
    replay = Replay(trace, config)
    return float(np.mean([replay.clock(step, lambda t: 0.0) for step in replay.steps]))


def simulate_trace(trace: Trace, config: ExperimentConfig, steps: int = 10, scale: float = 1.0,
                   tick: Optional[Callable[[], None]] = None) -> dict:
    """One row: ``steps`` replayed steps of ``trace`` on ``config``'s layout and network, the traced
    compute scaled by ``scale``."""
    if int(steps) < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    return Replay(trace, config, scale).run(int(steps), tick)
