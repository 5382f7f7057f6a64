"""Delivery: from which packets arrived to the tensors each receiver holds.

``lossysim.net.receivers.combine`` says, per packet, with which weight each rank's contribution
reaches each receiver (a ``Delivery``); this module applies it to the ranks' tensors. A message
of ``n`` elements is cut into packets of ``per_packet`` elements, the last one possibly shorter;
tensors are never padded: the whole packets and the short one are two views (``packets``).

Ring and tree all-reduces: every packet holds the plain sum unless some contribution missed it, so
the sum is computed once and only the packets that lost a contribution are summed again with
their weights (on a GPU every packet's weighted sum is computed and selected instead, so there is
no host sync); each receiver then holds that, times its gain, and nothing where it has a hole. A
lost packet contributes nothing, even if it held inf or NaN (0 * inf would be NaN), and a hole is
zero.

Policies that act on every send (``stale``, ``error_feedback``: ``lossysim.net.recovery``) run the
schedule send by send instead (``send_by_send``): each send carries what its sender holds of its
packets and the policy says what its receiver takes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from .algorithms import Schedule
from .receivers import Delivery


def packets(t: torch.Tensor, per_packet: int) -> list[tuple[torch.Tensor, slice]]:
    """Views of ``t`` ([..., n]) as ``[..., packets, length]``: the whole packets, then the short last
    one if there is one, each with the packet numbers it covers."""
    n = t.shape[-1]
    whole = n // per_packet
    views = [(t[..., :whole * per_packet].unflatten(-1, (whole, per_packet)), slice(0, whole))] if whole else []
    if n > whole * per_packet:
        views.append((t[..., whole * per_packet:].unsqueeze(-2), slice(whole, whole + 1)))
    return views


def _weighted(parts: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_j weight[j] * parts[j] over the ranks (dim 0); a lost part (weight False or 0) counts as 0,
    and a bool weight (delivered or not) multiplies by nothing."""
    return _term(parts, weight).sum(0)


