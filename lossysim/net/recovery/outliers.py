"""``outliers``, ``outliers+hadamard``: the largest elements of each contribution over a reliable side path.

Every sender takes the ``outlier_fraction`` of its own contribution's elements of largest magnitude
out of the message (zeros travel in their place) and sends them as (index, value) pairs by a
reliable all-gather on a side path; the rest goes under ``zero`` (or ``hadamard``), and every
receiver adds every rank's pairs to what arrived. The side path is real traffic: the network charges
it as a retransmitted all-gather (``side_bytes``). It rides an all-reduce, so it does not act on a
point-to-point send.
"""
from __future__ import annotations

import math

import torch

from .. import delivery as deliver
from .base import Policy
from .hadamard import Hadamard

DEFAULT_OUTLIER_FRACTION = 1e-3
INDEX_BYTES = 4                # an outlier's index on the side path: int32


def check_fraction(fraction: float) -> float:
    """``fraction`` as a float, or ValueError unless it is in (0, 0.5]."""
    value = float(fraction)
    if not 0.0 < value <= 0.5:
        raise ValueError(f"outlier_fraction={fraction} must be in (0, 0.5] (e.g. {DEFAULT_OUTLIER_FRACTION})")
    return value


def outlier_count(numel: int, fraction: float) -> int:
    """k = ceil(fraction x numel) elements, at least one, at most all (rounded to 9 digits first, so a
    product such as 0.1 x 30 is 3, not 4)."""
    return min(int(numel), max(1, math.ceil(round(fraction * numel, 9))))


class Outliers(Policy):
    """Each sender's k largest elements (by magnitude, its own: no agreement between ranks) leave the
    lossy message, zeroed in place (the message keeps its size, packets and masks), and travel as
    (index, value) pairs on a reliable side path; ``inner`` (zero or hadamard) recovers the rest, and
    every receiver adds every rank's pairs to it. LLM.int8's outliers kept apart, on the wire."""
    computes = True
    side_path = True
    acts_on_shards = False   # every receiver adds every rank's outliers to the whole sum
    acts_on_exchanges = False
    acts_on_sends = False    # the side path is an all-gather beside an all-reduce
    acts_on_keys = False     # its side path rides an all-reduce: a key/value exchange has none

    def __init__(self, inner: Policy, fraction: float):
        self.inner, self.fraction = inner, check_fraction(fraction)
        self.settings = inner.settings + ("outlier_fraction",)
        self.name = "outliers" + ("+hadamard" if isinstance(inner, Hadamard) else "")
        self.keeps_memory = inner.keeps_memory

    def draw(self, transfer, lost, collective, numel, dtype, memory):
        return self.inner.draw(transfer, lost, collective, numel, dtype, memory)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(index, value) of every rank's k largest elements (``[ranks, k]`` each) and the messages
        without them (zeros in their place)."""
        index = x.abs().topk(outlier_count(x.shape[1], self.fraction), dim=1).indices
        return index, x.gather(1, index), x.scatter(1, index, 0)

    def all_reduce(self, drawn, x, receivers, per_packet, watch, memory, update, out=None):
        index, values, rest = self.split(x)
        held = self.inner.all_reduce(drawn, rest, receivers, per_packet, lambda seen: None, memory, update).clone()
        for r in range(x.shape[0]):   # rank by rank, in rank order: the same bits at every receiver
            held.index_add_(1, index[r], values[r].expand(len(receivers), -1))
        watch(held)
        return deliver.into(out, held)

    def flops(self, sched, per_packet, numel):
        # the sender's selection (a magnitude and a comparison per element) and zeroing (k), the
        # receiver's scatter-add of every rank's k values
        k = outlier_count(numel, self.fraction)
        return 2.0 * numel + k + sched.ranks * k + self.inner.flops(sched, per_packet, numel)

    def side_bytes(self, numel, dtype):
        # k pairs, packed: an int32 index and a value in the message's dtype
        return outlier_count(numel, self.fraction) * (INDEX_BYTES + dtype.itemsize)
