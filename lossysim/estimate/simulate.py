"""One estimate: every traffic class of a job's training steps through lossy networks, without the model.

The job is tp x pp x dp ranks laid out as training lays them out (``Mesh``: tp innermost, then pp,
then dp). Every message of a step goes through ``LossyNetwork.simulate``, the code path of a training
run's collectives: the same keyed streams draw the same fates, the same transport repairs them, the
same counters and clock move. Only the tensors are missing: a message is its element count and dtype.
Its traffic classes, each on the networks the mesh gives its groups:

- ``tp``: every stage's TP all-reduces (``step_calls``), per micro-batch, on each replica's stage group;
- ``pp``: every boundary's activation and its gradient, per micro-batch, TP rank t to TP rank t
  (``pp.stages``), a send's time its slowest TP rank's;
- ``dp``: DDP's gradient buckets (``dp.buckets``, a TP rank's local tensors of its stage), all-reduced
  over each (stage, TP position)'s data-parallel group, a bucket's time its slowest group's;
- ``fsdp``: the same units all-gathered before the forward and reduce-scattered after the backward;
- the experts' dispatch and combine: a mixture of experts' all-to-alls per MoE block and micro-batch on every
  (stage, TP position, expert-data index)'s ep group, sized by the routing assumed (``ep.routing``: uniform or
  skewed); in backward their gradients the other way; the experts' gradient buckets over their
  expert-data-parallel groups (class ``dp``), after the backward, as training averages them. Beyond
  ``FULL_UP_TO`` GPUs, a few micro-batches of one stage's sampled groups are simulated and every other block's
  calls drawn from theirs (docs/estimate.md, "Experts").
- ``cp``: every block's keys and values over each (stage, replica, TP position)'s context group, per
  micro-batch: the ring's rounds of point-to-point sends (or an all-gather), and their gradients back (or
  a reduce-scatter), training's exchanges (``cp.exchange``), each round's time its slowest send's and what
  it adds the part not hidden behind that step's attention (``cp.clock``), the slowest TP position's per
  block. With context parallelism every TP message and pipeline send is a context rank's: its local tokens
  (seq / cp), on each context rank's groups (the clock reads context rank 0's, as training does).

Which groups are simulated, and which stand for their identical others, is the job's (``job``); each class's
messages are ``messages``, ``ep.estimate`` and ``cp.estimate``; what they sent and lost is counted as
``accounting.Tally`` counts; the step ends on training's clock (``lossysim.clock.step_time``), each axis's
seconds handed to it as training hands them (``_Parts``; an axis's part of the job gives its row's columns, the
replicas its messages set apart and its seconds on a replica's stream).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Optional, Union

import numpy as np

from .. import clock as one_clock, timing
from ..config import ExperimentConfig
from ..cp import clock as cp_clock
from ..cp.layout import check_length
from ..ep.estimate import routed_load
from ..models import cost
from ..pp.stages import stage_layout
from .accounting import CLASSES, intervals
from . import collisions
from . import events as link_events
from .blast import describe
from .job import Job, check_group_size
from .shapes import Shape, load
from .workload import Workload


def estimate(model: Union[str, Shape], config: ExperimentConfig, workload: Workload = Workload(),
             steps: int = 10, tick: Optional[Callable[[], None]] = None) -> dict:
    """Simulate ``steps`` training steps of ``model`` (a name, a config path or a ``Shape``) on the job a
    training run's ``config`` describes (its layout, batch, micro-batches, network and compute: the same
    validated settings and mesh as ``lossysim train``), each micro-batch ``workload.seq`` tokens long.
    Returns one flat row: per-step times with intervals, slowdown, packets, what was lost, and all of it
    per traffic class (docs/estimate.md lists the columns). ``tick`` is called once per step, when all are
    done."""
    shape = model if isinstance(model, Shape) else load(model)
    if int(steps) < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    steps, w, mesh = int(steps), workload, config.mesh()
    tp, pp, dp, cp, m = mesh.tp, mesh.pp, mesh.dp, mesh.cp, config.n_microbatches
    shape.check_tp(tp)
    shape.check_seq(w.seq)
    if cp > 1:
        check_length(w.seq, cp, "seq")
    layout = stage_layout(config.pp_layout, pp, shape.layers)
    check_group_size(mesh)
    gpu = timing.parse_compute(config.compute)
    if isinstance(gpu, timing.Measured):
        raise ValueError("compute=measured needs a real training run; name a GPU model (e.g. h100)")
    shape.check_axes(config)
    tokens = w.seq * config.micro_batch_size
    kernels = shape.kernels + cost.collective_kernels(shape.layers, tp)   # as a training run counts them
    # a rank computes its share of every sequence: 1 / (tp x cp) of the FLOPs, as training charges it
    micro_s = gpu.step_time(_busiest(shape, mesh, w, config.seed), tokens, tp * cp, kernels=kernels,
                            attention_flops=cost.step_flops(0, tokens, shape.layers, shape.hidden, w.seq))
    job = Job(shape, config, w, layout, tokens)
    job.attention_s = [gpu.seconds(cp_clock.attention_step_flops(config.micro_batch_size, w.seq, shape.hidden, tp, cp,
                                                                 d)) for d in ("fwd", "bwd")]
    shares = job.shares(tokens)
    # on a fabric: each class's loss-free seconds stretched by its most loaded cable (none: every time as it was)
    job.fabric_factors = collisions.factors(config)

    per_step, ideal_steps, stacks, added = [], [], [], defaultdict(lambda: np.zeros(2))
    for times in job.run(steps, tick):
        times = collisions.stretched(times, job.fabric_factors)
        clock = _Parts(times, micro_s, shares, config, pp, dp, m, job.ready, cp)
        per_step.append(clock.step(0))
        ideal_steps.append(clock.step(1))
        present = job.classes
        stack = [clock.step(1, zero=present)]
        for i, cls in enumerate(present):
            stack.append(clock.step(1, zero=present[i + 1:]) - sum(stack))
        stacks.append(stack + [per_step[-1] - ideal_steps[-1]])
        for cls in present:
            # loss-free: what the class's messages add to the loss-free step; repair: what the step loses when
            # only this class's messages lose nothing (>= 0: a schedule's end never grows as a part shrinks)
            added[cls] += [per_step[-1] - clock.loss_free(cls).step(0), ideal_steps[-1] - clock.step(1, zero=(cls,))]

    step_s, loss_free = np.asarray(per_step), float(np.mean(ideal_steps))
    stack = np.mean(stacks, axis=0)
    compute_s = float(stack[0])
    counts = job.counts(steps)
    spec = job.tp[0][0].spec
    row = {
        "model": shape.name, "parameters": shape.parameters, "active_parameters": shape.active or shape.parameters,
        "tp_size": tp, "pp_size": pp, "dp_size": dp,
        **{key: value for part in Job.PARTS for key, value in part.columns(shape, config, mesh, w).items()},
        "layout": mesh.name, "parallel_order": mesh.order, "gpus": mesh.world,
        "dp_mode": config.dp_mode if dp > 1 else "", "seq": w.seq, "micro_batch": config.micro_batch_size,
        "microbatches": m, "global_batch": config.batch_size, "pp_schedule": config.pp_schedule if pp > 1 else "",
        "stage_layers": ",".join(map(str, layout)), "dtype": job.dtype_name, "grad_dtype": w.grad_dtype,
        "dp_bucket_mb": config.dp_bucket_mb, "dp_overlap": config.dp_overlap,
        "activation_checkpointing": config.activation_checkpointing,
        "loss": spec.loss.spec, "loss_rate": spec.loss.loss_rate, "transport": spec.transport, "nic": spec.nic,
        "algorithm": spec.algorithm, "link_intra": spec.link_intra.spec, "link_inter": spec.link_inter.spec,
        "ranks_per_node": mesh.per_node, "nics_per_node": spec.nics_per_node,
        "lossy_links": spec.lossy_links, "lossy": ",".join(spec.lossy), "recovery": spec.recovery,
        "sockets": spec.sockets, "congestion": spec.congestion, "seed": spec.seed, "compute": gpu.spec,
        "steps": steps,
        "collectives_per_step": m * sum(not call.replay for calls in job.calls for call in calls),
        "message_bytes": job.numel * job.dtype.itemsize,
        "compute_s": compute_s, "loss_free_comm_s": loss_free - compute_s, "loss_free_step_s": loss_free,
        **intervals(step_s),
        "slowdown": float(step_s.mean()) / loss_free,
        "comm_share": 1.0 - compute_s / float(step_s.mean()),
        **{f"packets_{name}": sum(c[name] for c in counts.values()) for name in ("sent", "lost", "resent")},
        "elements_lost_fwd": job.elements_lost("tp", "fwd"), "elements_lost_bwd": job.elements_lost("tp", "bwd"),
        "failures_per_1000_steps": 1000.0 * sum(c["failures"] for c in counts.values()),
        "sampled_groups": job.sampled, "packets_drawn": job.drawn / steps,
        "collectives": job.choice_summary(),
    }
    if spec.cables is not None:   # the fabric's columns: only on a fabric, so a row without one stays as it was
        blast = job.blast.table({cls: sums["sent"] for cls, sums in job.sums.items()})
        row.update(fabric=spec.fabric, bad_link=";".join(spec.bad_link), corrupt_share=spec.corrupt_share,
                   routing=spec.routing, qps_per_connection=spec.qps_per_connection, pxn=spec.pxn,
                   shared_cables=bool(config.shared_cables), lossy_cables=len(spec.cables.losses), blast_radius=describe(blast), blast=blast,
                   **collisions.columns(job.fabric_factors, job.classes))
    for cls in CLASSES:   # every class's columns, zero where the job has none of its traffic
        seconds = added[cls] / steps
        row.update({f"{cls}_loss_free_s": float(seconds[1]), f"{cls}_repair_s": float(seconds[0]),
                    **{f"{cls}_packets_{name}": counts.get(cls, {}).get(name, 0.0)
                       for name in ("sent", "lost", "resent")},
                    f"{cls}_elements_lost": job.elements_lost(cls)})
    row.update({f"stack_{name}_s": 0.0 for name in ("compute", *CLASSES, "repair")})
    for name, value in zip(("compute", *job.classes, "repair"), stack):
        row[f"stack_{name}_s"] = float(value)
    row.update(link_events.columns(config, job, row))   # only with link events: a row without stays as it was
    return row


def _busiest(shape: Shape, mesh, w: Workload, seed: int) -> float:
    """The parameters the busiest rank's step multiplies per token, as the compute model takes them (it
    divides by tp): the active ones, its routed experts' as loaded as the routing makes the busiest rank
    (``ep.routing.imbalance``; 1 with ep 1 or uniform routing) and run whole by every TP rank (tp times)."""
    active = shape.active or shape.parameters
    if shape.experts is None:
        return active
    e = shape.experts
    load = routed_load(shape, mesh, w, seed)
    return active + e.parameters * e.top_k / e.count * (load * mesh.tp - 1.0)


class _Parts:
    """One step's parts from its messages' seconds (``k`` 0: with loss, 1: loss-free), any class zeroed,
    handed to the one clock (``lossysim.clock.step_time``) as training hands it its own: compute per
    micro-batch as a training run models it, a stage's share by its FLOPs, plus the TP traffic, the
    all-to-alls and what context exchanges add on each replica's stream; the boundaries' sends; DDP's
    buckets and FSDP's gathers; the experts' buckets after the backward."""

    # a class's times, where they are not its own key's (the experts' buckets are data-parallel traffic)
    KEYS = {"dp": ("bucket", "expert_bucket"), "fsdp": ("bucket", "gather")}

    def __init__(self, times: dict, micro_s: float, shares: list[float], config: ExperimentConfig, pp: int, dp: int,
                 m: int, ready: list, cp: int = 1):
        self.t, self.c, self.shares, self.config, self.pp, self.dp, self.m, self.ready, self.cp = \
            times, micro_s, shares, config, pp, dp, m, ready, cp

    def loss_free(self, cls: str) -> "_Parts":
        """These parts with ``cls``'s messages at their loss-free seconds (their repairs taken away)."""
        times = dict(self.t)
        for key in self.KEYS.get(cls, (cls,)):
            if key in times:
                times[key] = _at_loss_free(times[key])
        return _Parts(times, self.c, self.shares, self.config, self.pp, self.dp, self.m, self.ready, self.cp)

    def _replicas(self) -> list[int]:
        """One replica of each kind whose paths differ (replica 0 first): a replica's TP groups and pipeline
        boundaries are its own where every one was simulated, and each axis's part says its own kinds
        (``replica_kind``: context groups as TP's, ep groups by expert-data index)."""
        tp, pp = self.t["tp"], self.t["pp"]
        own = any(len(g) > 1 for g in (*tp, *pp))
        kinds_of = [kind for kind in (part.replica_kind(self) for part in Job.PARTS) if kind is not None]
        kinds: dict = {}
        for r in range(self.dp if own or kinds_of else 1):
            kinds.setdefault((r if own else 0, *(kind(r) for kind in kinds_of)), r)
        return list(kinds.values())

    def _expert_buckets(self, k: int, zero) -> float:
        """What the experts' buckets add after the backward: the slowest stage's, one after another."""
        if "dp" in zero or not self.t.get("expert_bucket"):
            return 0.0
        return max((sum(seconds[k] for seconds in stage) for stage in self.t["expert_bucket"]), default=0.0)

    def _path(self, r: int, k: int, zero, streams: list) -> one_clock.Path:
        """Replica ``r``'s stream and sends, each axis's seconds apart (``streams``: each axis's part's, in
        the axes' order, after TP's)."""
        stages, m = range(self.pp), self.m
        tp, pp = self.t["tp"], self.t["pp"]
        # context rank 0's TP traffic and sends, as training charges them
        tp_seconds = () if "tp" in zero else \
            [[(f[k], b[k]) for f, b in tp[s][r * self.cp if len(tp[s]) > 1 else 0]] for s in stages]
        sends = one_clock.Sends()
        if self.pp > 1:
            links = [[[(0.0, 0.0)] * 2] * m if "pp" in zero else pp[b][r * self.cp if len(pp[b]) > 1 else 0]
                     for b in range(self.pp - 1)]
            sends = one_clock.Sends([[a[k] for a, _ in link] for link in links],
                                    [[g[k] for _, g in link] for link in links])
        compute = one_clock.Compute([self.c] * m, self.shares if self.pp > 1 else (1.0,))
        return one_clock.stream(compute, one_clock.OnStream("tp", tp_seconds),
                                *(one_clock.OnStream(part.STREAM, of(r, k)) for part, of in streams), sends=sends)

    def step(self, k: int, zero=()) -> float:
        bucket = [[[0.0, 0.0]] * len(b) for b in self.t["bucket"]] if {"dp", "fsdp"} & set(zero) else self.t["bucket"]
        # (one stage's units: the estimate refuses FSDP with stages)
        gather = [] if "fsdp" in zero or not self.t["gather"] else [[g[k] for g in self.t["gather"]]]
        streams = [(part, part.on_stream(self, zero)) for part in Job.PARTS]   # (the axes' order: ep, then cp)
        paths = [self._path(r, k, zero, streams) for r in self._replicas()]
        buckets = one_clock.Buckets(self.ready, [[b[k] for b in stage] for stage in bucket] if bucket else (),
                                    gather, self.config.dp_overlap, self._expert_buckets(k, zero))
        schedule = one_clock.Schedule(self.config.pp_schedule, self.pp, self.m) if self.pp > 1 else None
        return one_clock.step_time(paths, buckets, schedule).seconds


def _at_loss_free(times):
    """``times`` (nested lists ending in [with loss, loss-free] pairs of seconds, or a context group's
    [micro-batch, direction, (with loss, loss-free), block] array) with every pair [free, free]."""
    if isinstance(times, np.ndarray):
        free = times.copy()
        free[:, :, 0] = free[:, :, 1]
        return free
    if len(times) == 2 and all(isinstance(x, (int, float)) for x in times):
        return [times[1], times[1]]
    return [_at_loss_free(x) for x in times]
