"""Bernoulli and simple Gilbert loss with its packets' fates kept as the positions of the losses.

A step's mask is almost all False: at 1% loss a 70B model's step (4480 ring steps of about 46 000
packets) would spend its time writing and reading masks. Here a draw gives the lost packets'
positions (``lost_positions``: the model's ``lost_positions``, the same draws in the same order from
the same generator as the mask ``Chains.draw`` gives, and the same chain states after them), the
counters take them as positions (``Counters.record_lost``), and the repairs are the transport's one
rule (``transport.selective``), fed positions (``fates.Positions``). Masks, counts, the clock and the
random streams come out bit for bit as the masks' path: tests/test_sparse.py holds the two against
each other.

The ``drop`` transport draws its calls the same way (``drop``). An estimate needs no Delivery (what each
receiver holds, ``[receivers, packets]``) but how many elements are not the exact sum: ``Losses`` keeps
the lost packets of each send and counts those without building one (``LossyNetwork.simulate(deliver=
False)``).

Only for what it can do exactly: a loss model whose ``sparse`` says so (Bernoulli with 0 < p <= 1/2:
memoryless; a simple Gilbert chain that moves, losing every packet in Bad and none in Good: its chain
state is carried per link as ``Chains`` carries it, and its lost packets are the ones sent in Bad,
counted as such), a selective-repeat nic when packets are repaired, and CPU tensors (``applies``).
Anything else keeps masks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..loss.models import LossModel
from .algorithms import chunk_bounds
from .receivers import Delivery, combine


def applies(spec, device: torch.device) -> bool:
    """Whether a network of ``spec`` draws, drops or repairs its calls on ``device`` here."""
    return (spec.loss.sparse and device.type == "cpu" and _sparse_cables(spec)
            and (not spec.transport_model.repairs or spec.nic_model.mode == "selective"))


def _sparse_cables(spec) -> bool:
    """No fabric, or one whose lossy cables are all memoryless (their losses drawn as positions too)."""
    return spec.cables is None or all(m.sparse and not m.hidden_state for m in spec.cables.losses.values())


def lost_positions(model: LossModel, chains, link_ids: torch.Tensor, lossy: Optional[np.ndarray], width: int,
                   used: np.ndarray) -> np.ndarray:
    """The next ``width`` fates of the lossy links among ``link_ids`` (``lossy`` None: every row's), of which
    ``used[row]`` go out, as sorted flat indices ``row * width + column`` over all the rows: ``Chains.draw``'s
    draws with ``lengths=used``, the chains moved past the packets sent as it moves them."""
    rows = len(link_ids)
    if not rows or lossy is not None and not len(lossy):
        return np.zeros(0, dtype=np.int64)
    if hasattr(chains, "lost_positions"):   # a fabric's: per cable (``net.cables``)
        return chains.lost_positions(link_ids, lossy, width, used)
    if not chains.started:  # as Chains.draw starts its chains (Bernoulli: no draw, no state)
        _, _, chains.state = model.sample_with_states((chains.links, 0), chains.generator, None)
        chains.started = True
    drawn = rows if lossy is None else len(lossy)
    if chains.state is None:   # memoryless: no chain to look up or move (a round's draw, kept cheap)
        flat, _ = model.lost_positions(drawn, width, chains.generator)
    else:
        ids = link_ids if lossy is None else link_ids[torch.from_numpy(lossy)]
        flat, after = model.lost_positions(drawn, width, chains.generator, chains.state[ids],
                                           used if lossy is None else used[lossy])
        moved = chains.state.clone()   # the old tensor may be a saved state's: never written in place
        moved[ids] = after
        chains.state = moved
    if lossy is None or not len(flat):
        return flat
    return lossy[flat // width] * width + flat % width


def drop(model: LossModel, chains, counters, transfer) -> tuple[np.ndarray, np.ndarray]:
    """The ``drop`` transport's draw of one call (``Chains.draw`` over every link's packets, then
    ``Counters.record``), the losses as positions: returns the (send, packet) of each lost packet that
    was sent."""
    width, rows = transfer.width, len(transfer.link_ids)
    lossy = _lossy_rows(transfer)
    lengths = transfer.lengths.numpy()
    flat = lost_positions(model, chains, transfer.link_ids, None if len(lossy) == rows else lossy, width, lengths)
    row, column = np.divmod(flat, max(width, 1))
    went = column < lengths[row]
    row, column = row[went], column[went]
    counters.record_lost(transfer.link_ids, row, column, lengths, transfer.slots, transfer.sent,
                         bad=model.hidden_state)
    starts, sends = _send_starts(transfer)
    key = row * width + column
    at = np.searchsorted(starts, key, side="right") - 1
    return sends[at], key - starts[at]


def _lossy_rows(transfer) -> np.ndarray:
    if not hasattr(transfer, "_lossy_np"):
        transfer._lossy_np = np.asarray(transfer.lossy_rows, dtype=np.int64)
    return transfer._lossy_np


def _send_starts(transfer) -> tuple[np.ndarray, np.ndarray]:
    """Where each send with packets begins in the flat [links, width] draw (sorted), and the sends in that order."""
    if not hasattr(transfer, "_send_starts"):
        sched = transfer.sched
        # A send without packets owns no loss: its start may be another's (the next send's on its row, or
        # past a full row, the next row's first), so it is left out.
        real = np.flatnonzero(_send_packets(sched) > 0)
        starts = np.array([sched.send_row[s] * transfer.width + sched.send_offset[s] for s in real], dtype=np.int64)
        order = np.argsort(starts)
        transfer._send_starts = (starts[order], real[order])
    return transfer._send_starts


def works_out(sched) -> bool:
    """Whether ``Losses.delivery`` works this schedule's Delivery out from the lost packets (else it
    rebuilds the mask and calls ``combine``)."""
    return (sched.algorithm, sched.collective) in (("ring", "all_reduce"), ("ring", "reduce_scatter"),
                                                   ("tree", "all_reduce"))


@dataclass
class Losses:
    """What ``LossyNetwork.simulate(deliver=False)`` returns in place of a Delivery where the recovery
    policy's draw has no side effects: the lost packets of each send, ``(send[k], packet[k])``, packet
    counted from the send's first. What every receiver holds follows from them (``receivers.combine``)."""
    sched: object
    send: np.ndarray
    packet: np.ndarray

    @classmethod
    def of(cls, sched, lost: torch.Tensor) -> "Losses":
        """The lost packets of a ``[sends, max_packets]`` mask on the CPU (the slots past a send's packets
        are not read)."""
        send, packet = np.nonzero(lost.numpy())
        sent = packet < _send_packets(sched)[send]
        return cls(sched, send[sent], packet[sent])

    def mask(self) -> torch.Tensor:
        """The lost packets as ``[sends, max_packets]``, as ``combine`` takes them."""
        lost = torch.zeros(len(self.sched.sends), self.sched.max_packets, dtype=torch.bool)
        lost.numpy()[self.send, self.packet] = True
        return lost

    def delivery(self, weights: Optional[Delivery] = None) -> Delivery:
        """``combine(sched, self.mask(), weights)``, for a ring or tree all-reduce (or a reduce-scatter)
        worked out from the few lost packets rather than along every packet's path: a call's fixed cost,
        where a dozen tensor operations over every packet cost more than the sum they patch."""
        sched = self.sched
        R, P = sched.ranks, sched.n_packets
        if not works_out(sched):
            return combine(sched, self.mask(), weights)
        dropped, partial, unheld = self._tree() if sched.algorithm == "tree" else self._ring()
        kept_coef = np.ones((R, P), dtype=bool)
        kept_coef[dropped] = False
        if unheld is None:   # a reduce-scatter: rank c holds chunk c's sum and nothing else
            kept_gain = np.arange(R)[:, None] == _ring_chunks(sched)[None, :]
        else:
            kept_gain = np.ones((R, P), dtype=bool)
            kept_gain[unheld] = False
        lost_somewhere = np.zeros(P, dtype=bool)
        lost_somewhere[partial] = True
        coef, gain = torch.from_numpy(kept_coef), torch.from_numpy(kept_gain)
        return Delivery(coef=coef if weights is None else torch.where(coef, weights.coef, 0),
                        gain=gain if weights is None else torch.where(gain, weights.gain, 0),
                        partial=torch.from_numpy(lost_somewhere), holes=torch.from_numpy(~kept_gain))

    def _ring(self):
        """The (rank, packet) pairs whose contribution is lost, the packets missing one, and the (rank,
        packet) pairs never received (None for a reduce-scatter) of a ring. On chunk c's path rank c+1+k
        adds its contribution at position k (the owner c last, at R - 1), and rank c+d gets the sum d hops
        after the owner: a packet lost at reduce-scatter hop h drops the contributions of positions 0..h;
        one lost at all-gather hop h never reaches the ranks h+1.. hops on. Losses of one packet add up."""
        sched = self.sched
        R, first, rs, hop = _ring_sends(sched)
        p = first[self.send] + self.packet
        chunk, h, spoils = _ring_chunks(sched)[p], hop[self.send][:, None], rs[self.send]
        position = np.arange(R)[None, :]
        i, k = np.nonzero((position[:, :R - 1] <= h) & spoils[:, None])    # (loss, position) pairs
        dropped = ((chunk[i] + 1 + k) % R, p[i])
        if sched.collective == "reduce_scatter":
            return dropped, p[spoils], None
        i, d = np.nonzero((position > h) & ~spoils[:, None])
        return dropped, p[spoils], ((chunk[i] + d) % R, p[i])

    def _tree(self):
        """``_ring``'s pairs for a tree: a packet lost on the way up from rank a drops the contributions
        of a's subtree; one lost on the way down to a never reaches a's subtree."""
        sched = self.sched
        below, up = _tree_sends(sched)
        i, rank = np.nonzero(below[self.send])                              # (loss, rank cut off) pairs
        packet = self.packet[i]
        lost_up = up[self.send][i]
        return (rank[lost_up], packet[lost_up]), self.packet[up[self.send]], (rank[~lost_up], packet[~lost_up])

    def bad_packets(self) -> tuple[int, int]:
        """(receiver, packet) pairs that do not hold the exact sum (a hole, or a sum missing a contribution),
        in all and at the message's last packet: what ``combine``'s Delivery says, for a ring all-reduce
        without building it (a lost reduce-scatter hop spoils the packet for every rank; the first lost
        all-gather hop h for the R - 1 - h ranks after it)."""
        sched = self.sched
        if (sched.algorithm, sched.collective) != ("ring", "all_reduce"):
            return bad_packets_of(combine(sched, self.mask()), sched.collective)
        R, first, rs, hop = _ring_sends(sched)
        p = first[self.send] + self.packet
        ag = ~rs[self.send]
        spoilt = np.unique(p[~ag])
        h = np.full(sched.n_packets, R - 1, dtype=np.int64)
        np.minimum.at(h, p[ag], hop[self.send[ag]])
        bad = R - 1 - h
        bad[spoilt] = R
        last = int(bad[-1]) if len(bad) else 0
        return int(bad.sum()), last


