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
- ``ep_dispatch``, ``ep_combine``: a mixture of experts' all-to-alls per MoE block and micro-batch on every
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
messages are ``messages``, ``expert_messages`` and ``context_messages``; what they sent and lost is counted as
``accounting.Tally`` counts; the step ends on training's clock (``clock``).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Optional, Union

import numpy as np

from .. import timing
from ..config import ExperimentConfig
from ..cp import clock as cp_clock
from ..cp.layout import check_length
from ..ep import routing
from ..models import cost
from ..pp.stages import stage_layout
from .accounting import CLASSES, intervals
from .blast import describe
from .clock import Clock
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
    shape.check_ep(mesh.ep)
    tokens = w.seq * config.micro_batch_size
    kernels = shape.kernels + cost.collective_kernels(shape.layers, tp)   # as a training run counts them
    # a rank computes its share of every sequence: 1 / (tp x cp) of the FLOPs, as training charges it
    micro_s = gpu.step_time(_busiest(shape, mesh, w, config.seed), tokens, tp * cp, kernels=kernels,
                            attention_flops=cost.step_flops(0, tokens, shape.layers, shape.hidden, w.seq))
    job = Job(shape, config, w, layout, tokens)
    job.attention_s = [gpu.seconds(cp_clock.attention_step_flops(config.micro_batch_size, w.seq, shape.hidden, tp, cp,
                                                                 d)) for d in ("fwd", "bwd")]
    shares = job.shares(tokens)

    per_step, ideal_steps, stacks, added = [], [], [], defaultdict(lambda: np.zeros(2))
    for times in job.run(steps, tick):
        clock = Clock(times, micro_s, shares, config, pp, dp, m, job.ready, cp)
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
        "tp_size": tp, "pp_size": pp, "dp_size": dp, "ep_size": mesh.ep,
        "routing_skew": w.routing_skew if mesh.ep > 1 else 0.0,
        "routing_imbalance": routing.imbalance(shape.experts.top_k, shape.experts.count, mesh.ep, w.routing_skew,
                                               config.seed) if mesh.ep > 1 else 1.0,
        "cp_size": cp, "cp_mode": config.cp_mode if cp > 1 else "",
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
                   lossy_cables=len(spec.cables.losses), blast_radius=describe(blast), blast=blast)
    for cls in CLASSES:   # every class's columns, zero where the job has none of its traffic
        seconds = added[cls] / steps
        row.update({f"{cls}_loss_free_s": float(seconds[1]), f"{cls}_repair_s": float(seconds[0]),
                    **{f"{cls}_packets_{name}": counts.get(cls, {}).get(name, 0.0)
                       for name in ("sent", "lost", "resent")},
                    f"{cls}_elements_lost": job.elements_lost(cls)})
    row.update({f"stack_{name}_s": 0.0 for name in ("compute", *CLASSES, "repair")})
    for name, value in zip(("compute", *job.classes, "repair"), stack):
        row[f"stack_{name}_s"] = float(value)
    return row


def _busiest(shape: Shape, mesh, w: Workload, seed: int) -> float:
    """The parameters the busiest rank's step multiplies per token, as the compute model takes them (it
    divides by tp): the active ones, its routed experts' as loaded as the routing makes the busiest rank
    (``ep.routing.imbalance``; 1 with ep 1 or uniform routing) and run whole by every TP rank (tp times)."""
    active = shape.active or shape.parameters
    if shape.experts is None:
        return active
    e = shape.experts
    load = routing.imbalance(e.top_k, e.count, mesh.ep, w.routing_skew, seed) if mesh.ep > 1 else 1.0
    return active + e.parameters * e.top_k / e.count * (load * mesh.tp - 1.0)
