"""Replicas of the tensor-parallel group and the data-parallel traffic between them.

Global ranks are laid out tp-major: replica r's TP ranks are ``r * tp_size .. r * tp_size + tp_size - 1``.
TP position t of every replica forms data-parallel group t (ranks ``t, tp_size + t, ...``), with its own
``LossyNetwork`` of dp_size ranks: its own links, chains and statistics, apart from the TP links'.

After every replica's backward, each bucket (``buckets``) of every group is all-reduced through the
group's network (site ``dp.bucket{i}``, direction ``bwd``): receiver r's sum is divided by dp_size and
written back as replica r's gradient. ``recovery: zero`` drops what was lost; ``rescale`` divides what
arrives by the probability that it arrives, hop by hop, as for TP traffic (unbiased for any
contributions; see docs/semantics.md). A replicated parameter (embeddings, norms, head) has one copy
per TP rank, each in its own group; a replica keeps the mean of what its groups delivered, as the
reliable channel that keeps replicated parameters equal inside a TP group would average them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..net import LossyNetwork
from ..timing import nccl
from . import buckets as bucketing
from .buckets import Bucket


@dataclass
class Replica:
    """One replica of the TP group: its model (whose TP network is its own), optimiser and schedule."""
    model: Any            # a TensorParallelModel
    optimizer: Any
    scheduler: Any


class DataParallel:
    """dp_size replicas, one data-parallel network per TP position, the bucket plan."""

    def __init__(self, replicas: Sequence[Replica], networks: Sequence[LossyNetwork], bucket_bytes: float):
        self.replicas = list(replicas)
        self.networks = list(networks)          # one per TP position
        self.dp_size = len(self.replicas)
        self.tp_size = len(self.networks)
        model = self.replicas[0].model
        sharded_ids = {id(q) for q in model.sharded_parameters()}
        self._sharded = {i for i, p in enumerate(model.parameters()) if id(p) in sharded_ids}
        self.buckets: list[Bucket] = bucketing.plan_buckets(list(model.parameters()), sharded_ids, bucket_bytes)

    def average_gradients(self) -> list[float]:
        """All-reduce every bucket in every group; write each replica's average back as its gradient.
        Returns each bucket's seconds on the clock (the slowest group's: groups run side by side)."""
        grads = [[_grad(p) for p in r.model.parameters()] for r in self.replicas]
        seconds = []
        for b, bucket in enumerate(self.buckets):
            slowest = 0.0
            replicated: dict[int, torch.Tensor] = {}   # parameter -> [dp, numel]: the groups' deliveries summed
            for t, network in enumerate(self.networks):
                before = network.clock()["comm_s"]
                contributions = torch.stack([bucketing.flatten(g, bucket, t) for g in grads])
                delivered = network.all_reduce(f"dp.bucket{b}", "bwd", contributions, range(self.dp_size))
                slowest = max(slowest, network.clock()["comm_s"] - before)
                averaged = delivered / self.dp_size
                for k, piece in enumerate(bucketing.pieces(averaged.transpose(0, 1), bucket)):
                    i = bucket.params[k]                 # piece: [numel, dp]
                    if bucket.sharded[k]:
                        for r, g in enumerate(grads):
                            g[i][t].copy_(piece[:, r].view_as(g[i][t]))
                    else:
                        replicated[i] = piece.clone() if t == 0 else replicated[i] + piece
            for i, summed in replicated.items():
                for r, g in enumerate(grads):
                    g[i].copy_((summed[:, r] / self.tp_size).view_as(g[i]))
            seconds.append(slowest)
        for replica, g in zip(self.replicas, grads):
            for p, grad in zip(replica.model.parameters(), g):
                p.grad = grad
        return seconds

    @torch.no_grad()
    def drift(self) -> float:
        """How far the replicas' parameters have drifted from replica 0's: max over r of
        ||p_r - p_0|| / ||p_0||, over every parameter (every TP rank's shard) at once."""
        base = [p.detach().float() for p in self.replicas[0].model.parameters()]
        norm = torch.sqrt(sum(b.pow(2).sum() for b in base)).clamp_min(1e-30)
        worst = torch.zeros(())
        for replica in self.replicas[1:]:
            diff = torch.sqrt(sum((p.detach().float() - b).pow(2).sum()
                                  for p, b in zip(replica.model.parameters(), base)))
            worst = torch.maximum(worst, (diff / norm).cpu())
        return float(worst)

    @torch.no_grad()
    def synchronise(self) -> float:
        """Replica 0's parameters broadcast to every replica over a reliable channel; its seconds (NCCL's
        ring broadcast of a TP rank's local parameters, every group side by side)."""
        params = list(self.replicas[0].model.parameters())
        for replica in self.replicas[1:]:
            for p, source in zip(replica.model.parameters(), params):
                p.copy_(source)
        local = sum((p[0] if i in self._sharded else p).numel() * p.element_size() for i, p in enumerate(params))
        return broadcast_time(self.networks[0], local)


def broadcast_time(network: LossyNetwork, message_bytes: int) -> float:
    """A loss-free ring broadcast of ``message_bytes`` over ``network``'s ranks: the all-gather's latency
    (R - 1 pipelined hops) and the whole message over the bus bandwidth (nccl-tests: busbw = algbw)."""
    spec = network.spec
    if spec.tp_size < 2 or message_bytes == 0:
        return 0.0
    nodes = spec.topology.nodes
    bottleneck = spec.link_inter if nodes > 1 else spec.link_intra
    packet = spec.payload_bytes
    wire = bottleneck.wire_bytes(message_bytes, -(-message_bytes // packet))
    latency = nccl.latency_s("all_gather", "ring", "Simple", spec.tp_size, nodes, spec.link_intra.hw,
                             spec.link_inter.hw)
    return latency + wire / spec.bus_bandwidth()


def _grad(p: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient (zeros when it got none: DDP sends its bucket slot all the same)."""
    return p.grad if p.grad is not None else torch.zeros_like(p)
