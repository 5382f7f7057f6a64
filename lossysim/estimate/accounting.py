"""What an estimate counts of its messages, and the row's statistics: shared by the named job (``job.Job``)
and the traced one (``trace_replay.Replay``), so both fill the same columns the same way.

``Tally`` holds a job's counters: per class, packets sent, lost and resent and the transport's failures
(``count``, once per network, its counts multiplied by the groups it stands for), the elements its receivers
got and those that did not arrive exact (``lost``, per message), and what NCCL ran each message as. Beside
it: ``mark``, a network's clock read before and after a message (its [with loss, loss-free] seconds);
``is_lossy``, whether a network can lose a packet at all; ``held_elements``, what a collective leaves with
its receivers; ``intervals``, the step times' mean and quantiles with their intervals; ``Group`` and
``ExpertGroup``, a simulated group's networks and the groups its counts stand for.
"""
from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple, Optional

import numpy as np

from .. import traffic
from ..net import LossyNetwork, NetworkSpec
from ..net.recovery import packets_of
from ..net.sparse import Losses, bad_packets_of
from .blast import Blast

CLASSES = traffic.Live(lambda: tuple(c.name for c in traffic.CLASSES))   # every class's columns, declared order


class Group(NamedTuple):
    """A group's network and the groups its counts stand for."""
    spec: NetworkSpec
    copies: float      # the groups its counts stand for: loss-free ones alike (exact), or G / k sampled lossy ones
    same_as: int = -1  # on a fabric, a group that crosses no lossy cable: its times are this one's (not simulated)


class ExpertGroup(NamedTuple):
    """An expert group's networks, one per all-to-all class, and the groups its counts stand for."""
    specs: tuple
    copies: float
    same_as: int = -1


class Tally:
    """A job's counters of packets, failures, collectives run and elements lost, per traffic class."""

    def __init__(self):
        self.inexact = defaultdict(int)
        self.received = defaultdict(int)
        self.sums = {}
        self.drawn = 0     # packet fates drawn (lossy groups simulated), all steps
        self.choices = defaultdict(set)   # (class, collective, algorithm, protocol, channels) -> bytes
        self.blast = Blast()              # on a fabric: who crosses each lossy cable
        # a sampled group's network -> the groups' networks it stands for, on a uniform fabric (their
        # crossings, and so their blast, are their own: ``Job.alike_on_fabric``)
        self.stand_for: dict = {}

    def lost(self, cls: str, direction: str, delivery, per_packet: int, numel: int, received: int,
             copies: int, collective: str = "all_reduce") -> None:
        """One message of ``cls``: ``received`` elements reached its receivers, each ``copies`` times (the
        groups this one stands for); those the ``delivery`` (a policy's draw or ``Losses``; None: all
        arrived) left inexact."""
        self.received[cls, direction] += received * copies
        if delivery is not None:
            self.inexact[cls, direction] += _inexact_elements(delivery, per_packet, numel, collective) * copies

    def count(self, cls: str, net: LossyNetwork, copies: float) -> None:
        """Add ``net``'s packets, failures and collectives run to ``cls``'s, each ``copies`` times (the
        groups it stands for); a lossy network's packets sent were drawn."""
        if is_lossy(net):
            self.drawn += net.totals()["sent"]
            others = self.stand_for.get(net.spec, (net.spec,))
            for spec in others:   # each group it stands for, on its own cables, with its packets
                self.blast.add(cls, net, copies / len(others), spec.cables)
        sums = self.sums.setdefault(cls, defaultdict(float))
        totals = net.totals()
        for name in ("sent", "lost", "resent"):
            sums[name] += totals[name] * copies
        sums["failures"] += net.totals()["failures"] * copies
        for c in net.choices():   # what NCCL runs each message as (``algorithm: auto`` picks per size)
            self.choices[(cls, c["collective"], c["algorithm"], c["protocol"], c["channels"])].add(c["bytes"])

    def choice_summary(self) -> str:
        """One line per (class, collective, algorithm/protocol, channels) the job ran, with its message
        sizes: the estimate's ``collectives`` column."""
        def size(b: int) -> str:
            return f"{b / 2**20:.3g} MiB" if b >= 2**20 else f"{b / 2**10:.3g} KiB"
        return "; ".join(f"{cls} {collective}: {algorithm}/{protocol} x{channels} "
                         f"({size(min(sizes))}{'' if len(sizes) == 1 else '-' + size(max(sizes))})"
                         for (cls, collective, algorithm, protocol, channels), sizes in sorted(self.choices.items()))

    def elements_lost(self, cls: str, direction: Optional[str] = None) -> float:
        """The share of ``cls``'s received elements (in ``direction``, or both) that did not arrive exact."""
        keys = [(cls, d) for d in (("fwd", "bwd") if direction is None else (direction,))]
        received = sum(self.received[k] for k in keys)
        return sum(self.inexact[k] for k in keys) / received if received else 0.0

    def counts(self, steps: int) -> dict:
        """Per class, per step: packets sent, lost and resent, and the transport's failures."""
        return {cls: {name: value / steps for name, value in sums.items()} for cls, sums in self.sums.items()}


