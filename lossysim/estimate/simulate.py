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

Groups whose links cannot lose a packet are all alike: one is simulated and stands for the others
(its counts multiplied), which is exact, as their fates are all "delivered". Every group whose links
can lose packets is simulated, or, with ``Workload.sampled_groups`` k (the default beyond 64 GPUs), k of
each stage's or boundary's alike groups, the slowest of the others drawn from their times
(docs/estimate.md, "The slowest of identical groups").

The clock is training's (docs/estimate.md, "The clock"): compute per micro-batch as a training run
models it (``timing.compute``), a stage's share by its FLOPs, a third forward and two thirds backward,
plus its TP traffic; with stages, the schedule's critical path (``pipeline_time``); DDP's buckets
overlap backward and FSDP's gathers are prefetched one unit ahead as ``dp.timeline`` says.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict, deque
from typing import Callable, NamedTuple, Optional, Union

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from .. import timing, traffic
from ..dp import timeline
from ..dp.buckets import plan_buckets
from ..dp.fsdp import shard_numel
from ..config import EP_CLASSES, ExperimentConfig
from ..cp import clock as cp_clock
from ..cp.layout import check_length
from ..ep import routing
from ..models import cost
from ..net import LossyNetwork, NetworkSpec
from ..net.recovery import packets_of
from ..net.sparse import Losses, bad_packets_of
from ..pp.schedule import pipeline_time
from ..pp.stages import stage_layout, stage_parameters
from ..tp.parallelize import head_counts, parallelize
from ..util import stream_seed
from .shapes import Shape, load
from .workload import AMP_DTYPE, DTYPES, Workload, step_calls

CLASSES = tuple(c.name for c in traffic.CLASSES)   # every class's columns, in the declared order
# The most ranks one group may have. Every collective is simulated send by send, and a ring all-reduce over
# R ranks is 2R(R-1) sends whose schedule the network keeps (about 1.6 KB a send: a tiny model at dp 600,
# 718,800 sends, peaked at 1.6 GB), so memory grows with the square of the largest group.
MAX_GROUP_RANKS = 1024
_THIRD = 1 / 3     # forward's share of a micro-batch's compute (2N FLOPs of 6N), as training charges it


class _Group(NamedTuple):
    spec: NetworkSpec
    copies: float      # the groups its counts stand for: loss-free ones alike (exact), or G / k sampled lossy ones


class _ExpertGroup(NamedTuple):
    """An ep group's two networks (``ep_dispatch``, ``ep_combine``) and the groups its counts stand for."""
    specs: tuple
    copies: float


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
    _check_group_size(mesh)
    gpu = timing.parse_compute(config.compute)
    if isinstance(gpu, timing.Measured):
        raise ValueError("compute=measured needs a real training run; name a GPU model (e.g. h100)")
    shape.check_ep(mesh.ep)
    tokens = w.seq * config.micro_batch_size
    kernels = shape.kernels + cost.collective_kernels(shape.layers, tp)   # as a training run counts them
    # a rank computes its share of every sequence: 1 / (tp x cp) of the FLOPs, as training charges it
    micro_s = gpu.step_time(_busiest(shape, mesh, w, config.seed), tokens, tp * cp, kernels=kernels,
                            attention_flops=cost.step_flops(0, tokens, shape.layers, shape.hidden, w.seq))
    job = _Job(shape, config, w, layout, tokens)
    job.attention_s = [gpu.seconds(cp_clock.attention_step_flops(config.micro_batch_size, w.seq, shape.hidden, tp, cp,
                                                                 d)) for d in ("fwd", "bwd")]
    shares = job.shares(tokens)

    per_step, ideal_steps, stacks, added = [], [], [], defaultdict(lambda: np.zeros(2))
    for times in job.run(steps, tick):
        clock = _Clock(times, micro_s, shares, config, pp, dp, m, job.ready, cp)
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
        **_intervals(step_s),
        "slowdown": float(step_s.mean()) / loss_free,
        "comm_share": 1.0 - compute_s / float(step_s.mean()),
        **{f"packets_{name}": sum(c[name] for c in counts.values()) for name in ("sent", "lost", "resent")},
        "elements_lost_fwd": job.elements_lost("tp", "fwd"), "elements_lost_bwd": job.elements_lost("tp", "bwd"),
        "failures_per_1000_steps": 1000.0 * sum(c["failures"] for c in counts.values()),
        "sampled_groups": job.sampled, "packets_drawn": job.drawn / steps,
        "collectives": job.choice_summary(),
    }
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


def _check_group_size(mesh) -> None:
    """Refuse, before any work, a layout whose groups an estimate cannot hold (``MAX_GROUP_RANKS``):
    a one-line ValueError with what it would take. Sampling (``sampled_groups``) bounds how many groups
    are simulated, not how large one is."""
    limit = MAX_GROUP_RANKS
    for axis, ranks in mesh.sizes.items():
        if ranks > limit:
            raise ValueError(f"{axis}_size={ranks}: its groups of {ranks} ranks would be simulated send by send, "
                             f"{2 * ranks * (ranks - 1):.2g} sends an all-reduce against {2 * limit * (limit - 1):.2g} "
                             f"at the most an estimate takes ({limit} ranks; --sampled-groups bounds how many groups "
                             f"are simulated, not their size): use {axis}_size <= {limit}")


