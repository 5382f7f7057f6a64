"""What a receiver holds when it also learns which packets it missed: a send's or an all-gather's
delivery, with its gaps.

Context parallelism's keys and values travel by point-to-point sends (the ring) or an all-gather;
under ``recovery: mask`` the receiver knows which of a block's packets did not arrive (a transport
numbers its packets) and leaves the keys they carried out of attention (``lossysim.cp``). The tensors
are the ones ``LossyNetwork.send`` and ``LossyNetwork.all_gather`` return (the policy's holes); the gaps
come from the same ``Delivery``, drawn once by the network (``LossyNetwork.with_gaps``). Only policies
that keep nothing between calls act here (``recovery.KV_POLICIES``: ``zero``, ``mask``).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import delivery as deliver
from .receivers import Delivery


def held(network, site: str, direction: str, collective: str, message: torch.Tensor, delivery: Optional[Delivery],
         receivers: Sequence[int]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(what the receivers hold, the packets each missed of each sender: ``[receivers, senders, packets]``
    bool, None when every packet arrived) of a ``send`` of ``message`` (any shape; one receiver, one
    sender) or an ``all_gather`` of ``message`` ([ranks, ...], held as ``[len(receivers), ranks, ...]``)."""
    policy = network.recovery.on(direction)

    def watch(seen: torch.Tensor) -> None:
        network.watch(site, direction, seen)
    if collective == "send":
        if delivery is None:
            watch(message)
            return message, None
        per_packet, _ = network.packets(message.numel(), message.dtype)
        out = policy.send(delivery, message.reshape(-1), per_packet, watch=watch, memory=None, update=True)
        return out.view(message.shape), _missed(delivery.weights)
    if collective != "all_gather":
        raise ValueError(f"collective={collective!r}: a receiver's gaps are a send's or an all-gather's")
    if delivery is None:
        return message.unsqueeze(0).expand(len(receivers), *message.shape), None
    per_packet, _ = network.packets(message[0].numel(), message.dtype)
    out = deliver.all_gather(message.reshape(message.shape[0], -1), delivery, receivers, per_packet)
    watch(out)
    return out.view(len(receivers), *message.shape), _missed(delivery.weights[list(receivers)])


def _missed(weights: torch.Tensor) -> torch.Tensor:
    """Where a Delivery's weights (bool, or ``rescale``'s factors) deliver nothing."""
    return ~weights if weights.dtype == torch.bool else weights == 0