def is_lossy(net: LossyNetwork) -> bool:
    """Whether ``net`` can lose a packet: a lossy model, a lossy link and a lossy direction."""
    if net.spec.cables is not None:   # under a fabric: some link crosses a lossy cable (or NVLink loses)
        return net.spec.can_lose and bool(net.lossy)
    return not net.loss_model.lossless and net.topology.has_lossy_link and bool(net.lossy)


def mark(net: LossyNetwork) -> tuple[float, float]:
    """``net``'s clock now, (with loss, loss-free) seconds: a message's are the difference around it."""
    clock = net.clock()
    return clock["comm_s"], clock["ideal_comm_s"]


def intervals(step_s: np.ndarray, level: float = 0.95) -> dict:
    """Mean, p50 and p99 of the step times, each with its ``level`` interval: Student's t for the mean;
    for a quantile the order statistics whose ranks bracket it with that probability (distribution-free).
    A bound the steps are too few to give is None: the interval is wide, take more steps (a p99's upper
    bound needs about 300)."""
    from scipy import stats
    n, x = len(step_s), np.sort(step_s)
    out = {"step_mean_s": float(x.mean())}
    if n > 1:
        half = float(stats.t.ppf(0.5 + level / 2, n - 1) * x.std(ddof=1) / np.sqrt(n))
        out["step_mean_lo_s"], out["step_mean_hi_s"] = out["step_mean_s"] - half, out["step_mean_s"] + half
    else:
        out["step_mean_lo_s"] = out["step_mean_hi_s"] = None
    tail = (1 - level) / 2
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        out[f"step_{name}_s"] = float(np.percentile(x, 100 * q))
        # P(X_(j) <= quantile) = P(Binomial(n, q) >= j): the lower rank l has it >= 1 - tail, the upper u
        lo = int(stats.binom.ppf(tail, n, q))            # 1-based rank: X_(lo) <= quantile w.p. >= 1 - tail
        hi = int(stats.binom.ppf(1 - tail, n, q)) + 1
        out[f"step_{name}_lo_s"] = float(x[lo - 1]) if lo >= 1 else None
        out[f"step_{name}_hi_s"] = float(x[hi - 1]) if hi <= n else None
    return out


def held_elements(collective: str, ranks: int, numel: int) -> int:
    """Elements a collective of ``numel`` (simulate's: an all-gather's per rank) leaves with its receivers:
    every rank the sum, every rank every shard, or every rank its chunk's sum."""
    return {"all_reduce": ranks * numel, "all_gather": ranks * ranks * numel, "reduce_scatter": numel}[collective]


def _inexact_elements(delivery, per_packet: int, numel: int, collective: str = "all_reduce") -> int:
    """Elements, over every receiver, that are not the exact result: a hole, or a sum missing a contribution
    (``delivery``: a policy's draw, or the lost packets as ``Losses``)."""
    bad, last = delivery.bad_packets() if isinstance(delivery, Losses) else \
        bad_packets_of(packets_of(delivery), collective)
    short = per_packet * -(-numel // per_packet) - numel       # the last packet is partial
    return bad * per_packet - last * short