def _term(parts: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``parts`` ([..., packets, length]) as their weights ([..., packets]) leave them."""
    weight = weight.unsqueeze(-1)
    if weight.dtype == torch.bool:
        return torch.where(weight, parts, 0)
    return torch.where(weight > 0, parts, 0) * weight.to(parts.dtype)


def all_reduce(x: torch.Tensor, delivery: Delivery, receivers: Sequence[int], per_packet: int,
               rescale: bool, watch: Callable[[torch.Tensor], None], dense: Optional[bool] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What each receiver holds after an all-reduce of ``x`` ([ranks, n]): ``[len(receivers), n]``,
    written into ``out`` when given (which may be ``x`` itself: in place, as NCCL runs DDP's buckets).

    ``watch`` sees what was delivered before any hole is zeroed (the final packets of a ring or tree,
    every receiver's sum of a direct exchange)."""
    receivers = list(receivers)
    dense = x.device.type == "cuda" if dense is None else dense
    if delivery.weights is not None:
        held = direct_sum(x, delivery.weights[receivers], per_packet, dense)
        watch(held)
        return into(out, held)
    n = x.shape[1]
    given = out is not None
    if not given:
        out = torch.empty(len(receivers), n, dtype=x.dtype, device=x.device)
    # The final packets: the plain sum, summed again where a contribution is missing; rescale weighs all.
    # (``x`` is read to the end, so a given ``out`` is written only once ``final`` is whole.)
    final = torch.empty(n, dtype=x.dtype, device=x.device) if rescale or given else out[0]
    if rescale or dense:
        for (parts, span), (total, _) in zip(packets(x, per_packet), packets(final, per_packet)):
            weighted = _weighted(parts, delivery.coef[:, span])
            if rescale:
                total.copy_(weighted)
            else:
                torch.sum(parts, 0, out=total)
                total.copy_(torch.where(delivery.partial[span].unsqueeze(-1), weighted, total))
    else:
        torch.sum(x, 0, out=final)
        _patch(x, final, delivery, per_packet)
    every = receivers == list(range(len(delivery.holes)))
    holes = delivery.holes if every else delivery.holes[receivers]
    if rescale:
        gain = delivery.gain[receivers].to(x.dtype)
        for (held, span), (total, _) in zip(packets(out, per_packet), packets(final, per_packet)):
            torch.mul(total, gain[:, span].unsqueeze(-1), out=held)
    elif given:
        out.copy_(final.expand(len(receivers), n))
    elif dense:
        out[1:].copy_(final.expand(len(receivers) - 1, n))
    else:   # each receiver's copy has its holes zeroed while it is still in cache (a few MB a receiver)
        for row in range(1, len(receivers)):
            out[row].copy_(final)
            zero_holes(out[row], holes[row], per_packet, dense)
        holes = holes[:1]
    watch(final)  # receivers hold it or zeros: a cheaper check than all of them
    zero_holes(out[:len(holes)], holes, per_packet, dense)
    return out


def into(out: Optional[torch.Tensor], held: torch.Tensor) -> torch.Tensor:
    """``held`` written into ``out`` (a receivers' tensor given by the caller), or ``held`` itself."""
    if out is None:
        return held
    return out.copy_(held)


def _patch(x: torch.Tensor, final: torch.Tensor, delivery: Delivery, per_packet: int) -> None:
    """Sum again, with their weights, the packets some contribution missed (a list of them: few)."""
    patch = np.flatnonzero(delivery.partial.numpy())
    if not len(patch):
        return
    whole = x.shape[1] // per_packet
    if patch[-1] == whole:  # the short last packet (sorted: it can only be last)
        start = whole * per_packet
        final[start:] = _weighted(x[:, None, start:], delivery.coef[:, whole:])[0]
        patch = patch[:-1]
    if len(patch):
        # Gathered as bits in numpy, a few times cheaper than torch's index on dim 1 of the [ranks, packets,
        # length] view (index_select would first copy a non-contiguous ``parts``), rank by rank into one
        # contiguous [ranks, patched, length] (numpy's gather on dim 1 lays it out packet-major, and a sum
        # over dim 0 of that adds in another order: it would be copied again).
        bits = _bits(x.detach())
        parts = np.empty((x.shape[0], len(patch), per_packet), dtype=bits.dtype)
        for rank, row in enumerate(bits):
            np.take(row[:whole * per_packet].reshape(whole, per_packet), patch, axis=0, out=parts[rank])
        coef = delivery.coef
        if coef.dtype == torch.bool:  # ``parts`` is a copy: zero what was lost in it, as _weighted would
            rank, packet = np.nonzero(~coef.numpy()[:, patch])
            parts[rank, packet] = 0    # (zero bits: +0.0, as masked_fill_ writes)
            patched = torch.from_numpy(parts).view(x.dtype).sum(0)
        else:
            patched = _weighted(torch.from_numpy(parts).view(x.dtype), coef[:, torch.from_numpy(patch)])
        _bits(final)[:whole * per_packet].reshape(whole, per_packet)[patch] = _bits(patched)


def _bits(t: torch.Tensor) -> np.ndarray:
    """``t`` (on the CPU) as integers of its width in numpy (numpy has no bfloat16)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).numpy()


def direct_sum(x: torch.Tensor, weights: torch.Tensor, per_packet: int, dense: bool = True) -> torch.Tensor:
    """The direct exchange: receiver i adds every sender's packets with ``weights[i, j, packet]``, in
    sender order. Not ``dense`` and bool weights: the plain sum is added once and copied to every
    receiver, and only the packets a receiver missed some sender's of are added again (few)."""
    if not dense and weights.dtype == torch.bool:
        return _direct_patched(x, weights, per_packet)
    out = torch.empty(weights.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    for (parts, span), (held, _) in zip(packets(x, per_packet), packets(out, per_packet)):
        w = weights[..., span]                                     # [receivers, senders, packets]
        total = _term(parts[0], w[:, 0])
        for sender in range(1, x.shape[0]):
            total = total + _term(parts[sender], w[:, sender])
        held.copy_(total)
    return out


def _direct_patched(x: torch.Tensor, kept: torch.Tensor, per_packet: int) -> torch.Tensor:
    """``direct_sum`` with bool weights, the plain sum added once (see there)."""
    total = x[0].clone()
    for sender in range(1, x.shape[0]):
        total += x[sender]                    # the very additions ``direct_sum`` makes, in its order
    out = torch.empty(kept.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    out.copy_(total.expand_as(out))
    receiver, packet = np.nonzero(~kept.numpy().all(1))
    for (parts, span), (held, _) in zip(packets(x, per_packet), packets(out, per_packet)):
        inside = (packet >= span.start) & (packet < span.stop)
        if not inside.any():
            continue
        r, p = torch.from_numpy(receiver[inside]), torch.from_numpy(packet[inside])
        w = kept[r, :, p].unsqueeze(-1)                            # [missed, senders, 1]
        p = p - span.start
        again = torch.where(w[:, 0], parts[0][p], 0)
        for sender in range(1, x.shape[0]):
            again = again + torch.where(w[:, sender], parts[sender][p], 0)
        held[r, p] = again
    return out


def all_gather(shards: torch.Tensor, delivery: Delivery, receivers: Sequence[int], per_packet: int) -> torch.Tensor:
    """Every rank's shard ([ranks, n]) as each receiver sees it: ``[len(receivers), ranks, n]``, lost
    packets as zeros (a gathered shard is not a sum: nothing to rescale)."""
    kept = delivery.weights[list(receivers)]                    # [receivers, senders, packets]
    out = shards.unsqueeze(0).expand(len(receivers), *shards.shape).clone()
    zero_holes(out, ~kept, per_packet, shards.device.type == "cuda")
    return out


def zero_holes(out: torch.Tensor, holes: torch.Tensor, per_packet: int, dense: bool) -> None:
    """Zero, in place, the packets of ``out`` ([..., n]) where ``holes`` ([..., packets]) is True."""
    if dense or out.requires_grad or not out.is_contiguous():  # (no host sync; autograd sees the zeros)
        for held, span in packets(out, per_packet):
            held.masked_fill_(holes[..., span].unsqueeze(-1), 0)
        return
    index = np.nonzero(holes.numpy())
    if not len(index[0]):
        return
    # Few holes: zero their bits in numpy (any float's zero bits are +0.0; numpy has no bfloat16).
    bits = _bits(out)
    n = out.shape[-1]
    whole = n // per_packet
    inside = index[-1] < whole
    if not inside.all():  # the short last packet
        bits[(*(i[~inside] for i in index[:-1]), slice(whole * per_packet, n))] = 0
        index = tuple(i[inside] for i in index)
    bits[..., :whole * per_packet].reshape(*bits.shape[:-1], whole, per_packet)[index] = 0


# -- send by send --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Round:
    """Sends of one step that reach distinct receivers, run together."""
    sends: torch.Tensor     # [k] send numbers
    src: torch.Tensor       # [k, 1]
    dst: torch.Tensor       # [k, 1]
    packets: torch.Tensor   # [k, width] packet numbers; padding points at the spare packet
    valid: torch.Tensor     # [k, width] False on padding
    adds: bool              # the receiver adds what it takes (reduce, exchange) or holds it (all-gather, broadcast)


# What a receiver does with a send of each phase; an exchange sends the sender's own message.
_ADDS = {"reduce_scatter": True, "reduce": True, "exchange": True, "all_gather": False, "broadcast": False}


@functools.lru_cache(maxsize=256)
def rounds(sched: Schedule, device: torch.device) -> tuple[Round, ...]:
    """The schedule's sends grouped in rounds: step by step, and within a step as many rounds as a
    rank receives sends (a tree parent hears from two children; a direct exchange from every peer),
    in schedule order."""
    out = []
    for step in range(sched.steps):
        queue = [i for i, s in enumerate(sched.sends) if s.step == step and s.packets]
        while queue:
            taken, seen = [], set()
            for i in queue:
                if sched.sends[i].dst not in seen:
                    taken.append(i)
                    seen.add(sched.sends[i].dst)
            queue = [i for i in queue if i not in taken]
            hops = [sched.sends[i] for i in taken]
            width = max(s.packets for s in hops)
            slot = torch.arange(width)
            first = torch.tensor([s.first for s in hops]).unsqueeze(1)
            count = torch.tensor([s.packets for s in hops]).unsqueeze(1)
            valid = slot < count
            column = lambda values: torch.tensor(values, device=device).unsqueeze(1)  # noqa: E731
            out.append(Round(torch.tensor(taken, device=device), column([s.src for s in hops]),
                             column([s.dst for s in hops]),
                             torch.where(valid, first + slot, sched.n_packets).to(device), valid.to(device),
                             _ADDS[hops[0].phase]))
    return tuple(out)


def send_by_send(x: torch.Tensor, sched: Schedule, lost: torch.Tensor, per_packet: int,
                 arrive: Callable[[Round, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Run the all-reduce ``sched`` on ``x`` ([ranks, n]) round by round: what every rank holds at
    the end, ``[ranks, n]``.

    A send carries what its sender holds of its packets (an exchange: the sender's own message);
    ``arrive(round, payload, lost)`` gets what the round's sends carry (``[k, width, per_packet]``) and
    their lost packets (``[k, width]``, False on padding) and returns what their receivers take
    (zero on padding). ``lost``: ``[sends, max_packets]``, as ``combine`` takes it. Messages are held
    padded to whole packets plus one spare packet that padding reads and writes (zeros).
    """
    ranks, n = x.shape
    held = x.new_zeros(ranks, (sched.n_packets + 1) * per_packet)
    held[:, :n] = x
    held = held.view(ranks, sched.n_packets + 1, per_packet)
    own = held.clone() if sched.algorithm == "direct" else held
    for hop in rounds(sched, x.device):
        payload = own[hop.src, hop.packets]
        lost_here = lost[hop.sends, :hop.packets.shape[1]] & hop.valid
        taken = arrive(hop, payload, lost_here)
        if hop.adds:
            held[hop.dst, hop.packets] += taken
        else:
            held[hop.dst, hop.packets] = taken
    return held.view(ranks, -1)[:, :n]
