"""Statistics of the traffic: packets sent, lost, resent and never delivered, runs of losses, and the
first delivered tensor that was not finite. Kept per (call site, direction) on the tensors' device.

Counting costs a few dozen small tensor operations whatever the number of packets, so the draws
of a call site are queued and counted together, every ``QUEUE`` calls or when statistics are read
(``flush``): a call adds one entry to a list. Runs of losses continue from one call to the next on
the same link, exactly as if each call were counted alone.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from .algorithms import PHASES

COUNTERS = ("sent", "lost", "sent_bad", "bursts", "resent", "missing")
QUEUE = 64                 # calls counted together
QUEUE_PACKETS = 1 << 22    # or fewer, when they carry this many packets


class Counters:
    """Counts of one call site and direction: ``counts[counter, phase, link]``, the lengths of finished
    runs of losses per link (``histogram[link, length]``, the last bin holding longer runs) and the run
    still open at the end of each link (``open_run``)."""

    def __init__(self, links: int, max_burst: int, device):
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)  # noqa: E731
        self.links, self.max_burst = links, max_burst
        self.counts = zeros(len(COUNTERS), len(PHASES), links)
        self.histogram = zeros(links, max_burst + 1)
        self.open_run = zeros(links)
        self.calls = 0
        self._queue: list[tuple] = []
        self._queued_packets = 0

    @property
    def device(self) -> torch.device:
        return self.counts.device

    def record(self, link_ids: torch.Tensor, lost: torch.Tensor, in_bad: Optional[torch.Tensor],
               used: torch.Tensor, index) -> None:
        """Count a draw: ``lost`` and ``in_bad`` ``[rows, width]`` on the links ``link_ids``, of which the
        first ``used[row]`` packets were sent; ``index`` is the counter slot (phase * links + link) of
        each packet (``[rows, width]``) or of each row's phase (an int)."""
        if lost.shape[-1] == 0:
            return
        if self._queue and self._queue[-1][0] is not link_ids and not torch.equal(self._queue[-1][0], link_ids):
            self.flush()  # a batch covers one set of links
        self._queue.append((link_ids, lost, in_bad, used, index))
        self._queued_packets += lost.numel()
        if len(self._queue) >= QUEUE or self._queued_packets >= QUEUE_PACKETS:
            self.flush()

    def count_sent(self, sent: torch.Tensor) -> None:
        """A call whose packets all arrive: ``sent[phase, link]`` packets, nothing drawn."""
        self.counts[0] += sent

    def add(self, counter: str, index: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``values`` to ``counter`` at the slots ``index`` (phase * links + link)."""
        self.counts.view(len(COUNTERS), -1)[COUNTERS.index(counter)].index_add_(0, index, values)

    def flush(self) -> None:
        """Count every queued draw (in order: runs continue across draws)."""
        if not self._queue:
            return
        queue, self._queue, self._queued_packets = self._queue, [], 0
        link_ids = queue[0][0]
        n_links = self.links
        lost = torch.cat([entry[1] for entry in queue], dim=1) if len(queue) > 1 else queue[0][1]
        width = lost.shape[1]
        device = lost.device
        valid = torch.cat([torch.arange(e[1].shape[1], device=device) < e[3].unsqueeze(1) for e in queue], dim=1)
        index = torch.cat([_slots(e[4], e[0], e[1].shape[1], n_links) for e in queue], dim=1)
        lost = lost & valid
        flat = index.reshape(-1)
        counts = self.counts.view(len(COUNTERS), -1)
        counts[0].index_add_(0, flat, valid.reshape(-1).long())
        counts[1].index_add_(0, flat, lost.reshape(-1).long())
        bad = [e[2] for e in queue]
        if all(b is not None for b in bad):
            in_bad = torch.cat(bad, dim=1) if len(bad) > 1 else bad[0]
            counts[2].index_add_(0, flat, (in_bad & valid).reshape(-1).long())
        # Runs of losses over the valid packets of each link, continuing the run left open before.
        position = torch.arange(width, device=device)
        open_run = self.open_run[link_ids]
        # The previous valid packet of every position (-1: none in this batch).
        last_valid = torch.where(valid, position, -1).cummax(1).values
        previous = torch.cat([torch.full_like(last_valid[:, :1], -1), last_valid[:, :-1]], 1)
        previous_lost = torch.where(previous >= 0, lost.gather(1, previous.clamp(min=0)),
                                    (open_run > 0).unsqueeze(1))
        starts = lost & ~previous_lost
        counts[3].index_add_(0, flat, starts.reshape(-1).long())
        # Lengths count valid packets: a run's length at a lost packet is its valid packets since the start.
        rank = valid.long().cumsum(1)                  # valid packets up to and including each position
        start_rank = torch.where(starts, rank, 0).cummax(1).values
        length = torch.where(start_rank > 0, rank - start_rank + 1, rank + open_run.unsqueeze(1))
        # A run ends at a lost packet whose next valid packet is delivered (none: the run stays open).
        next_valid = torch.where(valid, position, width).flip(1).cummin(1).values.flip(1)
        following = torch.cat([next_valid[:, 1:], torch.full_like(next_valid[:, :1], width)], 1)
        following_lost = lost.gather(1, following.clamp(max=width - 1)) & (following < width)
        ends = lost & ~following_lost & (following < width)
        bins = self.max_burst + 1
        hist = self.histogram.view(-1)
        hist.index_add_(0, (link_ids.unsqueeze(1) * bins + torch.where(ends, length.clamp(max=self.max_burst), 0))
                        .reshape(-1), ends.reshape(-1).long())
        # A run open before the batch that the batch's first valid packet closes.
        sent_any = valid.any(1)
        first = torch.where(valid, position, width).amin(1).clamp(max=width - 1)
        closed = (open_run > 0) & sent_any & ~lost.gather(1, first.unsqueeze(1)).squeeze(1)
        hist.index_add_(0, link_ids * bins + open_run.clamp(max=self.max_burst), closed.long())
        # The run still open after the last valid packet.
        last = last_valid[:, -1].clamp(min=0).unsqueeze(1)
        still = lost.gather(1, last).squeeze(1) & sent_any
        open_after = torch.where(still, length.gather(1, last).squeeze(1), 0)
        moved = self.open_run.clone()
        moved[link_ids] = torch.where(sent_any, open_after, open_run)
        self.open_run = moved

    def reset(self) -> None:
        """Zero every counter; queued draws are dropped with them."""
        self._queue, self._queued_packets = [], 0
        self.counts.zero_()
        self.histogram.zero_()
        self.open_run.zero_()
        self.calls = 0

    def closed_histogram(self) -> torch.Tensor:
        """Runs by length per link, the runs still open counted at their length so far."""
        self.flush()
        hist = self.histogram.clone()
        hist.scatter_add_(1, self.open_run.clamp(max=self.max_burst).unsqueeze(-1),
                          (self.open_run > 0).long().unsqueeze(-1))
        return hist

    def state_dict(self) -> dict:
        self.flush()
        return {"counts": self.counts.cpu().clone(), "histogram": self.histogram.cpu().clone(),
                "open_run": self.open_run.cpu().clone(), "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self._queue, self._queued_packets = [], 0
        for name in ("counts", "histogram", "open_run"):
            setattr(self, name, state[name].to(self.device))
        self.calls = state["calls"]


def _slots(index, link_ids: torch.Tensor, width: int, n_links: int) -> torch.Tensor:
    """The counter slot of every packet: ``index`` as given ([rows, width]) or one phase per draw."""
    if isinstance(index, int):
        return (index * n_links + link_ids).unsqueeze(1).expand(-1, width)
    return index


class NonFinite:
    """The first of a channel's calls whose delivered tensor was not finite, found without a host sync
    per call: each call's sum waits on the device until many have gathered or someone asks."""

    def __init__(self, first: int = -1):
        self.first = first                 # network call number, -1: none yet
        self._pending: list[tuple[int, torch.Tensor]] = []

    def see(self, call: int, delivered: torch.Tensor) -> None:
        if self.first >= 0:
            return
        # inf and NaN reach the sum; one reduction is half the cost of isfinite().all().
        self._pending.append((call, delivered.sum()))
        if len(self._pending) >= 4 * QUEUE:
            self.settle()

    def settle(self) -> int:
        """Look at the waiting sums (one sync); returns ``first``."""
        if self._pending and self.first < 0:
            sums = torch.stack([s.float() for _, s in self._pending])
            bad = (~torch.isfinite(sums)).nonzero()
            if len(bad):
                self.first = self._pending[int(bad[0])][0]
        self._pending = []
        return self.first


def summarise(rows: Sequence[dict], by: Sequence[str], lossy: Callable[[dict], bool], loss_rate: float,
              mean_burst: float) -> list[dict]:
    """Totals of ``rows`` (``stats()`` records) grouped by any of site/direction/phase/src/dst/link_class,
    with the configured loss rate (``loss_rate`` on the rows ``lossy`` says can lose packets, 0 on the
    others; packet-weighted over the group) and mean burst, and the observed ones."""
    totals: dict[tuple, dict] = {}
    for row in rows:
        key = tuple(row[k] for k in by)
        acc = totals.setdefault(key, {**dict(zip(by, key)), **{name: 0 for name in COUNTERS}, "_lossy": 0})
        for name in COUNTERS:
            acc[name] += row[name]
        if lossy(row):
            acc["_lossy"] += row["sent"]
    for acc in totals.values():
        lossy_sent = acc.pop("_lossy")
        acc["configured_loss_rate"] = loss_rate * lossy_sent / acc["sent"] if acc["sent"] else 0.0
        acc["configured_mean_burst"] = mean_burst if lossy_sent else 0.0
        acc["observed_loss_rate"] = acc["lost"] / acc["sent"] if acc["sent"] else math.nan
        acc["observed_mean_burst"] = acc["lost"] / acc["bursts"] if acc["bursts"] else 0.0
    return list(totals.values())