def _send_packets(sched) -> np.ndarray:
    """The packets of every send of the schedule."""
    cached = getattr(sched, "_send_packets", None)
    if cached is None:
        cached = sched._send_packets = np.array([s.packets for s in sched.sends], dtype=np.int64)
    return cached


def _tree_sends(sched) -> tuple[np.ndarray, np.ndarray]:
    """Per send of a tree all-reduce: the ranks a loss on it cuts off (``[sends, R]``: the subtree of its
    child end) and whether it goes up (reduce)."""
    cached = getattr(sched, "_tree_sends", None)
    if cached is None:
        R = sched.ranks
        below = np.eye(R, dtype=bool)            # below[a, j]: j is in a's subtree
        for j in range(R - 1, 0, -1):            # children before parents (heap layout)
            below[(j - 1) // 2] |= below[j]
        up = np.array([s.phase == "reduce" for s in sched.sends])
        child = np.array([s.src if s.phase == "reduce" else s.dst for s in sched.sends], dtype=np.int64)
        cached = sched._tree_sends = (below[child], up)
    return cached


def _ring_chunks(sched) -> np.ndarray:
    """The ring chunk of every packet of the message."""
    cached = getattr(sched, "_ring_chunks", None)
    if cached is None:
        counts = [count for _, count in chunk_bounds(sched.n_packets, sched.ranks)]
        cached = sched._ring_chunks = np.repeat(np.arange(sched.ranks), counts)
    return cached


def _ring_sends(sched):
    """Per send of a ring all-reduce: its first packet in the message, whether it reduce-scatters, its hop."""
    cached = getattr(sched, "_ring_sends", None)
    if cached is None:
        R = sched.ranks
        first = np.array([s.first for s in sched.sends], dtype=np.int64)
        rs = np.array([s.phase == "reduce_scatter" for s in sched.sends])
        hop = np.array([s.step - (R - 1) if s.phase == "all_gather" else s.step for s in sched.sends], dtype=np.int64)
        cached = sched._ring_sends = (R, first, rs, hop)
    return cached


def bad_packets_of(delivery, collective: str = "all_reduce") -> tuple[int, int]:
    """Packets of a Delivery that do not hold the exact result, in all and at the message's last packet:
    per (receiver, packet) a hole or a sum missing a contribution; an all-gather's per (receiver, shard,
    packet), as every shard is data of its own; a reduce-scatter's per packet, held by its chunk's owner
    alone."""
    if delivery.weights is not None:                            # [receivers, senders, packets]
        missed = delivery.weights == 0
        bad = missed.flatten(0, 1) if collective == "all_gather" else missed.any(1)
    elif collective == "reduce_scatter":                        # coef [senders, packets]: the owner's sum
        bad = (delivery.coef == 0).any(0, keepdim=True)
    else:                                                       # coef [senders, packets], gain [receivers, packets]
        bad = (delivery.gain == 0) | (delivery.coef == 0).any(0)
    return (int(bad.sum()), int(bad[:, -1].sum())) if bad.numel() else (0, 0)
