"""Selective repeat over memoryless (Bernoulli) loss, its packets' fates kept as the positions of the losses.

``transport._selective`` follows every packet of a step as ``[sends, packets]`` masks and does some
thirty tensor operations per round; at 1% loss a step's rounds after the first resend a few dozen
packets, so a 70B model's step (4480 ring steps of about 46 000 packets) spends its time in per-call
overhead and in masks that are almost all False. Here the same rounds run on small numpy arrays: the
lost packets of a draw are the positions ``Bernoulli.lost_positions`` gives (the same draws, in the same
order, from the same generator), the packets still pending are a sorted list, and the counters take
the losses as positions (``Counters.record_lost``). Masks, counts, the clock and the random streams come
out bit for bit as ``_selective``'s: tests/test_sparse.py holds the two against each other.

The ``drop`` transport draws its calls the same way (``drop``). An estimate needs no Delivery (what each
receiver holds, ``[receivers, packets]``) but how many elements are not the exact sum: ``Losses`` keeps
the lost packets of each send and counts those without building one (``LossyNetwork.simulate(deliver=
False)``).

Only for what it can do exactly: a Bernoulli loss with 0 < p <= 1/2 (memoryless: no chain state, no
burst state to count), a selective-repeat nic when packets are repaired, and CPU tensors (``applies``).
Anything else takes the general path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..loss.models import Bernoulli
from ..timing.retransmission import Nic
from .algorithms import Delivery, chunk_bounds, combine


def applies(spec, device: torch.device) -> bool:
    """Whether a network of ``spec`` draws, drops or repairs its calls on ``device`` here."""
    loss = spec.loss
    return (type(loss) is Bernoulli and loss.sparse and device.type == "cpu"
            and (not spec.transport_model.repairs or spec.nic_model.mode == "selective"))


@dataclass
class StepArrays:
    """One step's sends (``transfer.Step``) as numpy arrays, built once per transfer."""
    link_ids: torch.Tensor      # [sends] network link of each send (the counters' key)
    lossy: Optional[np.ndarray]  # indices of the sends whose links lose packets (None: every send's)
    packets: np.ndarray
    width: int                  # the most packets of a send
    tau: np.ndarray
    rtt: np.ndarray
    final: np.ndarray
    tails: Optional[np.ndarray]  # [sends, width] bool: round 0's tail positions (None: no final send)
    any_final: bool             # some send is its link's last in the collective
    tail_resends: np.ndarray
    slots: np.ndarray           # counter slot of each send
    sends: np.ndarray           # the sends' indices in the schedule

    @classmethod
    def steps(cls, transfer) -> list:
        """Every step of ``transfer``; steps on the same links share one ``link_ids`` (the counters batch
        the draws of one set of links, and compare them by identity first)."""
        shared, out = {}, []
        for step in transfer.steps:
            t = step.transport
            link_ids = transfer.link_ids[step.rows]
            link_ids = shared.setdefault(tuple(link_ids.tolist()), link_ids)
            lossy_rows = set(transfer.lossy_rows)
            lossy = np.array([i for i, r in enumerate(step.rows) if r in lossy_rows], dtype=np.int64)
            packets = t.packets.numpy().astype(np.int64)
            final = t.final.numpy()
            out.append(cls(link_ids, None if len(lossy) == len(packets) else lossy, packets, int(packets.max()),
                           t.tau.numpy(), t.rtt.numpy(), final, t.tails.numpy() if final.any() else None,
                           bool(final.any()),
                           t.tail_resends.numpy().astype(np.int64), step.slots.numpy(),
                           np.asarray(step.sends, dtype=np.int64)))
        return out


@dataclass
class Result:
    """What ``transport.StepResult`` says of a step, plus the missing packets as positions."""
    missing_row: np.ndarray     # sends and packet indices never delivered (sorted; failed sends left out)
    missing_packet: np.ndarray
    transmissions: np.ndarray
    extra: float
    shadow: float
    timeouts: np.ndarray
    failed: np.ndarray


