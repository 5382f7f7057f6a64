"""What each receiver holds when packets of a schedule's sends (``algorithms``) are lost.

What a loss means (``combine``): a lost packet of a reduce-scatter or reduce send
takes every contribution it carried with it (the receiver's own contribution goes
on alone); a lost packet of an all-gather or broadcast send is a hole that every
rank downstream inherits (a rank forwards what it has). Through a switch (NVLS) a packet lost on
the way up takes that rank's contribution from every receiver, the rank's own included (its sum is
the switch's); one lost on the way down is a hole at that one receiver; between nodes, as the tree.
``combine`` follows the lost packets along every path; ``path_weights`` multiplies per-send factors along
the same paths (for ``rescale``, 1 / P(delivery) at every hop: dividing what
arrived by the probability that it arrives is what keeps the estimate of the sum
unbiased), so a delivered path carries its product and a lost one 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .algorithms import IN_SWITCH, Schedule, depth


@dataclass
class Delivery:
    """What each receiver holds, per packet, as weights of the ranks' contributions.

    All-reduce by ring or tree: the final reduced packet p holds ``sum_j coef[j, p] x_j`` and
    receiver i holds ``gain[i, p]`` times it. Direct all-reduce and all-gathers: receiver i holds
    ``weights[i, j, p]`` times rank j's packet p. A send: ``weights[0, 0, p]``, its one receiver
    and one sender. Weights are bool (delivered or not, weight 1) or
    floats (``rescale``); 0 or False is lost. ``partial[p]``: some contribution missed packet p;
    ``holes[i, p]``: receiver i got nothing of it.
    """
    coef: Optional[torch.Tensor] = None      # [R contributors, packets]
    gain: Optional[torch.Tensor] = None      # [R receivers, packets]
    partial: Optional[torch.Tensor] = None   # [packets]
    holes: Optional[torch.Tensor] = None     # [R receivers, packets]
    weights: Optional[torch.Tensor] = None   # [R receivers, R senders, packets]


def _prefix(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Along hops ``dim``: up to each hop, whether any was lost (bool) or the product of the factors."""
    return values.cummax(dim).values if values.dtype == torch.bool else values.cumprod(dim)


def _suffix(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Along hops ``dim``: from each hop to the last, whether any was lost or the product of the factors."""
    return _prefix(values.flip(dim), dim).flip(dim)


def _paths(sched: Schedule, values: torch.Tensor) -> Delivery:
    """Follow per-send values (``[sends, max_packets]``) along every path of the schedule: bool values
    (lost) are or-ed, float values (factors) multiplied. Returns the Delivery's coef/gain/weights in the
    values' kind: True (or the product) where a path is lost (or carries that product)."""
    if sched.collective == "send":
        return Delivery(weights=values.unsqueeze(0))            # [receiver, sender, packet]
    R = sched.ranks
    idx = sched.tensors(values.device)
    lost = values.dtype == torch.bool
    neutral = torch.zeros if lost else torch.ones
    key = (sched.algorithm, sched.collective)
    if key in (("ring", "all_reduce"), ("ring", "reduce_scatter")):
        flat = values.reshape(-1)
        edge = neutral(sched.n_packets, 1, dtype=values.dtype, device=values.device)
        # Position k on a chunk's path (rank c+1+k) reaches the owner iff hops k..R-2 deliver;
        # the rank d hops after the owner holds the chunk iff all-gather hops 0..d-1 deliver.
        tail = torch.cat([_suffix(flat[idx["rs"]], 1), edge], 1)          # [packet, position]
        coef = tail.gather(1, idx["contributor_pos"]).T
        if sched.collective == "reduce_scatter":
            # the owner holds its chunk's sum as it arrived (nothing is lost after it); the others nothing
            own = idx["owner"].reshape(R, sched.n_packets)
            return Delivery(coef=coef, gain=~own if lost else own.to(values.dtype))
        head = torch.cat([edge, _prefix(flat[idx["ag"]], 1)], 1)
        return Delivery(coef=coef, gain=head.gather(1, idx["receiver_pos"]).T)
    v = torch.cat([values, neutral(1, values.shape[1], dtype=values.dtype, device=values.device)])
    if key == ("tree", "all_reduce"):
        up, down = v[idx["up"]], v[idx["down"]]                 # [rank, packet]: edge to / from parent
        coef, gain = up.clone(), down.clone()
        join = torch.logical_or if lost else torch.mul
        for level in range(1, depth(R - 1) + 1):               # parents before children
            ranks = [r for r in range(R) if depth(r) == level]
            parents = [(r - 1) // 2 for r in ranks]
            coef[ranks] = join(up[ranks], coef[parents])
            gain[ranks] = join(down[ranks], gain[parents])
        return Delivery(coef=coef[:, :sched.n_packets], gain=gain[:, :sched.n_packets])
    if sched.algorithm in IN_SWITCH:
        join = torch.logical_or if lost else torch.mul
        node_up, node_down = v[idx["node_up"]], v[idx["node_down"]]        # [node, packet]: to / from parent
        for level in range(1, depth(len(idx["node_up"]) - 1) + 1):          # parents before children
            nodes = [k for k in range(len(idx["node_up"])) if depth(k) == level]
            parents = [(k - 1) // 2 for k in nodes]
            node_up[nodes] = join(node_up[nodes], node_up[parents])
            node_down[nodes] = join(node_down[nodes], node_down[parents])
        coef = join(v[idx["up"]], node_up[idx["node"]])
        gain = join(v[idx["down"]], node_down[idx["node"]])
        return Delivery(coef=coef[:, :sched.n_packets], gain=gain[:, :sched.n_packets])
    if key == ("ring", "all_gather"):
        hops = v[idx["hops"]]                                   # [shard, hop, packet]
        head = torch.cat([neutral(R, 1, v.shape[1], dtype=v.dtype, device=v.device), _prefix(hops, 1)], 1)
        # receiver i holds shard j iff the hops j -> ... -> i deliver
        return Delivery(weights=head[torch.arange(R, device=v.device)[None, :], idx["receiver_pos"]])
    return Delivery(weights=v[idx["pair"]])                     # direct: [receiver, sender, packet]


def path_weights(sched: Schedule, factor: torch.Tensor, dtype: torch.dtype) -> Delivery:
    """The weights every path carries when nothing is lost: the product of its sends' factors
    (``factor`` per send, as ``dtype``)."""
    values = factor.to(dtype).unsqueeze(1).expand(-1, max(sched.max_packets, 1)).contiguous()
    return _paths(sched, values[:, :sched.max_packets])


def combine(sched: Schedule, lost: torch.Tensor, weights: Optional[Delivery] = None) -> Delivery:
    """What every receiver holds, given which packets of each send were lost (``[sends, max_packets]``
    bool; the slots past a send's packets are never read); ``weights``: what each path carries when delivered (``path_weights``), None
    for weight 1 (then the Delivery's weights are bool: delivered or not)."""
    missed = _paths(sched, lost)
    if missed.weights is not None:
        kept = ~missed.weights
        return Delivery(weights=kept if weights is None else torch.where(kept, weights.weights, 0))
    kept_coef, kept_gain = ~missed.coef, ~missed.gain
    return Delivery(coef=kept_coef if weights is None else torch.where(kept_coef, weights.coef, 0),
                    gain=kept_gain if weights is None else torch.where(kept_gain, weights.gain, 0),
                    partial=missed.coef.any(0), holes=missed.gain)
