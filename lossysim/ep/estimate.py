"""A mixture of experts' messages in an estimate (``ExpertMessages``, a part of ``estimate.job.Job``): ``ep_dispatch``
and ``ep_combine``, the all-to-alls per MoE block and micro-batch on every (stage, TP position, expert-data
index)'s ep group, sized by the routing assumed (``ep.routing``: uniform or skewed), in backward their
gradients the other way; and the experts' gradient buckets over their expert-data-parallel groups (class
``dp``), after the backward, as training averages them. Beside context parallelism the groups are carved out
of dp x cp as the mesh carves them (ep a multiple of cp: a replica's context ranks in one ep group; ep below
or beside cp: in several, the replica waiting on its slowest) and a rank
routes its own seq / cp tokens of each sequence. Beyond ``FULL_UP_TO`` GPUs, a few micro-batches of
one stage's sampled groups are simulated and every other block's calls drawn from theirs (docs/estimate.md,
"Experts").
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..dp.buckets import plan_buckets
from ..estimate.accounting import ExpertGroup, is_lossy, mark
from ..net import LossyNetwork
from . import routing
from .axis import EP_CLASSES


class ExpertMessages:
    """``Job``'s all-to-alls and experts' buckets; on the estimate's clock (``estimate.simulate``, called on the
    class): the row's columns, the replicas whose all-to-alls differ and their seconds on a replica's stream."""

    RUNS_FIRST = False   # the all-to-alls draw from the job's random stream after every other class's messages
    STREAM = "ep"        # its seconds on a replica's compute stream (``clock.OnStream``)

    @staticmethod
    def columns(shape, config, mesh, w) -> dict:
        """The estimate row's columns of experts: ep's size, the routing assumed and the busiest rank's load."""
        return {"ep_size": mesh.ep, "routing_skew": w.routing_skew if mesh.ep > 1 else 0.0,
                "routing_imbalance": routed_load(shape, mesh, w, config.seed)}

    @staticmethod
    def replica_kind(parts) -> Optional[Callable[[int], int]]:
        """Replica r's kind by its all-to-alls (its context ranks' expert-data indices' ep groups), None: every
        replica's alike."""
        if not any(len(groups) > 1 for cls in EP_CLASSES for groups in parts.t.get(cls, [])):
            return None
        mesh = parts.config.mesh()
        return lambda r: expert_data(mesh, r)

    @staticmethod
    def on_stream(parts, zero) -> Callable[[int, int], list]:
        """``(replica, k)`` -> [stage][micro-batch] of (forward, backward) seconds (``k`` 0: with loss, 1:
        loss-free) of the replica's all-to-alls: each class's summed (those not in ``zero``), the slowest of
        its TP ranks' groups (with context parallelism, of its context ranks': one ep group a TP rank with ep a
        multiple of cp, several without)."""
        present = [cls for cls in EP_CLASSES if cls in parts.t and cls not in zero]
        mesh = parts.config.mesh()
        edp = mesh.size("edp")

        def of(s: int, r: int) -> list:
            total = [([0.0, 0.0], [0.0, 0.0]) for _ in range(parts.m)]
            for cls in present:
                groups = parts.t[cls][s]
                mine = [groups[0]] if len(groups) == 1 else \
                    [groups[t * edp + g] for t in range(mesh.tp) for g in expert_data(mesh, r)]
                for i, pair in enumerate(total):
                    for d in (0, 1):
                        for q in (0, 1):
                            pair[d][q] += max(group[i][d][q] for group in mine)
            return total
        return lambda r, k: [[(f[k], b[k]) for f, b in of(s, r)] for s in range(parts.pp)]

    def init_part(self, shape, config, w, tokens: int, settings: dict) -> None:
        """A mixture of experts' ep groups per stage (tp x expert-data of them, carved out of dp x cp as the
        mesh carves them), the routing's message sizes (a rank routes its own tokens: with context parallelism
        its seq / cp of each sequence), and the experts' gradient buckets over their expert-data-parallel
        groups."""
        mesh, experts = self.mesh, shape.experts
        self.experts = experts if mesh.ep > 1 else None
        self.ep_blocks = [[i for i in self.blocks(s) if self.experts and i in experts.blocks] for s in range(mesh.pp)]
        self.ep, self.expert_buckets, self.edp = [], [], []
        if self.experts is None:
            return
        ep, edp = mesh.ep, mesh.size("edp")
        per = routing.rows(tokens // mesh.cp, experts.top_k, experts.count, ep, w.routing_skew, config.seed)
        sent = tuple(0 if s == d else per[s][d] * shape.hidden for s in range(ep) for d in range(ep))
        self.ep_counts = (sent, tuple(sent[d * ep + s] for s in range(ep) for d in range(ep)))   # dispatch, combine
        # the ep groups' first ranks at a TP position and stage: the mesh's expert-data group of its first rank
        staged = [[tuple(mesh.network_spec("ep", first, settings, config.lossy_directions(c), c) for c in EP_CLASSES)
                   for t in range(mesh.tp) for first in mesh.group("edp", mesh.rank(tp=t, pp=s))]
                  for s in range(mesh.pp)]
        # a fabric's groups all alike but for their streams are sampled as groups without one are (every stage's)
        one_by_one = staged[0][0][0].cables is not None and not (
            self.sampled and self.alike_on_fabric([p for pairs in staged for p in pairs]))
        for s, pairs in enumerate(staged):
            if one_by_one:   # on a fabric: the pairs that cross a lossy cable, one for the rest
                self.ep_lossy = False   # every lossy pair simulated, none sampled
                self.ep.append(self.aliased(ExpertGroup, pairs, [any(is_lossy(LossyNetwork(spec)) for spec in p)
                                                                 for p in pairs]))
            else:
                lossy = self.ep_lossy = any(is_lossy(LossyNetwork(spec)) for spec in pairs[0])
                self.ep.append([ExpertGroup(p, 1) for p in pairs] if lossy else [ExpertGroup(pairs[0], len(pairs))])
            local = [torch.empty(experts.parameters // len(experts.blocks) // ep, device="meta", requires_grad=True,
                                 dtype=w.grad_torch_dtype) for _ in self.ep_blocks[s]]
            self.expert_buckets.append(plan_buckets(local, set(), config.dp_bucket_mb * (1 << 20)) if local else [])
            # the expert-data groups' first ranks: the mesh's ep group of the stage's TP position's first rank
            firsts = [first for t in range(mesh.tp) for first in mesh.group("ep", mesh.rank(tp=t, pp=s))]
            self.edp.append(self.groups_of([mesh.network_spec("edp", first, settings, config.dp_lossy())
                                            for first in firsts]) if edp > 1 else [])

    def run_part(self, out: list[dict], steps: int, m: int) -> None:
        """Every step's all-to-alls and experts' buckets (none without experts over ranks)."""
        if self.experts is not None:
            self._run_experts(out, steps)

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
                if group.same_as >= 0:   # a fabric's clean group: its representative's times
                    for step in out:
                        for cls in EP_CLASSES:
                            step[cls][s][j] = step[cls][s][group.same_as]
                    continue
                nets = [LossyNetwork(spec) for spec in group.specs]
                if self.sampled and not any(is_lossy(net) for net in nets):   # loss-free, deterministic: one
                    # micro-batch stands for every one (on a fabric, a lossy group among clean ones is not)
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
                    self.count(cls, net, copies)
        shapes: dict = {}   # the stages' expert-data groups alike but for their streams build each bucket once
        for s in stages:
            if self.edp[s] and self.expert_buckets[s]:
                messages = [(f"dp.bucket{b}", "bwd", bucket.numel, self.w.grad_torch_dtype, "all_reduce")
                            for b, bucket in enumerate(self.expert_buckets[s])]
                for step, seconds in zip(out, self._slowest(self.edp[s], messages, "dp", steps, shapes)[0]):
                    step["expert_bucket"][s] = seconds

    def _sampled_experts(self, out: list[dict], steps: int, stages: list[int]) -> None:
        m, first = self.config.n_microbatches, stages[0]
        chosen = self.ep[first][:self.sampled]
        units = steps * sum(len(self.ep[s]) * m * len(self.ep_blocks[s]) for s in stages)   # block calls in all
        copies = units / (len(chosen) * len(self.ep_blocks[first]))
        if chosen[0].specs[0].cables is not None:   # a uniform fabric's: each chosen one stands for every k-th
            every = [group for s in stages for group in self.ep[s]]
            for c in range(len(EP_CLASSES)):
                self.stand_for.update((g.specs[c], [h.specs[c] for h in every[j::len(chosen)]])
                                      for j, g in enumerate(chosen))
        pool = []
        for group in chosen:
            nets = [LossyNetwork(spec) for spec in group.specs]
            pool += self._ep_micro(nets, self.ep_blocks[first], copies)
            for cls, net in zip(EP_CLASSES, nets):
                self.count(cls, net, copies)
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
            before, lost = mark(net), net.totals()
            net.simulate(site.format(b, cls.removeprefix("ep_")), direction, sum(counts), self.dtype, "all_to_all",
                         deliver=False, counts=counts)
            after, now = mark(net), net.totals()
            pair = out[b][cls][0 if direction == "fwd" else 1]
            pair[0], pair[1] = pair[0] + after[0] - before[0], pair[1] + after[1] - before[1]
            missing = now["missing"] - lost["missing"] if net.transport.repairs else now["lost"] - lost["lost"]
            per_packet, _ = net.packets(1, self.dtype)
            self.received[cls, direction] += sum(counts) * copies
            self.inexact[cls, direction] += missing * per_packet * copies
        return [out[b] for b in blocks]



def _block_sum(blocks: list[dict]) -> dict:
    """Per class, the (forward, backward) [with loss, loss-free] seconds of ``blocks`` together."""
    return {cls: tuple([sum(b[cls][d][q] for b in blocks) for q in (0, 1)] for d in (0, 1)) for cls in EP_CLASSES}


def expert_data(mesh, r: int) -> tuple[int, ...]:
    """Replica ``r``'s context ranks' expert-data indices (the mesh's ``edp`` coordinate: their ep groups' at one
    TP position and stage; one with ep a multiple of cp, else several)."""
    return tuple(sorted({mesh.coordinates(mesh.rank(dp=r, cp=c))["edp"] for c in range(mesh.cp)}))


def routed_load(shape, mesh, w, seed: int) -> float:
    """The busiest rank's routed load as the routing assumed makes it (``routing.imbalance``; 1 with ep 1)."""
    e = shape.experts
    return routing.imbalance(e.top_k, e.count, mesh.ep, w.routing_skew, seed) if mesh.ep > 1 else 1.0


PART = ExpertMessages