class _Job:
    """A job's groups, messages and bucket plans, and the per-step simulation of every class."""

    def __init__(self, shape: Shape, config: ExperimentConfig, w: Workload, layout: tuple[int, ...], tokens: int):
        self.shape, self.config, self.w, self.layout = shape, config, w, layout
        self.mesh = mesh = config.mesh()
        tp, pp, dp, cp = mesh.tp, mesh.pp, mesh.dp, mesh.cp
        self.dtype_name = AMP_DTYPE[config.amp]
        self.dtype = DTYPES[self.dtype_name]
        settings = config.network_settings()
        # tp[s]: stage s's groups, one per replica and context rank (context rank 0's first; or one for
        # all: loss-free); pp[b] alike
        self.tp = [_groups([mesh.tp_network_spec(settings, r, s, c) for r in range(dp) for c in range(cp)])
                   for s in range(pp)]
        self.pp = [_groups([mesh.pp_network_spec(settings, r, b, config.pp_lossy(), c) for r in range(dp)
                            for c in range(cp)]) for b in range(pp - 1)]
        # cp[s]: stage s's context groups, one per replica and TP position (none without context parallelism)
        self.cp = [_groups([mesh.cp_network_spec(settings, r, t, config.lossy_directions("cp"), s)
                            for r in range(dp) for t in range(tp)]) for s in range(pp)] if cp > 1 else []
        self.attention_s = [0.0, 0.0]   # one ring step's attention per rank and block, forward and backward
        mode = config.dp_mode if dp > 1 else None
        self.dp = [_groups([mesh.dp_network_spec(settings, t, config.dp_lossy(), stage=s) for t in range(tp)])
                   for s in range(pp)] if mode else []
        self.mode = mode
        self.dp_class = config.dp_class
        # the job's classes: those whose axis has more than one rank (data-parallel traffic is DDP's or FSDP's)
        self.classes = tuple(c.name for c in traffic.CLASSES if mesh.sizes[c.axis] > 1
                             and (c.axis != "dp" or c.name == self.dp_class))
        self._init_experts(shape, config, w, tokens, settings)
        self.buckets = self._buckets() if mode else []
        self.ready = [[b.ready for b in stage] for stage in self.buckets]
        self.calls = [step_calls(shape, config.activation_checkpointing, self.blocks(s)) for s in range(pp)]
        self.numel = tokens * shape.hidden // cp     # a context rank's tokens of the micro-batch
        heads, kv, _ = head_counts(shape.plan, shape.config, tp)
        head_dim = getattr(shape.config, "head_dim", None) or shape.hidden // heads
        # a context rank's block: its tokens' keys and values for its TP rank's kv heads
        self.kv_numel = 2 * config.micro_batch_size * max(kv // tp, 1) * (w.seq // cp) * head_dim
        self.inexact = defaultdict(int)
        self.received = defaultdict(int)
        self.sums = {}
        self.drawn = 0     # packet fates drawn (lossy groups simulated), all steps
        self.choices = defaultdict(set)   # (class, collective, algorithm, protocol, channels) -> bytes
        self.sampled = w.sampled(mesh.world)
        self.rng = np.random.default_rng(stream_seed(config.seed, "estimate.slowest", "groups"))

    def _init_experts(self, shape: Shape, config: ExperimentConfig, w: Workload, tokens: int, settings: dict) -> None:
        """A mixture of experts' ep groups per stage (tp x expert-data of them), the routing's message sizes,
        and the experts' gradient buckets over their expert-data-parallel groups."""
        mesh, experts = self.mesh, shape.experts
        self.experts = experts if mesh.ep > 1 else None
        self.ep_blocks = [[i for i in self.blocks(s) if self.experts and i in experts.blocks] for s in range(mesh.pp)]
        self.ep, self.expert_buckets, self.edp = [], [], []
        if self.experts is None:
            return
        ep, edp = mesh.ep, mesh.dp // mesh.ep
        per = routing.rows(tokens, experts.top_k, experts.count, ep, w.routing_skew, config.seed)
        sent = tuple(0 if s == d else per[s][d] * shape.hidden for s in range(ep) for d in range(ep))
        self.ep_counts = (sent, tuple(sent[d * ep + s] for s in range(ep) for d in range(ep)))   # dispatch, combine
        for s in range(mesh.pp):
            pairs = [tuple(mesh.ep_network_spec(settings, mesh.rank_at(tp=t, dp=g * ep, pp=s), c,
                                                config.lossy_directions(c)) for c in EP_CLASSES)
                     for t in range(mesh.tp) for g in range(edp)]
            lossy = self.ep_lossy = any(_lossy(LossyNetwork(spec)) for spec in pairs[0])
            self.ep.append([_ExpertGroup(p, 1) for p in pairs] if lossy else [_ExpertGroup(pairs[0], len(pairs))])
            local = [torch.empty(experts.parameters // len(experts.blocks) // ep, device="meta", requires_grad=True,
                                 dtype=w.grad_torch_dtype) for _ in self.ep_blocks[s]]
            self.expert_buckets.append(plan_buckets(local, set(), config.dp_bucket_mb * (1 << 20)) if local else [])
            self.edp.append(_groups([mesh.edp_network_spec(settings, mesh.rank_at(tp=t, dp=e, pp=s), config.dp_lossy())
                                     for t in range(mesh.tp) for e in range(ep)]) if edp > 1 else [])

    def _sample(self, groups: list[_Group], stages: float = 1) -> tuple[list[_Group], int]:
        """The groups simulated, each standing for its share of the G (of each of ``stages`` alike
        stages: a stage of fewer blocks counts its share), and how many of the first stage's are drawn
        instead."""
        k = self.sampled
        if not k or groups[0].copies > 1 or (len(groups) <= k and stages == 1):
            return groups, 0
        k = min(k, len(groups))
        return [g._replace(copies=len(groups) * stages / k) for g in groups[:k]], len(groups) - k

    def _draw_groups(self, per_step: list[list], k: int) -> None:
        """Fill each step's groups after the first ``k`` (simulated) with [micro-batch] of two items,
        each drawn independently from the simulated groups' items of that kind over every micro-batch
        and step (they are identically distributed: the same messages on groups alike but for streams)."""
        pool = np.asarray([groups[j] for groups in per_step for j in range(k)], dtype=float).reshape(-1, 2, 2)
        for groups in per_step:
            for j in range(k, len(groups)):
                drawn = self.rng.integers(len(pool), size=(len(groups[0]), 2))
                groups[j] = [(pool[a, 0].tolist(), pool[b, 1].tolist()) for a, b in drawn]

    def blocks(self, stage: int) -> range:
        first = sum(self.layout[:stage])
        return range(first, first + self.layout[stage])

    def shares(self, tokens: int) -> list[float]:
        """Each stage's share of a micro-batch's compute: its share of the FLOPs (training's
        ``_stage_shares``)."""
        flops = [cost.step_flops(n, tokens, layers, self.shape.hidden, self.w.seq)
                 for n, layers in zip(self._stage_parameters, self.layout)]
        return [f / sum(flops) for f in flops]

    def _buckets(self) -> list:
        """Each stage's buckets of a TP rank's local gradients, planned as training plans them on the
        TP-sharded model (built on the meta device), in the reduce dtype."""
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.shape.config)
        experts = self._expert_parameters(model)   # averaged over their own groups (``expert_buckets``)
        tp_model = parallelize(model, self.mesh.tp, LossyNetwork(self.mesh.tp)).to(self.w.grad_torch_dtype)
        owner = self._owners(model)    # after sharding: its layers' parameters are new ones
        sharded = {id(p) for p in tp_model.sharded_parameters()}
        params = [p for p in tp_model.parameters() if id(p) not in experts]
        cap = self.config.dp_bucket_mb * (1 << 20)
        return [plan_buckets([p for p in params if owner.get(id(p), self.mesh.pp - 1) == s], sharded, cap)
                for s in range(self.mesh.pp)]

    def _expert_parameters(self, model) -> set[int]:
        """The ids of ``model``'s routed experts' parameters (none without expert parallelism)."""
        plan = self.shape.plan
        if self.experts is None:
            return set()
        parent, _, leaf = plan.experts.rpartition(".")
        return {id(p) for block in model.base_model.get_submodule(plan.blocks)
                if hasattr(block.get_submodule(parent), leaf) for p in getattr(block.get_submodule(parent), leaf).parameters()}

    @property
    def _stage_parameters(self) -> list[int]:
        if not hasattr(self, "_stage_counts"):
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(self.shape.config)
            self._stage_counts = stage_parameters(model, self.layout)
        return self._stage_counts

    def _owners(self, model) -> dict:
        """Parameter id -> its stage (as ``stage_parameters`` places them); the head is the last's."""
        plan, last = self.shape.plan, self.mesh.pp - 1
        stage_of = [s for s, count in enumerate(self.layout) for _ in range(count)]
        owner = {}
        for name, param in model.base_model.named_parameters():
            if name.startswith(f"{plan.blocks}."):
                owner[id(param)] = stage_of[int(name.split(".")[1])]
            else:
                owner[id(param)] = last if name.startswith(f"{plan.final_norm}.") else 0
        return owner

    # -- the steps ------------------------------------------------------------------------------
    def run(self, steps: int, tick: Optional[Callable[[], None]] = None) -> list[dict]:
        """Every class's messages of ``steps`` steps; per step their seconds, each [with loss, loss-free].

        A network's calls depend only on its own streams, so each group runs all its steps in turn and
        its network is let go once counted (its transfers are most of an estimate's memory)."""
        m, dtype, grad = self.config.n_microbatches, self.dtype, self.w.grad_torch_dtype
        out = [{"tp": [[None] * len(g) for g in self.tp], "pp": [[None] * len(g) for g in self.pp],
                "cp": [[None] * len(g) for g in self.cp], "bucket": [], "gather": []} for _ in range(steps)]
        self._contexts(out, steps, m)
        for s, groups in enumerate(self.tp):
            chosen, extra = self._sample(groups)
            for j, group in enumerate(chosen):
                net = LossyNetwork(group.spec)
                if self.sampled and not _lossy(net):
                    # loss-free and deterministic: every micro-batch of every step is the first one's
                    once = self._tp_group(net, group.copies * m * steps, s, 1)
                    for step in out:
                        step["tp"][s][j] = once * m
                    self._count("tp", net, group.copies * m * steps)
                    continue
                for step in out:
                    step["tp"][s][j] = self._tp_group(net, group.copies, s, m)
                self._count("tp", net, group.copies)
            if extra:
                self._draw_groups([step["tp"][s] for step in out], len(chosen))
        alike = defaultdict(list)   # boundaries whose groups differ only by their streams: one pool
        for b, groups in enumerate(self.pp):
            chosen, extra = self._sample(groups)
            for j, group in enumerate(chosen):
                net = LossyNetwork(group.spec)
                for step in out:
                    step["pp"][b][j] = self._sends(net, group.copies, b, m)
                self._count("pp", net, group.copies)
            if extra:
                alike[dataclasses.replace(groups[0].spec, seed=0), len(chosen)].append(b)
        for (_, k), boundaries in alike.items():
            self._draw_groups([step["pp"][b] for step in out for b in boundaries], k)
        if self.mode == "ddp":
            for step in out:
                step["bucket"] = [None] * len(self.dp)
            alike = defaultdict(list)   # under the model, stages alike but for streams share the simulated groups
            for s, (groups, buckets) in enumerate(zip(self.dp, self.buckets)):
                same = self.sampled and groups[0].copies == 1
                alike[(dataclasses.replace(groups[0].spec, seed=0), tuple(b.numel for b in buckets))
                      if same else s].append(s)
            for stages in alike.values():
                messages = [(f"dp.bucket{b}", "bwd", bucket.numel, grad, "all_reduce")
                            for b, bucket in enumerate(self.buckets[stages[0]])]
                for s, per_step in zip(stages, self._slowest(self.dp[stages[0]], messages, "dp", steps, len(stages))):
                    for step, seconds in zip(out, per_step):
                        step["bucket"][s] = seconds
        elif self.mode == "fsdp":
            units = self.buckets[0]
            messages = [(f"fsdp.gather{b}", "fwd", lambda net, n=unit.numel: shard_numel(net, n, dtype), dtype,
                         "all_gather") for b, unit in enumerate(units)] + \
                [(f"fsdp.reduce{b}", "bwd", lambda net, n=unit.numel: net.ranks * shard_numel(net, n, grad), grad,
                  "reduce_scatter") for b, unit in enumerate(units)]
            for step, seconds in zip(out, self._slowest(self.dp[0], messages, "fsdp", steps)[0]):
                step["gather"], step["bucket"] = seconds[:len(units)], [seconds[len(units):]]
        if self.experts is not None:
            self._run_experts(out, steps)
        for _ in range(steps if tick is not None else 0):
            tick()
        return out

    # -- experts ------------------------------------------------------------------------------------
    def _run_experts(self, out: list[dict], steps: int) -> None:
        """Every step's all-to-alls per stage, ep group and micro-batch (``out[step][cls][stage][group]``:
        [micro-batch] of (forward, backward), each [with loss, loss-free]), and the experts' buckets per stage
        (``out[step]["expert_bucket"][stage]``: each bucket's [with loss, loss-free], the slowest group's).

        Every group and micro-batch is simulated up to ``FULL_UP_TO`` GPUs (a loss-free job: one micro-batch of
        one group stands for all, exactly). Beyond, ``sampled`` groups of the first stage with experts run one
        micro-batch each, and every block's calls elsewhere are drawn from theirs, block by block: every ep
        group's messages are the same sizes, on networks alike but for their streams."""
        m, zero = self.config.n_microbatches, ([0.0, 0.0], [0.0, 0.0])
        stages = [s for s in range(self.mesh.pp) if self.ep_blocks[s]]
        for step in out:
            for cls in EP_CLASSES:   # a stage without experts sends none
                step[cls] = [[None] * len(self.ep[s]) if s in stages else [[zero] * m] for s in range(self.mesh.pp)]
            step["expert_bucket"] = [[] for _ in range(self.mesh.pp)]
        if self.sampled and self.ep_lossy:
            self._sampled_experts(out, steps, stages)
        for s in stages if not (self.sampled and self.ep_lossy) else ():
            blocks = self.ep_blocks[s]
            for j, group in enumerate(self.ep[s]):
                nets = [LossyNetwork(spec) for spec in group.specs]
                if self.sampled:   # loss-free, deterministic: one micro-batch stands for every one
                    copies = group.copies * m * steps
                    micro = _block_sum(self._ep_micro(nets, blocks, copies))
                    for step in out:
                        for cls in EP_CLASSES:
                            step[cls][s][j] = [micro[cls]] * m
                else:
                    copies = group.copies
                    for step in out:
                        micro = [_block_sum(self._ep_micro(nets, blocks, copies)) for _ in range(m)]
                        for cls in EP_CLASSES:
                            step[cls][s][j] = [mb[cls] for mb in micro]
                for cls, net in zip(EP_CLASSES, nets):
                    self._count(cls, net, copies)
        for s in stages:
            if self.edp[s] and self.expert_buckets[s]:
                messages = [(f"dp.bucket{b}", "bwd", bucket.numel, self.w.grad_torch_dtype, "all_reduce")
                            for b, bucket in enumerate(self.expert_buckets[s])]
                for step, seconds in zip(out, self._slowest(self.edp[s], messages, "dp", steps)[0]):
                    step["expert_bucket"][s] = seconds

    def _sampled_experts(self, out: list[dict], steps: int, stages: list[int]) -> None:
        m, first = self.config.n_microbatches, stages[0]
        chosen = self.ep[first][:self.sampled]
        units = steps * sum(len(self.ep[s]) * m * len(self.ep_blocks[s]) for s in stages)   # block calls in all
        copies = units / (len(chosen) * len(self.ep_blocks[first]))
        pool = []
        for group in chosen:
            nets = [LossyNetwork(spec) for spec in group.specs]
            pool += self._ep_micro(nets, self.ep_blocks[first], copies)
            for cls, net in zip(EP_CLASSES, nets):
                self._count(cls, net, copies)
        for step in out:
            for s in stages:
                drawn = self.rng.integers(len(pool), size=(len(self.ep[s]), m, len(self.ep_blocks[s])))
                for cls in EP_CLASSES:
                    step[cls][s] = [[_block_sum([pool[i] for i in blocks])[cls] for blocks in group.tolist()]
                                    for group in drawn]

    def _ep_micro(self, nets: list[LossyNetwork], blocks: list[int], copies: float) -> list[dict]:
        """One micro-batch's all-to-alls on one ep group, as training makes them: forward, block by block,
        dispatch then combine; backward, blocks in reverse, combine's gradient then dispatch's. Per block,
        per class: (forward, backward), each [with loss, loss-free] seconds."""
        sent, back = self.ep_counts
        site = f"{self.shape.plan.blocks}.{{}}.{self.shape.plan.experts}.{{}}"
        calls = [(b, cls, "fwd", sent if cls == EP_CLASSES[0] else back) for b in blocks for cls in EP_CLASSES]
        calls += [(b, cls, "bwd", sent if cls == EP_CLASSES[1] else back) for b in reversed(blocks)
                  for cls in reversed(EP_CLASSES)]
        out = {b: {cls: ([0.0, 0.0], [0.0, 0.0]) for cls in EP_CLASSES} for b in blocks}
        for b, cls, direction, counts in calls:
            net = nets[EP_CLASSES.index(cls)]
            before, lost = _mark(net), net.totals()
            net.simulate(site.format(b, cls.removeprefix("ep_")), direction, sum(counts), self.dtype, "all_to_all",
                         deliver=False, counts=counts)
            after, now = _mark(net), net.totals()
            pair = out[b][cls][0 if direction == "fwd" else 1]
            pair[0], pair[1] = pair[0] + after[0] - before[0], pair[1] + after[1] - before[1]
            missing = now["missing"] - lost["missing"] if net.transport.repairs else now["lost"] - lost["lost"]
            per_packet, _ = net.packets(1, self.dtype)
            self.received[cls, direction] += sum(counts) * copies
            self.inexact[cls, direction] += missing * per_packet * copies
        return [out[b] for b in blocks]

    # -- context parallelism ------------------------------------------------------------------------
    def _contexts(self, out: list[dict], steps: int, m: int) -> None:
        """Every stage's context groups' exchanges, per step: ``out[step]["cp"][s][j]``, group j's [micro-batch,
        direction, (with loss, loss-free), block] seconds added (``_context_group``). A loss-free group is the
        same at every micro-batch, step and stage alike (simulated once); with sampled groups, stages alike but
        for their streams (and their number of blocks: a stage of fewer reads its first blocks') share the
        simulated groups of the one with the most blocks, the others' drawn from them, and a simulated group
        simulates ``sampled_groups`` of its micro-batches, the others drawn alike."""
        alike = defaultdict(list)
        for s, groups in enumerate(self.cp):
            spec = dataclasses.replace(groups[0].spec, seed=0)
            alike[(spec, groups[0].copies) if groups[0].copies > 1 or self.sampled else s].append(s)
        for stages in alike.values():
            # the stage with the most blocks stands for the others (a stage of fewer: its first blocks)
            first = max(stages, key=lambda s: len(self.blocks(s)))
            groups, weight = self.cp[first], sum(len(self.blocks(s)) for s in stages) / len(self.blocks(first))
            if groups[0].copies > 1:   # loss-free: one group, deterministic
                net = LossyNetwork(groups[0].spec)
                once = self._context_group(net, 1, first, 1)
                for s in stages:
                    for step in out:
                        step["cp"][s][0] = np.repeat(once[..., :len(self.blocks(s))], m, axis=0)
                self._count("cp", net, groups[0].copies * m * steps * weight)
                continue
            chosen, extra = self._sample(groups, weight)
            # under the model, a simulated group also simulates only k of its micro-batches (alike but for
            # their draws), the others drawn from them as the other groups' are: every block's exchange of
            # every micro-batch is hundreds of sends
            simulated = min(self.sampled, m) if self.sampled else m
            for j, group in enumerate(chosen):
                net = LossyNetwork(group.spec)
                copies = group.copies * m / simulated
                for step in out:
                    step["cp"][first][j] = self._context_group(net, copies, first, simulated)
                self._count("cp", net, copies)
            k = len(chosen)
            pool = np.concatenate([step["cp"][first][j] for step in out for j in range(k)])   # [items, 2, 2, blocks]
            for step in out:
                for j in range(k if simulated < m else 0):
                    drawn = self.rng.integers(len(pool), size=(m - simulated, 2))
                    more = np.stack([pool[drawn[:, 0], 0], pool[drawn[:, 1], 1]], axis=1)
                    step["cp"][first][j] = np.concatenate([step["cp"][first][j], more])
            for s in stages:
                fill = len(groups) - k if s == first else len(groups)
                for step in out:
                    if not fill:
                        continue
                    # forward and backward drawn apart, as ``_draw_groups`` draws TP's
                    drawn = self.rng.integers(len(pool), size=(fill, m, 2))
                    filled = np.stack([pool[drawn[..., 0], 0], pool[drawn[..., 1], 1]], axis=2)[..., :len(self.blocks(s))]
                    step["cp"][s] = (step["cp"][first][:k] if s == first else []) + list(filled)

    def _context_group(self, net: LossyNetwork, copies: float, stage: int, m: int) -> np.ndarray:
        """[micro-batch, direction, (with loss, loss-free), block]: what each block's exchange over this
        context group adds beside its attention (``cp.clock.exposed``), in training's order: every block's
        forward exchange, then every block's backward one, blocks in reverse."""
        cp, mode, dtype, n = self.mesh.cp, self.config.cp_mode, self.dtype, self.kv_numel
        plan, blocks = self.shape.plan, list(self.blocks(stage))
        per_packet, _ = net.packets(n, dtype)
        out = np.zeros((m, 2, 2, len(blocks)))
        for i in range(m):
            for d, direction in enumerate(("fwd", "bwd")):
                order = range(len(blocks)) if direction == "fwd" else reversed(range(len(blocks)))
                for b in order:
                    site = f"{plan.blocks}.{blocks[b]}.{plan.attention}.kv"
                    rounds = self._exchange(net, site, direction, mode, cp, n, per_packet, copies)
                    for k in (0, 1):
                        out[i, d, k, b] = cp_clock.exposed(mode, [r[k] for r in rounds], self.attention_s[d])
        return out

    def _exchange(self, net: LossyNetwork, site: str, direction: str, mode: str, cp: int, n: int, per_packet: int,
                  copies: float) -> list:
        """One block's exchange (``cp.exchange``'s calls, without tensors): each round's [with loss, loss-free]
        seconds, the slowest send's."""
        dtype = self.dtype
        if mode == "allgather":
            collective = "all_gather" if direction == "fwd" else "reduce_scatter"
            numel = n if direction == "fwd" else cp * per_packet * -(-n // per_packet)   # each origin padded
            before = _mark(net)
            delivery = net.simulate(site, direction, numel, dtype, collective, deliver=False)
            after = _mark(net)
            self._lost("cp", direction, delivery, per_packet, numel, _held(collective, cp, numel), copies, collective)
            return [[after[0] - before[0], after[1] - before[1]]]
        rounds = []
        holes = [np.zeros(0, dtype=np.int64) for _ in range(cp)]   # per origin: the packets its block misses
        short = per_packet * -(-n // per_packet) - n                   # the last packet is partial
        for step in (range(1, cp) if direction == "fwd" else range(cp - 1, 0, -1)):
            slowest = [0.0, 0.0]
            for i in range(cp):
                pair = (i, (i + 1) % cp) if direction == "fwd" else ((i + 1) % cp, i)
                before = _mark(net)
                delivery = net.simulate(site, direction, n, dtype, "send", deliver=False, pair=pair)
                after = _mark(net)
                slowest = [max(slowest[0], after[0] - before[0]), max(slowest[1], after[1] - before[1])]
                if direction == "bwd":   # a gradient's sum: what this hop lost
                    self._lost("cp", direction, delivery, per_packet, n, n, copies)
                    continue
                # keys and values: a hop forwards what arrived, its receiver misses every hole so far
                origin = (i - step + 1) % cp
                if delivery is not None:
                    holes[origin] = np.union1d(holes[origin], _lost_packets(delivery))
                missed = holes[origin]
                self.received["cp", "fwd"] += n * copies
                self.inexact["cp", "fwd"] += (len(missed) * per_packet -
                                              short * int(len(missed) and missed[-1] == -(-n // per_packet) - 1)) * copies
            rounds.append(slowest)
        return rounds

    def _count(self, cls: str, net: LossyNetwork, copies: float) -> None:
        if _lossy(net):
            self.drawn += net.totals()["sent"]
        sums = self.sums.setdefault(cls, defaultdict(float))
        totals = net.totals()
        for name in ("sent", "lost", "resent"):
            sums[name] += totals[name] * copies
        sums["failures"] += net.totals()["failures"] * copies
        for c in net.choices():   # what NCCL runs each message as (``algorithm: auto`` picks per size)
            self.choices[(cls, c["collective"], c["algorithm"], c["protocol"], c["channels"])].add(c["bytes"])

    def choice_summary(self) -> str:
        """One line per (class, collective, algorithm/protocol, channels) the job ran, with its message
        sizes: the estimate's ``collectives`` column."""
        def size(b: int) -> str:
            return f"{b / 2**20:.3g} MiB" if b >= 2**20 else f"{b / 2**10:.3g} KiB"
        return "; ".join(f"{cls} {collective}: {algorithm}/{protocol} x{channels} "
                         f"({size(min(sizes))}{'' if len(sizes) == 1 else '-' + size(max(sizes))})"
                         for (cls, collective, algorithm, protocol, channels), sizes in sorted(self.choices.items()))

    def _tp_group(self, net: LossyNetwork, copies: int, stage: int, m: int) -> list:
        """[micro-batch] of (forward, backward), each [with loss, loss-free] seconds of its all-reduces."""
        calls, dtype = self.calls[stage], self.dtype
        per_packet, _ = net.packets(self.numel, dtype)
        forwards = next((k for k, c in enumerate(calls) if c.direction != "fwd" or c.replay), len(calls))
        out = []
        for _ in range(m):
            record = defaultdict(deque)   # the first forward's deliveries, for the recomputed one
            marks = [_mark(net)]
            for k, call in enumerate(calls):
                if k == forwards:
                    marks.append(_mark(net))
                if call.replay:
                    with net.replaying(record):
                        net.simulate(call.site, call.direction, self.numel, dtype)
                    continue
                recording = net.recording(record) if self.config.activation_checkpointing else contextlib.nullcontext()
                with recording:
                    delivery = net.simulate(call.site, call.direction, self.numel, dtype, deliver=False)
                self._lost("tp", call.direction, delivery, per_packet, self.numel, net.ranks * self.numel, copies)
            marks.append(_mark(net))
            out.append(tuple([b[0] - a[0], b[1] - a[1]] for a, b in zip(marks, marks[1:])))
        return out

    def _sends(self, net: LossyNetwork, copies: int, boundary: int, m: int) -> list:
        """[micro-batch] of (activation, gradient), each [with loss, loss-free] seconds of the slowest of
        the TP ranks' sends over ``boundary``, issued in training's order."""
        dtype, tp = self.dtype, self.mesh.tp
        per_packet, _ = net.packets(self.numel, dtype)
        out = []
        for _ in range(m):
            pair = []
            for direction in ("fwd", "bwd"):
                slowest = [0.0, 0.0]
                for t in range(tp):
                    before = _mark(net)
                    delivery = net.simulate(f"pp.boundary{boundary}", direction, self.numel, dtype, "send",
                                            deliver=False, pair=(t, tp + t) if direction == "fwd" else (tp + t, t))
                    after = _mark(net)
                    slowest = [max(slowest[0], after[0] - before[0]), max(slowest[1], after[1] - before[1])]
                    self._lost("pp", direction, delivery, per_packet, self.numel, self.numel, copies)
                pair.append(slowest)
            out.append(tuple(pair))
        return out

    def _slowest(self, groups: list[_Group], messages: list, cls: str, steps: int, stages: int = 1) -> list:
        """Per step, each message's [with loss, loss-free] seconds, the slowest group's: groups run side
        by side. ``messages``: (site, direction, numel or numel(network), dtype, collective). Groups
        beyond the sampled ones: each message's slowest repair is drawn from the simulated repairs of
        every message of its kind (direction, collective and packets, on groups alike but for streams),
        added to its own loss-free time (the same in every group). ``stages`` > 1: as many stages alike
        but for their streams, the groups of all but the first drawn whole. Returns [stage][step][message]."""
        chosen, extra = self._sample(groups, stages)
        seconds = np.zeros((len(chosen), steps, len(messages), 2))
        kinds = [None] * len(messages)
        for g, group in enumerate(chosen):
            net = LossyNetwork(group.spec)
            for i in range(steps):
                for k, (site, direction, numel, dtype, collective) in enumerate(messages):
                    numel = numel(net) if callable(numel) else numel
                    per_packet, n_packets = net.packets(numel, dtype)
                    kinds[k] = (direction, collective, n_packets)
                    before = _mark(net)
                    delivery = net.simulate(site, direction, numel, dtype, collective, deliver=False)
                    after = _mark(net)
                    seconds[g, i, k] = after[0] - before[0], after[1] - before[1]
                    self._lost(cls, direction, delivery, per_packet, numel, _held(collective, net.ranks, numel),
                               group.copies, collective)
            self._count(cls, net, group.copies)
        slowest = np.repeat(seconds.max(axis=0)[None], stages, axis=0)
        slowest[1:, :, :, 0] = slowest[1:, :, :, 1]
        for kind in dict.fromkeys(kinds) if extra or stages > 1 else ():
            alike = [k for k, other in enumerate(kinds) if other == kind]
            pool = (seconds[:, :, alike, 0] - seconds[:, :, alike, 1]).ravel()
            for stage, draws in enumerate([extra] + [len(groups)] * (stages - 1)):
                if not draws:
                    continue
                drawn = pool[self.rng.integers(len(pool), size=(steps, len(alike), draws))].max(axis=2)
                both = slowest[stage][:, alike]
                slowest[stage][:, alike, 0] = np.maximum(both[..., 0], both[..., 1] + drawn)
        return slowest.tolist()

    def _lost(self, cls: str, direction: str, delivery, per_packet: int, numel: int, received: int,
              copies: int, collective: str = "all_reduce") -> None:
        self.received[cls, direction] += received * copies
        if delivery is not None:
            self.inexact[cls, direction] += _inexact_elements(delivery, per_packet, numel, collective) * copies

    def elements_lost(self, cls: str, direction: Optional[str] = None) -> float:
        """The share of ``cls``'s received elements (in ``direction``, or both) that did not arrive exact."""
        keys = [(cls, d) for d in (("fwd", "bwd") if direction is None else (direction,))]
        received = sum(self.received[k] for k in keys)
        return sum(self.inexact[k] for k in keys) / received if received else 0.0

    def counts(self, steps: int) -> dict:
        """Per class, per step: packets sent, lost and resent, and the transport's failures."""
        return {cls: {name: value / steps for name, value in sums.items()} for cls, sums in self.sums.items()}


class _Clock:
    """One step's end from its parts' seconds (``k`` 0: with loss, 1: loss-free), any class zeroed."""

    # a class's times (the experts' buckets are data-parallel traffic)
    KEYS = {"tp": ("tp",), "pp": ("pp",), "dp": ("bucket", "expert_bucket"), "fsdp": ("bucket", "gather"),
            **{cls: (cls,) for cls in EP_CLASSES}, "cp": ("cp",)}

    def __init__(self, times: dict, micro_s: float, shares: list[float], config: ExperimentConfig, pp: int, dp: int,
                 m: int, ready: list, cp: int = 1):
        self.t, self.c, self.shares, self.config, self.pp, self.dp, self.m, self.ready, self.cp = \
            times, micro_s, shares, config, pp, dp, m, ready, cp

    def loss_free(self, cls: str) -> "_Clock":
        """This clock with ``cls``'s messages at their loss-free seconds (their repairs taken away)."""
        times = dict(self.t)
        for key in self.KEYS[cls]:
            if key in times:
                times[key] = _at_loss_free(times[key])
        return _Clock(times, self.c, self.shares, self.config, self.pp, self.dp, self.m, self.ready, self.cp)

    def _context(self, s: int, r: int, k: int) -> np.ndarray:
        """[micro-batch, direction]: what replica ``r``'s stage ``s``'s context exchanges add, each block's
        slowest TP position's (zeros without context parallelism)."""
        groups = self.t["cp"][s] if self.t["cp"] else []
        if not groups:
            return np.zeros((self.m, 2))
        mine = groups if len(groups) == 1 else groups[r * len(groups) // self.dp:(r + 1) * len(groups) // self.dp]
        return np.max(np.stack(mine), axis=0)[:, :, k].sum(-1)

    def _experts(self, zero) -> Callable:
        """``(stage, replica)`` -> [micro-batch] of (forward, backward) [with loss, loss-free] seconds of the
        replica's all-to-alls: each class's summed (those not in ``zero``), the slowest of its TP ranks' groups."""
        present = [cls for cls in EP_CLASSES if cls in self.t and cls not in zero]
        mesh = self.config.mesh()

        def of(s: int, r: int) -> list:
            total = [([0.0, 0.0], [0.0, 0.0]) for _ in range(self.m)]
            for cls in present:
                groups = self.t[cls][s]
                mine = [groups[0]] if len(groups) == 1 else \
                    [groups[t * (mesh.dp // mesh.ep) + r // mesh.ep] for t in range(mesh.tp)]
                for i, pair in enumerate(total):
                    for d in (0, 1):
                        for q in (0, 1):
                            pair[d][q] += max(group[i][d][q] for group in mine)
            return total
        return of

    def _replicas(self) -> list[int]:
        """One replica of each kind whose paths differ (replica 0 first): a replica's TP groups, pipeline
        boundaries and context groups are its own where every one was simulated, its ep groups its
        expert-data index's."""
        mesh = self.config.mesh()
        tp, pp = self.t["tp"], self.t["pp"]
        experts = any(len(groups) > 1 for cls in EP_CLASSES for groups in self.t.get(cls, []))
        own = any(len(g) > 1 for g in (*tp, *pp, *self.t["cp"]))
        kinds: dict = {}
        for r in range(self.dp if own or experts else 1):
            kinds.setdefault((r if own else 0, r // mesh.ep if experts else 0), r)
        return list(kinds.values())

    def _expert_buckets(self, k: int, zero) -> float:
        """What the experts' buckets add after the backward: the slowest stage's, one after another."""
        if "dp" in zero or not self.t.get("expert_bucket"):
            return 0.0
        return max((sum(seconds[k] for seconds in stage) for stage in self.t["expert_bucket"]), default=0.0)

    def step(self, k: int, zero=()) -> float:
        tp = self.t["tp"]
        tp_of = (lambda s, r: [[[0.0, 0.0]] * 2] * self.m) if "tp" in zero else \
            (lambda s, r: tp[s][r * self.cp if len(tp[s]) > 1 else 0])   # context rank 0's, as training charges
        ep_of = self._experts(zero)
        cp_of = (lambda s, r: np.zeros((self.m, 2))) if "cp" in zero else (lambda s, r: self._context(s, r, k))
        bucket = [[[0.0, 0.0]] * len(b) for b in self.t["bucket"]] if {"dp", "fsdp"} & set(zero) else self.t["bucket"]
        gather = [] if "fsdp" in zero or not self.t["gather"] else [g[k] for g in self.t["gather"]]
        replicas = self._replicas()
        c, m, overlap = self.c, self.m, self.config.dp_overlap
        if self.pp == 1:
            paths = []
            for r in replicas:
                forward = backward = comm = 0.0
                for (f, b), (ef, eb), (cf, cb) in zip(tp_of(0, r), ep_of(0, r), cp_of(0, r)):
                    forward += c / 3 + f[k] + ef[k] + cf
                    backward += c * 2 / 3 + b[k] + eb[k] + cb
                    comm += f[k] + b[k] + ef[k] + eb[k] + cf + cb
                paths.append((forward, backward, comm))
            step = m * c + paths[0][2]
            if self.dp > 1:   # training's ``DataParallel.added_seconds``
                step += timeline.added_seconds([p[:2] for p in paths], self.ready[0], gather,
                                               [s[k] for s in bucket[0]], overlap)
            return step + self._expert_buckets(k, zero)
        pp = self.t["pp"]
        sends = (lambda b, r: [[[0.0, 0.0]] * 2] * m) if "pp" in zero else \
            (lambda b, r: pp[b][r * self.cp if len(pp[b]) > 1 else 0])
        timings = []
        for r in replicas:
            stages = [tp_of(s, r) for s in range(self.pp)]
            moe = [ep_of(s, r) for s in range(self.pp)]
            contexts = [cp_of(s, r) for s in range(self.pp)]
            forward = [[c * _THIRD * share + f[k] + ef[k] + added[0]
                        for (f, _), (ef, _), added in zip(stage, alltoall, context)]
                       for stage, alltoall, context, share in zip(stages, moe, contexts, self.shares)]
            backward = [[c * (2 / 3) * share + b[k] + eb[k] + added[1]
                         for (_, b), (_, eb), added in zip(stage, alltoall, context)]
                        for stage, alltoall, context, share in zip(stages, moe, contexts, self.shares)]
            links = [sends(b, r) for b in range(self.pp - 1)]
            timings.append(pipeline_time(self.config.pp_schedule, self.pp, m, forward, backward,
                                         [[a[k] for a, _ in link] for link in links],
                                         [[g[k] for _, g in link] for link in links]))
        buckets = [[b[k] for b in stage] for stage in bucket] if self.dp > 1 else []
        return timeline.pipeline_step_seconds(timings, self.ready, buckets, overlap) + self._expert_buckets(k, zero)


def _block_sum(blocks: list[dict]) -> dict:
    """Per class, the (forward, backward) [with loss, loss-free] seconds of ``blocks`` together."""
    return {cls: tuple([sum(b[cls][d][q] for b in blocks) for q in (0, 1)] for d in (0, 1)) for cls in EP_CLASSES}


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


def _groups(specs: list[NetworkSpec]) -> list[_Group]:
    """Identical groups: every one that can lose packets, or one for all when none can."""
    if not _lossy(LossyNetwork(specs[0])):
        return [_Group(specs[0], len(specs))]
    return [_Group(spec, 1) for spec in specs]


def _lossy(net: LossyNetwork) -> bool:
    return not net.loss_model.lossless and net.topology.has_lossy_link and bool(net.lossy)


def _mark(net: LossyNetwork) -> tuple[float, float]:
    clock = net.clock()
    return clock["comm_s"], clock["ideal_comm_s"]


def _intervals(step_s: np.ndarray, level: float = 0.95) -> dict:
    """Mean, p50 and p99 of the step times, each with its ``level`` interval: Student's t for the mean;
    for a quantile the order statistics whose ranks bracket it with that probability (distribution-free).
    A bound the steps are too few to give is None: the interval is wide, take more steps (a p99's upper
    bound needs about 300)."""
    from scipy import stats
    n, x = len(step_s), np.sort(step_s)
    out = {"step_mean_s": float(x.mean())}
    if n > 1:
        half = float(stats.t.ppf(0.5 + level / 2, n - 1) * x.std(ddof=1) / np.sqrt(n))
        out["step_mean_lo_s"], out["step_mean_hi_s"] = out["step_mean_s"] - half, out["step_mean_s"] + half
    else:
        out["step_mean_lo_s"] = out["step_mean_hi_s"] = None
    tail = (1 - level) / 2
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        out[f"step_{name}_s"] = float(np.percentile(x, 100 * q))
        # P(X_(j) <= quantile) = P(Binomial(n, q) >= j): the lower rank l has it >= 1 - tail, the upper u
        lo = int(stats.binom.ppf(tail, n, q))            # 1-based rank: X_(lo) <= quantile w.p. >= 1 - tail
        hi = int(stats.binom.ppf(1 - tail, n, q)) + 1
        out[f"step_{name}_lo_s"] = float(x[lo - 1]) if lo >= 1 else None
        out[f"step_{name}_hi_s"] = float(x[hi - 1]) if hi <= n else None
    return out


def _held(collective: str, ranks: int, numel: int) -> int:
    """Elements a collective of ``numel`` (simulate's: an all-gather's per rank) leaves with its receivers:
    every rank the sum, every rank every shard, or every rank its chunk's sum."""
    return {"all_reduce": ranks * numel, "all_gather": ranks * ranks * numel, "reduce_scatter": numel}[collective]


def _lost_packets(delivery) -> np.ndarray:
    """A send's lost packets, sorted (``delivery``: a policy's draw, or the lost packets as ``Losses``)."""
    if isinstance(delivery, Losses):
        return np.unique(delivery.packet)
    return np.nonzero((packets_of(delivery).weights[0, 0] == 0).cpu().numpy())[0]


def _inexact_elements(delivery, per_packet: int, numel: int, collective: str = "all_reduce") -> int:
    """Elements, over every receiver, that are not the exact result: a hole, or a sum missing a contribution
    (``delivery``: a policy's draw, or the lost packets as ``Losses``)."""
    bad, last = delivery.bad_packets() if isinstance(delivery, Losses) else \
        bad_packets_of(packets_of(delivery), collective)
    short = per_packet * -(-numel // per_packet) - numel       # the last packet is partial
    return bad * per_packet - last * short