def selective(nic: Nic, model: Bernoulli, chains, counters, a: StepArrays, phase: int, budget: float,
              give_up: bool) -> Result:
    """``transport._selective`` for one step, each round's losses drawn as positions (see the module).

    The pending packets are ``(row, packet)`` pairs, row-major; most rounds after the first resend a few
    packets and lose none, so the work that only losses, tails or failures need is skipped without them."""
    packets, n = a.packets, len(a.packets)
    sent = np.zeros(n, dtype=np.int64)
    waits, shadow = np.zeros(n), np.zeros(n)
    timeouts, streak = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    failed, stopped = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    streaking = False                                                   # some streak is not 0
    checks_failures = nic.retries is not None and not give_up
    to_send = pending = packets                                          # pending: per row
    width, rounds, row = a.width, 0, None
    while True:
        lost = _draw(model, chains, n, a.lossy, width)                        # flat row * width + column
        lost_row, lost_column = np.divmod(lost, width)
        went = lost_column < to_send[lost_row]
        counters.record_lost(a.link_ids, lost_row[went], lost_column[went], to_send, phase)
        tail = None
        if row is None:  # round 0 sends every packet in order: the lost ones that went out are pending
            row, packet = lost_row[went], lost_column[went]
            if a.tails is not None and len(row):
                tail = np.zeros(n, dtype=bool)
                tail[row[a.tails[row, packet]]] = True
        elif len(lost) and len(row):
            # The k-th pending packet of a row goes out as its k-th transmission of the round (a row with
            # more pending than the round's width, one that stopped sending, reads the last column).
            order = np.minimum(np.arange(len(row)) - (np.cumsum(pending) - pending)[row], width - 1)
            again = _member(row * width + order, lost)
            row, packet, order = row[again], packet[again], order[again]
            if len(row) and a.any_final:
                tail = np.zeros(n, dtype=bool)
                tail[row[order >= (to_send - a.tail_resends)[row]]] = True
                tail &= a.final
        else:  # nothing lost this round: nothing pending
            row, packet = row[:0], packet[:0]
        sent = sent + to_send
        rounds += 1
        to_send = pending = np.bincount(row, minlength=n)
        if checks_failures and rounds > nic.retries:
            failed = failed | (to_send > 0)
            to_send = np.where(failed, 0, to_send)
        # (small arrays: Python's any and max over tolist() cost a tenth of numpy's reductions)
        if tail is not None and any(tail.tolist()):
            wait = np.where(tail, nic.timer_s(torch.from_numpy(a.rtt), torch.from_numpy(streak)).numpy(), a.rtt)
            streak, streaking = np.where(tail, streak + 1, 0), True
        else:
            wait, tail = a.rtt, None
            if streaking:
                streak, streaking = np.zeros(n, dtype=np.int64), False
        if give_up and len(row):  # the next round must end within the budget, or the receiver stops waiting
            late = (to_send > 0) & ((sent - packets) * a.tau + waits + wait + to_send * a.tau > budget)
            stopped = stopped | late
            to_send = np.where(late, 0, to_send)
        active = to_send > 0
        if not any(active.tolist()):
            break
        waits = waits + np.where(active, wait, 0.0)
        shadow = shadow + np.where(active, a.rtt, 0.0)
        if tail is not None:
            timeouts = timeouts + (active & tail)
        width = max(to_send.tolist())
    resent = (sent - packets) * a.tau
    extra = np.where(stopped, budget, resent + waits)
    keep = ~failed[row]
    return Result(row[keep], packet[keep], sent, _slowest(extra), _slowest(resent + shadow), timeouts, failed)


def _member(keys: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """Whether each of ``keys`` is in the sorted array ``sorted_set``."""
    at = np.minimum(np.searchsorted(sorted_set, keys), len(sorted_set) - 1)
    return sorted_set[at] == keys


def _draw(model: Bernoulli, chains, rows: int, lossy: Optional[np.ndarray], width: int) -> np.ndarray:
    """The next ``width`` fates of the lossy links among ``rows`` (``Chains.draw``'s draws; ``lossy`` None:
    every row's), as sorted flat indices ``row * width + column`` over all the rows."""
    if lossy is not None and not len(lossy):
        return np.zeros(0, dtype=np.int64)
    if not chains.started:  # as Chains.draw starts its chains (for Bernoulli: no draw, no state)
        _, _, chains.state = model.sample_with_states((chains.links, 0), chains.generator, None)
        chains.started = True
    flat = model.lost_positions(rows if lossy is None else len(lossy), width, chains.generator)
    if lossy is None or not len(flat):
        return flat
    return lossy[flat // width] * width + flat % width


def _slowest(seconds: np.ndarray) -> float:
    return max(seconds.tolist()) if len(seconds) else 0.0


def drop(model: Bernoulli, chains, counters, transfer) -> tuple[np.ndarray, np.ndarray]:
    """The ``drop`` transport's draw of one call (``Chains.draw`` over every link's packets, then
    ``Counters.record``), the losses as positions: returns the (send, packet) of each lost packet that
    was sent."""
    width, rows = transfer.width, len(transfer.link_ids)
    lossy = _lossy_rows(transfer)
    flat = _draw(model, chains, rows, None if len(lossy) == rows else lossy, width) if width \
        else np.zeros(0, dtype=np.int64)
    lengths = transfer.lengths.numpy()
    row, column = np.divmod(flat, max(width, 1))
    went = column < lengths[row]
    row, column = row[went], column[went]
    counters.record_lost(transfer.link_ids, row, column, lengths, transfer.slots, transfer.sent)
    starts, sends = _send_starts(transfer)
    key = row * width + column
    at = np.searchsorted(starts, key, side="right") - 1
    return sends[at], key - starts[at]


def _lossy_rows(transfer) -> np.ndarray:
    if not hasattr(transfer, "_lossy_np"):
        transfer._lossy_np = np.asarray(transfer.lossy_rows, dtype=np.int64)
    return transfer._lossy_np


def _send_starts(transfer) -> tuple[np.ndarray, np.ndarray]:
    """Where each send's packets begin in the flat [links, width] draw (sorted), and the sends in that order."""
    if not hasattr(transfer, "_send_starts"):
        sched = transfer.sched
        starts = np.array([r * transfer.width + o for r, o in zip(sched.send_row, sched.send_offset)], dtype=np.int64)
        order = np.argsort(starts, kind="stable")
        # A send without packets starts where the next one does: searching finds the last such, the real one.
        transfer._send_starts = (starts[order], order.astype(np.int64))
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
    counted from the send's first. What every receiver holds follows from them (``algorithms.combine``)."""
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
            return bad_packets_of(combine(sched, self.mask()))
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


def bad_packets_of(delivery) -> tuple[int, int]:
    """(receiver, packet) pairs of a Delivery that are not the exact sum, in all and at the last packet."""
    if delivery.weights is not None:                            # [receivers, senders, packets]
        bad = (delivery.weights == 0).any(1)
    else:                                                       # coef [senders, packets], gain [receivers, packets]
        bad = (delivery.gain == 0) | (delivery.coef == 0).any(0)
    return (int(bad.sum()), int(bad[:, -1].sum())) if bad.numel() else (0, 0)
