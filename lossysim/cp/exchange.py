"""How a context group's ranks get each other's keys and values, over the group's ``LossyNetwork``.

Every rank holds one block: its local tokens' keys and values for its TP rank's kv heads, flattened (keys
then values). Two ways, as the frameworks run them (``cp_mode``):

- ``ring`` (Megatron's ``p2p``): cp - 1 rounds; in round s every rank i sends the block it got in the round
  before (its own in round 1) to rank i + 1, a point-to-point send (``LossyNetwork`` phase ``send``), so
  the block of rank j reaches rank i after (i - j) mod cp hops. A hop forwards what arrived: a packet lost
  on the way is missing at every rank further on. The backward runs the hops in reverse: rank i + 1 sends
  back to i the gradient of the block it got from i (its own part plus what came back from further on),
  and i adds it to its own (Megatron passes dK/dV around the ring the same way; a lost packet of it loses
  the gradient of every rank further on).
- ``allgather`` (Llama 3's): the blocks all-gathered in one collective (NCCL's all-gather: ring, tree, or
  what ``algorithm`` says), their gradients reduce-scattered, each origin's block padded to whole packets
  so that the chunk a rank receives is its own block's gradient.

Each exchange returns, per receiver and origin, the block as it arrived and the packets it missed (for
``recovery: mask``: ``LossyNetwork.with_gaps``), and every round's seconds (its slowest send: the ranks
send side by side over links of their own). A gradient that came back is not multiplied by what the
forward lost: as TP's sites, the backward's traffic loses on its own.

Both run here over every rank's block at once (``sim``); a ``dist`` process gathers every rank's block (and
in the backward every rank's gradients) over a reliable channel, runs the same exchange and keeps its own
receiver's: the draws, counters and clock of every process's copy of the network stay ``sim``'s, bit for bit,
as a TP all-reduce under loss does (``lossysim.tp.groups.DistGroup``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .axis import CP_MODES as MODES   # the declaration names them; an Exchange built by hand checks them too
from ..net import LossyNetwork


def _timed(network: LossyNetwork, calls) -> tuple[list, list[float]]:
    """Run ``calls`` (thunks: one round's sends) in order; what they return and the slowest one's
    [comm_s, comm_s_ideal_nic]."""
    slowest, out = [0.0, 0.0], []
    for call in calls:
        before = network.clock()
        out.append(call())
        after = network.clock()
        slowest = [max(slowest[0], after["comm_s"] - before["comm_s"]),
                   max(slowest[1], after["comm_s_ideal_nic"] - before["comm_s_ideal_nic"])]
    return out, slowest


def _hop(i: int, step: int, cp: int) -> tuple[int, int, int]:
    """Round ``step``'s send of rank ``i``: (src, dst, the block's origin)."""
    return i, (i + 1) % cp, (i - step + 1) % cp


def ring_forward(network: LossyNetwork, site: str, blocks: torch.Tensor):
    """``blocks`` [cp, n] -> (held [cp receivers, cp origins, n], missed [cp, cp, packets] bool or None when
    nothing can be missing, rounds)."""
    cp, n = blocks.shape
    held = blocks.new_zeros(cp, cp, n)
    held[range(cp), range(cp)] = blocks
    _, packets = network.packets(n, blocks.dtype)
    missed = None if network.exact("fwd", site) else \
        torch.zeros(cp, cp, packets, dtype=torch.bool, device=blocks.device)
    rounds = []
    for step in range(1, cp):
        hops = [_hop(i, step, cp) for i in range(cp)]
        arrived, seconds = _timed(network, [
            lambda src=src, dst=dst, origin=origin: network.with_gaps(site, "fwd", "send", held[src, origin],
                                                                      pair=(src, dst))
            for src, dst, origin in hops])
        for (src, dst, origin), (block, gaps) in zip(hops, arrived):
            held[dst, origin] = block
            if missed is not None:   # what the sender missed is missing here too
                missed[dst, origin] = missed[src, origin] if gaps is None else missed[src, origin] | gaps[0, 0]
        rounds.append(seconds)
    return held, missed, rounds


def ring_backward(network: LossyNetwork, site: str, grads: torch.Tensor):
    """``grads`` [cp receivers, cp origins, n] (of what each receiver held) -> ([cp, n]: each origin's block's
    gradient, rounds): the hops in reverse, each sending back what its receiver accumulated."""
    cp = grads.shape[0]
    acc = grads.clone()
    rounds = []
    for step in range(cp - 1, 0, -1):
        hops = [_hop(i, step, cp) for i in range(cp)]
        back, seconds = _timed(network, [
            lambda src=src, dst=dst, origin=origin: network.send(site, "bwd", acc[dst, origin], dst, src)
            for src, dst, origin in hops])
        for (src, _, origin), grad in zip(hops, back):
            acc[src, origin] += grad
        rounds.append(seconds)
    return acc[range(cp), range(cp)], rounds


def gather_forward(network: LossyNetwork, site: str, blocks: torch.Tensor):
    """``blocks`` [cp, n] all-gathered -> (held [cp, cp, n], missed [cp, cp, packets] or None, [seconds])."""
    cp = blocks.shape[0]
    (result,), seconds = _timed(network, [lambda: network.with_gaps(site, "fwd", "all_gather", blocks,
                                                                    receivers=range(cp))])
    held, missed = result
    return held.clone() if held.stride(0) == 0 else held, missed, [seconds]


def gather_backward(network: LossyNetwork, site: str, grads: torch.Tensor):
    """``grads`` [cp receivers, cp origins, n] reduce-scattered: ([cp, n] each origin's summed gradient,
    [seconds]). Each origin's part is padded to whole packets, so the chunk rank j receives is block j's."""
    cp, _, n = grads.shape
    per_packet, packets = network.packets(n, grads.dtype)
    width = per_packet * packets
    contributions = grads.new_zeros(cp, cp, width)
    contributions[..., :n] = grads
    (out,), seconds = _timed(network, [lambda: network.reduce_scatter(site, "bwd", contributions.view(cp, -1),
                                                                      range(cp))])
    mine = out.view(cp, cp, width)[range(cp), range(cp), :n]
    return mine, [seconds]


FORWARD = {"ring": ring_forward, "allgather": gather_forward}
BACKWARD = {"ring": ring_backward, "allgather": gather_backward}


class Exchange:
    """One context group's exchange: its mode, its network (the active one: training's or evaluation's,
    ``network``), and on ``dist`` its process group and this process's rank in it (``own``; None: sim,
    every rank here). ``rounds``: every exchange's rounds' seconds since the last take, per direction (none
    kept unless ``record``: evaluation's are never timed)."""

    def __init__(self, mode: str, network: LossyNetwork, group=None, own: Optional[int] = None, record: bool = True):
        if mode not in MODES:
            raise ValueError(f"cp_mode={mode!r} must be one of {', '.join(MODES)}")
        self.mode, self.network, self.group, self.own, self.record = mode, network, group, own, record
        self.rounds: dict[str, list] = {"fwd": [], "bwd": []}

    def _every(self, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's ``mine`` ([1, ...] here), stacked in rank order (reliable)."""
        if self.group is None:
            return mine
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(every, mine.contiguous(), group=self.group)
        return torch.cat(every)

    def _mine(self, every: torch.Tensor) -> torch.Tensor:
        return every if self.own is None else every[self.own:self.own + 1]

    def forward(self, site: str, blocks: torch.Tensor):
        """This process's receivers' (held, missed) of ``blocks`` ([local ranks, n])."""
        held, missed, rounds = FORWARD[self.mode](self.network, site, self._every(blocks))
        if self.record:
            self.rounds["fwd"].append(rounds)
        return self._mine(held), None if missed is None else self._mine(missed)

    def backward(self, site: str, grads: torch.Tensor) -> torch.Tensor:
        grad, rounds = BACKWARD[self.mode](self.network, site, self._every(grads))
        if self.record:
            self.rounds["bwd"].append(rounds)
        return self._mine(grad)

    def take_rounds(self, direction: str) -> list:
        taken, self.rounds[direction] = self.rounds[direction], []
        return taken


class _Exchanged(torch.autograd.Function):
    """forward: the blocks as every local receiver holds them; backward: their gradients sent back."""

    @staticmethod
    def forward(ctx, blocks, exchange, site, gaps):
        ctx.exchange, ctx.site = exchange, site
        held, missed = exchange.forward(site, blocks.detach())
        gaps.append(missed)
        return held

    @staticmethod
    def backward(ctx, grad):
        return ctx.exchange.backward(ctx.site, grad.contiguous()), None, None, None


def exchanged(exchange: Exchange, site: str, blocks: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``blocks`` ([local ranks, n], differentiable) exchanged at call site ``site``: (held [local ranks, cp, n],
    missed [local ranks, cp, packets] bool or None)."""
    gaps: list = []
    held = _Exchanged.apply(blocks, exchange, site, gaps)
    return held, gaps[0]
