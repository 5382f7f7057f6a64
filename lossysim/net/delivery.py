"""Delivery: from which packets arrived to the tensors each receiver holds.

``lossysim.net.algorithms.combine`` says, per packet, with which weight each rank's contribution
reaches each receiver (a ``Delivery``); this module applies it to the ranks' tensors. A message
of ``n`` elements is cut into packets of ``per_packet`` elements, the last one possibly shorter;
the tensors are never padded: the whole packets and the short one are two views (``segments``).

Ring and tree all-reduces: every packet holds the plain sum unless some contribution missed it, so
the sum is computed once and only the packets that lost a contribution are summed again with
their weights (on a GPU every packet's weighted sum is computed and selected instead, so there is
no host sync); each receiver then holds that, times its gain (0: a hole). A lost packet
contributes nothing, even if it held inf or NaN (0 * inf would be NaN), and a hole is zero.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

import torch

from .algorithms import Delivery


def segments(t: torch.Tensor, per_packet: int) -> Iterator[tuple[torch.Tensor, int, int]]:
    """Views of ``t`` ([..., n]) as ``[..., packets, length]``: the whole packets, then the short last
    one (if any), with the range of packet numbers each covers."""
    n = t.shape[-1]
    whole = n // per_packet
    if whole:
        yield t[..., :whole * per_packet].unflatten(-1, (whole, per_packet)), 0, whole
    if n > whole * per_packet:
        yield t[..., whole * per_packet:].unsqueeze(-2), whole, whole + 1


def _weighted(parts: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_j weight[j] * parts[j] over the ranks (dim 0), a lost (weight 0) part counting as 0."""
    weight = weight.unsqueeze(-1)
    return (torch.where(weight > 0, parts, 0) * weight).sum(0)


def all_reduce(x: torch.Tensor, delivery: Delivery, receivers: Sequence[int], per_packet: int,
               rescale: bool, watch: Callable[[torch.Tensor], None], dense: Optional[bool] = None) -> torch.Tensor:
    """What each receiver holds after an all-reduce of ``x`` ([ranks, n]): ``[len(receivers), n]``.

    ``watch`` sees what was delivered before any hole is zeroed (the final packets of a ring or tree,
    every receiver's sum of a direct exchange)."""
    if delivery.weights is not None:
        out = direct_sum(x, delivery.weights[list(receivers)], per_packet)
        watch(out)
        return out
    dense = x.device.type == "cuda" if dense is None else dense
    n = x.shape[1]
    coef = delivery.coef.to(x.dtype)
    gain = delivery.gain[list(receivers)].to(x.dtype)
    out = torch.empty(len(receivers), n, dtype=x.dtype, device=x.device)
    # The final packets: the plain sum, patched where a contribution is missing; rescale weighs all.
    final = out[0] if not rescale else torch.empty(n, dtype=x.dtype, device=x.device)
    if rescale or dense:
        for (parts, start, stop), (total, _, _) in zip(segments(x, per_packet), segments(final, per_packet)):
            weighted = _weighted(parts, coef[:, start:stop])
            if rescale:
                total.copy_(weighted)
            else:
                torch.sum(parts, 0, out=total)
                total.copy_(torch.where((coef[:, start:stop] == 0).any(0).unsqueeze(-1), weighted, total))
    else:
        torch.sum(x, 0, out=final)
        patch = (coef == 0).any(0).nonzero().squeeze(1)
        if patch.numel():
            for (parts, start, stop), (total, _, _) in zip(segments(x, per_packet), segments(final, per_packet)):
                inside = patch[(patch >= start) & (patch < stop)] - start if start else patch[patch < stop]
                if inside.numel():
                    total[inside] = _weighted(parts[:, inside], coef[:, start:stop][:, inside])
    if rescale:
        for (held, start, stop), (total, _, _) in zip(segments(out, per_packet), segments(final, per_packet)):
            torch.mul(total, gain[:, start:stop].unsqueeze(-1), out=held)
    elif len(receivers) > 1:
        out[1:].copy_(final.expand(len(receivers) - 1, n))
    watch(final)  # receivers hold it or zeros: a cheaper check than all of them
    zero_holes(out, gain == 0, per_packet, dense)
    return out


def direct_sum(x: torch.Tensor, weights: torch.Tensor, per_packet: int) -> torch.Tensor:
    """The direct exchange: receiver i adds every sender's packets with ``weights[i, j, packet]``."""
    out = torch.empty(weights.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    weights = weights.to(x.dtype)
    for (parts, start, stop), (held, _, _) in zip(segments(x, per_packet), segments(out, per_packet)):
        w = weights[..., start:stop].unsqueeze(-1)               # [receivers, senders, packets, 1]
        total = torch.where(w[:, 0] > 0, parts[0], 0) * w[:, 0]
        for sender in range(1, x.shape[0]):
            total = total + torch.where(w[:, sender] > 0, parts[sender], 0) * w[:, sender]
        held.copy_(total)
    return out


def all_gather(shards: torch.Tensor, delivery: Delivery, receivers: Sequence[int], per_packet: int) -> torch.Tensor:
    """Every rank's shard ([ranks, n]) as each receiver sees it: ``[len(receivers), ranks, n]``, lost
    packets as zeros (a gathered shard is not a sum: nothing to rescale)."""
    keep = delivery.weights[list(receivers)]                    # [receivers, senders, packets]
    out = shards.unsqueeze(0).expand(len(receivers), *shards.shape).clone()
    zero_holes(out, keep == 0, per_packet, shards.device.type == "cuda")
    return out


def zero_holes(out: torch.Tensor, holes: torch.Tensor, per_packet: int, dense: bool) -> None:
    """Zero, in place, the packets of ``out`` ([..., n]) where ``holes`` ([..., packets]) is True."""
    for held, start, stop in segments(out, per_packet):
        where = holes[..., start:stop]
        if dense:
            held.masked_fill_(where.unsqueeze(-1), 0)
        else:
            index = where.nonzero(as_tuple=True)
            if index[0].numel():
                held[index] = 0
