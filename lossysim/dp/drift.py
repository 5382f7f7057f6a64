"""How far data-parallel replicas have drifted apart, and what resynchronising them costs.

Drift is summed in one fixed order (each TP rank's squares of each stage's parameters, then those totals
TP rank by TP rank, stage by stage), which ``sim`` and ``dist`` both keep (``replicas.py``): the two
backends give the same bits on the same weights. A synchronisation is a loss-free ring broadcast.
"""
from __future__ import annotations

import torch

from ..net import LossyNetwork
from ..timing import nccl


def broadcast_time(network: LossyNetwork, message_bytes: int) -> float:
    """A loss-free ring broadcast of ``message_bytes`` over ``network``'s ranks: the all-gather's latency
    (R - 1 pipelined hops) and the whole message over the bus bandwidth (nccl-tests: busbw = algbw)."""
    spec = network.spec
    if spec.ranks < 2 or message_bytes == 0:
        return 0.0
    nodes = spec.topology.nodes
    bottleneck = spec.link_inter if nodes > 1 else spec.link_intra
    packet = spec.payload_bytes
    wire = bottleneck.wire_bytes(message_bytes, -(-message_bytes // packet))
    latency = nccl.latency_s("all_gather", "ring", "Simple", spec.ranks, nodes, spec.link_intra.hw,
                             spec.link_inter.hw)
    return latency + wire / spec.bus_bandwidth()


def _square_sums(pairs) -> torch.Tensor:
    """[sum of (p - base)^2, sum of base^2] over ``pairs``, in fp64: each parameter's two norms in fp32
    (``torch.dist`` reads both tensors once and keeps no difference), then all of them squared and
    summed at once. One definition for both backends keeps drift bitwise equal."""
    pairs = [(p.detach().float(), base.detach().float()) for p, base in pairs]
    if not pairs:
        return torch.zeros(2, dtype=torch.float64)
    norms = torch.stack([torch.stack([torch.dist(p, base) for p, base in pairs]),
                         torch.stack([base.norm() for _, base in pairs])])
    return norms.double().pow(2).sum(1)


def _summed(parts: list[list[torch.Tensor]]) -> torch.Tensor:
    """``_square_sums`` of each TP rank's shards of each stage (``parts[t][s]``) added up in one order,
    TP rank by TP rank, stage by stage: the order both backends sum in."""
    flat = [part for per_rank in parts for part in per_rank]
    total = flat[0]
    for part in flat[1:]:
        total = total + part
    return total


def _relative(sums: torch.Tensor) -> torch.Tensor:
    """||p_r - p_0|| / ||p_0|| from ``_square_sums``' totals."""
    return sums[0].sqrt() / sums[1].sqrt().clamp_min(1e-30)
