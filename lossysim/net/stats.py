"""Statistics of the traffic: packets sent, lost, resent and never delivered, runs of losses, and the
first delivered tensor that was not finite. Kept per (call site, direction) on the tensors' device.

Counting costs a few dozen small tensor operations whatever the number of packets, so the draws
of a call site are queued and counted together, every ``QUEUE`` calls or when statistics are read
(``flush``): a call adds one entry to a list. Runs of losses continue from one call to the next on
the same link, exactly as if each call were counted alone.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from ..util import untouched_zeros
from . import runs
from .algorithms import PHASES
from .runs import count_runs, tally

COUNTERS = ("sent", "lost", "sent_bad", "bursts", "resent", "missing", "timeouts", "failures")
QUEUE = 64                 # calls counted together
QUEUE_PACKETS = 1 << 18    # or fewer, when they carry this many packets: each call site keeps a buffer
                           # this large, and a 70B model's step has 640 of them
QUEUE_SPARSE = 1024        # draws queued as positions of their losses: no buffer, so many more per batch


class _Draw(NamedTuple):
    """A queued draw: packets sent per row, counter slots (per packet, or the draw's phase), packets
    sent per slot (with per-packet slots), columns it takes in the buffers, whether in_bad was kept;
    or, queued by ``record_lost``, its lost packets' rows and positions (sent ones only, row-major),
    ``used`` a numpy array and ``bad`` whether its lost packets are its burst state's."""
    used: torch.Tensor
    index: Union[torch.Tensor, int]
    sent: Optional[torch.Tensor]
    width: int
    bad: bool
    row: Optional[np.ndarray] = None
    position: Optional[np.ndarray] = None


class Counters:
    """Counts of one call site and direction: ``counts[counter, phase, link]``, the lengths of finished
    runs of losses per link (``runs[length, link]``, the last bin holding longer runs; ``closed_histogram``
    reads it by link) and the run still open at the end of each link (``open_run``). Runs are kept by
    length first: most are a packet or two long, so a wide network's counts touch a few rows of pages
    rather than a page for every link or two."""

    def __init__(self, links: int, max_burst: int, device):
        if torch.device(device).type == "cpu":   # a wide network's pages cost nothing until counted in
            zeros = lambda *shape: torch.from_numpy(untouched_zeros(shape, np.int64))  # noqa: E731
        else:
            zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)  # noqa: E731
        self.links, self.max_burst = links, max_burst
        self.counts = zeros(len(COUNTERS), len(PHASES), links)
        self.runs = zeros(max_burst + 1, links)
        self.open_run = zeros(links)
        self.calls = 0
        # Queued draws: their masks are copied into buffers kept from call to call (a mask kept alive
        # until the batch is counted would split the freed blocks of large tensors, and the heap would
        # grow), the rest is a tuple per draw.
        self._queue: list[tuple] = []
        self._link_ids: Optional[torch.Tensor] = None
        self._lost = torch.zeros(0, dtype=torch.bool, device=device)
        self._bad = torch.zeros(0, dtype=torch.bool, device=device)
        self._columns = 0

    @property
    def device(self) -> torch.device:
        return self.counts.device

    def record(self, link_ids: torch.Tensor, lost: torch.Tensor, in_bad: Optional[torch.Tensor],
               used: torch.Tensor, index, sent: Optional[torch.Tensor] = None) -> None:
        """Count a draw: ``lost`` and ``in_bad`` ``[rows, width]`` on the links ``link_ids``, of which the
        first ``used[row]`` packets were sent. ``index`` is the counter slot (phase * links + link) of
        each packet (``[rows, width]``, then ``sent``, the packets sent per slot, is given) or each
        row's phase (an int)."""
        rows, width = lost.shape
        if width == 0:
            return
        if self._queue and (self._link_ids is not link_ids and not torch.equal(self._link_ids, link_ids)
                            or rows * (self._columns + width) > self._lost.numel() or self._queue[0].row is not None):
            self.flush()  # a batch covers one set of links, and one kind of draw, and fits its buffers
        if rows * (self._columns + width) > self._lost.numel():
            size = max(rows * width, min(rows * width * QUEUE, QUEUE_PACKETS))
            self._lost = torch.zeros(size, dtype=torch.bool, device=self.device)
            self._bad = torch.zeros(size if in_bad is not None else 0, dtype=torch.bool, device=self.device)
        span = slice(self._columns, self._columns + width)
        self._view(self._lost, rows)[:, span].copy_(lost)
        if in_bad is not None:
            self._view(self._bad, rows)[:, span].copy_(in_bad)
        self._link_ids = link_ids
        self._queue.append(_Draw(used, index, sent, width, in_bad is not None))
        self._columns += width
        if len(self._queue) >= QUEUE:
            self.flush()

    def record_lost(self, link_ids: torch.Tensor, row: np.ndarray, position: np.ndarray, used: np.ndarray,
                    index, sent: Optional[torch.Tensor] = None, bad: bool = False) -> None:
        """Count a draw given as its lost packets rather than a mask (a CPU counter): ``row[k], position[k]``
        of each lost packet that was sent (``position < used[row]``), sorted row-major; ``used[row]`` packets
        sent on each link of ``link_ids``; ``index`` and ``sent`` as ``record`` takes them. ``bad``: the loss
        model has a burst state and its lost packets are the packets sent in it (a simple Gilbert chain's
        in_bad is its lost mask), counted as ``sent_bad`` too. Counts exactly what ``record`` counts of the
        same masks."""
        if self._queue and (self._queue[0].row is None or self._link_ids is not link_ids
                            and not torch.equal(self._link_ids, link_ids)):
            self.flush()  # a batch covers one set of links, and one kind of draw
        self._link_ids = link_ids
        self._queue.append(_Draw(used, index, sent, 0, bad, row, position))
        if len(self._queue) >= QUEUE_SPARSE:
            self.flush()

    @staticmethod
    def _view(buffer: torch.Tensor, rows: int) -> torch.Tensor:
        return buffer[:buffer.numel() // rows * rows].view(rows, -1)

    def count_sent(self, sent: torch.Tensor) -> None:
        """A call whose packets all arrive: ``sent[phase, link]`` packets, nothing drawn."""
        self.counts[0] += sent

    def add(self, counters: Sequence[str], index: np.ndarray, values: Sequence[np.ndarray]) -> None:
        """Add ``values[k]`` (int64, on the host) to ``counters[k]`` at the slots ``index`` (phase * links +
        link)."""
        counts = self.counts.view(len(COUNTERS), -1)
        if self.device.type == "cpu":  # a call's few dozen values: numpy's add costs a tenth of torch's dispatch
            counts = counts.numpy()
            for name, value in zip(counters, values):
                np.add.at(counts[COUNTERS.index(name)], index, value)
            return
        index = torch.from_numpy(index).to(self.device)
        for name, value in zip(counters, values):
            counts[COUNTERS.index(name)].index_add_(0, index, torch.from_numpy(value).to(self.device))

    def flush(self) -> None:
        """Count every queued draw, in order (runs of losses continue from one draw to the next).

        Only the lost packets are looked at: each gets its link's stream position (the valid packets
        before it in this batch), so runs are consecutive positions and cost what the losses cost."""
        if not self._queue:
            return
        queue, link_ids, columns = self._queue, self._link_ids, self._columns
        self._queue, self._columns = [], 0
        if queue[0].row is not None:
            self._count_lost(queue, link_ids.numpy())
            return
        rows, device, links = len(link_ids), self.device, self.links
        counts = self.counts.view(len(COUNTERS), -1)
        starts = [0]
        for draw in queue:
            starts.append(starts[-1] + draw.width)
        used = torch.stack([draw.used.to(device) for draw in queue])        # [draws, rows]
        # Packets sent: a draw with per-packet slots brings its count, a per-row phase sends used[row].
        for draw in queue:
            if draw.sent is not None:
                counts[0] += draw.sent.view(-1)
        phased = [(e, draw.index) for e, draw in enumerate(queue) if isinstance(draw.index, int)]
        if phased:
            draws = torch.tensor([e for e, _ in phased], device=device)
            phases = torch.tensor([phase for _, phase in phased], device=device)
            slots = phases.unsqueeze(1) * links + link_ids
            counts[0].index_add_(0, slots.reshape(-1), used[draws].reshape(-1).long())
        if queue[0].bad:
            bad = self._packets(self._view(self._bad, rows)[:, :columns], starts, used)
            counts[2].index_add_(0, self._slot(queue, bad, link_ids), torch.ones_like(bad[0]))
        lost = self._packets(self._view(self._lost, rows)[:, :columns], starts, used)
        row, draw, position = lost
        slot = self._slot(queue, lost, link_ids)
        self._losses(torch, used, row, draw, position, slot, link_ids, counts, self.runs.view(-1))

    @staticmethod
    def _packets(masks: torch.Tensor, starts: list, used: torch.Tensor):
        """(row, draw, position) of every True packet of the queued draws' ``masks`` that was sent."""
        flat = masks
        row, column = flat.nonzero(as_tuple=True)
        bounds = torch.tensor(starts, device=flat.device)
        draw = torch.searchsorted(bounds, column, right=True) - 1
        position = column - bounds[draw]
        sent = position < used[draw, row]
        return row[sent], draw[sent], position[sent]

    def _count_lost(self, queue: list, link_ids: np.ndarray) -> None:
        """``flush`` of draws queued by ``record_lost`` (CPU counters): the same counts, runs and histogram
        as the masks of the same draws give, in one compiled pass (``runs.count``) or numpy's."""
        count = runs.compiled()
        if count is None:
            self._count_lost_numpy(queue, link_ids)
            return
        counts = self.counts.view(len(COUNTERS), -1).numpy()
        used = np.stack([draw.used for draw in queue]).astype(np.int64, copy=False)     # [draws, rows]
        row = np.concatenate([draw.row for draw in queue]).astype(np.int64, copy=False)
        position = np.concatenate([draw.position for draw in queue]).astype(np.int64, copy=False)
        bounds = np.zeros(len(queue) + 1, dtype=np.int64)
        np.cumsum([len(draw.row) for draw in queue], out=bounds[1:])
        phase = np.array([draw.index if isinstance(draw.index, int) else -1 for draw in queue], dtype=np.int64)
        slot = np.zeros(len(row) if (phase < 0).any() else 0, dtype=np.int64)
        for e in np.flatnonzero(phase < 0):   # per-packet slots: its sent packets come counted
            draw = queue[e]
            counts[0] += draw.sent.view(-1).numpy()
            slot[bounds[e]:bounds[e + 1]] = draw.index.numpy()[draw.row, draw.position]
        open_run = self.open_run.numpy()[link_ids]
        after = np.empty_like(open_run)
        count(row, position, bounds, phase, slot, np.array([draw.bad for draw in queue]), used, link_ids,
              open_run, self.max_burst, self.links, *counts[:4], self.runs.view(-1).numpy(), after)
        self._leave_open(link_ids, after)

    def _count_lost_numpy(self, queue: list, link_ids: np.ndarray) -> None:
        counts = self.counts.view(len(COUNTERS), -1).numpy()
        links = self.links
        used = np.stack([draw.used for draw in queue])                       # [draws, rows]
        # Packets sent: a draw with per-packet slots brings its count, a per-row phase sends used[row].
        slots = []                                                          # each draw's losses' slots
        for e, draw in enumerate(queue):
            if isinstance(draw.index, int):
                counts[0][draw.index * links + link_ids] += used[e]         # a draw's links are distinct
                slots.append(draw.index * links + link_ids[draw.row])
            else:
                counts[0] += draw.sent.view(-1).numpy()
                slots.append(draw.index.numpy()[draw.row, draw.position])
        # The losses by row, then draw, then position (each draw's are row-major already).
        row = np.concatenate([draw.row for draw in queue]).astype(np.int64, copy=False)
        draw = np.repeat(np.arange(len(queue)), [len(d.row) for d in queue])
        position = np.concatenate([d.position for d in queue]).astype(np.int64, copy=False)
        slot = np.concatenate(slots).astype(np.int64, copy=False)
        if any(d.bad for d in queue):   # lost packets that were sent in the burst state: all of them
            bad = np.repeat([d.bad for d in queue], [len(d.row) for d in queue])
            tally(np, counts[2], slot[bad])
        order = np.argsort(row, kind="stable")
        row, draw, position, slot = row[order], draw[order], position[order], slot[order]
        self._losses(np, used, row, draw, position, slot, link_ids, counts, self.runs.view(-1).numpy())

    def _slot(self, queue, packets, link_ids: torch.Tensor) -> torch.Tensor:
        """The counter slot of each (row, draw, position) packet: its draw's per-packet slots, or its
        draw's phase on its row's link."""
        row, draw, position = packets
        slot = torch.empty_like(row)
        draws_of: dict[int, list] = {}   # draws that share one index (the same transfer, or phase)
        for e, queued in enumerate(queue):
            draws_of.setdefault(id(queued.index), []).append(e)
        for members in draws_of.values():
            index = queue[members[0]].index
            mine = torch.isin(draw, torch.tensor(members, device=row.device))
            if isinstance(index, int):
                slot[mine] = index * self.links + link_ids[row[mine]]
            else:
                slot[mine] = index[row[mine], position[mine]]
        return slot

    def _losses(self, xp, used, row, draw, position, slot, link_ids, counts, hist) -> None:
        """Count a batch's losses in ``xp`` (numpy or torch, whichever holds them), whichever way its draws
        were queued: ``used[draw, row]`` packets sent, each loss's ``row, draw, position`` (sorted in that
        order) and counter ``slot``. Adds them to ``lost``, counts the runs (``count_runs``: a link's draws
        are one stream of packets) and moves the open runs on."""
        before = used.cumsum(0) - used                                      # valid packets before each draw
        total = used.sum(0)                                                 # [rows]
        tally(xp, counts[1], slot)
        open_run = self.open_run.numpy() if xp is np else self.open_run
        after = count_runs(xp, row, before[draw, row] + position, total, link_ids, slot, open_run[link_ids],
                           self.max_burst, counts[3], hist)
        self._leave_open(link_ids, after)

    def _leave_open(self, link_ids, after) -> None:
        # In place, as the counts are: a state saved or loaded is a copy (a wide network's clone per
        # flush had been a tenth of its counting)
        self.open_run[torch.as_tensor(link_ids)] = torch.as_tensor(after)

    def reset(self) -> None:
        """Zero every counter; queued draws are dropped with them."""
        self._queue, self._columns = [], 0
        self.counts.zero_()
        self.runs.zero_()
        self.open_run.zero_()
        self.calls = 0

    def closed_histogram(self) -> torch.Tensor:
        """Runs by length per link, the runs still open counted at their length so far."""
        self.flush()
        hist = self.runs.T.clone(memory_format=torch.contiguous_format)    # [link, length]
        hist.scatter_add_(1, self.open_run.clamp(max=self.max_burst).unsqueeze(-1),
                          (self.open_run > 0).long().unsqueeze(-1))
        return hist

    def state_dict(self) -> dict:
        self.flush()
        return {"counts": self.counts.cpu().clone(),
                "histogram": self.runs.T.cpu().clone(memory_format=torch.contiguous_format),   # [link, length]
                "open_run": self.open_run.cpu().clone(), "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self._queue, self._columns = [], 0
        # Copies: counting goes on in place, and the state may be loaded again (an in-memory one too)
        self.counts = state["counts"].to(self.device, copy=True)
        self.open_run = state["open_run"].to(self.device, copy=True)
        self.runs = state["histogram"].to(self.device).T.clone(memory_format=torch.contiguous_format)
        if len(self.counts) < len(COUNTERS):  # saved before the later counters existed: they were 0
            grown = torch.zeros(len(COUNTERS), *self.counts.shape[1:], dtype=torch.long, device=self.device)
            grown[:len(self.counts)] = self.counts
            self.counts = grown
        self.calls = state["calls"]


class NonFinite:
    """The first of a channel's calls whose delivered tensor was not finite, found without a host sync
    per call: each call's sum waits in a buffer on the device until it is full or someone asks."""

    def __init__(self, first: int = -1):
        self.first = first                 # network call number, -1: none yet
        self._calls: list[int] = []
        self._sums: Optional[torch.Tensor] = None

    def see(self, call: int, delivered: torch.Tensor) -> None:
        if self.first >= 0:
            return
        if self._sums is None:
            self._sums = torch.zeros(4 * QUEUE, dtype=torch.float64, device=delivered.device)
        # inf and NaN reach the sum; one reduction is half the cost of isfinite().all().
        self._sums[len(self._calls)] = delivered.sum()
        self._calls.append(call)
        if len(self._calls) == len(self._sums):
            self.settle()

    def settle(self) -> int:
        """Look at the waiting sums (one sync); returns ``first``."""
        if self._calls and self.first < 0:
            bad = (~torch.isfinite(self._sums[:len(self._calls)])).nonzero()
            if len(bad):
                self.first = self._calls[int(bad[0])]
        self._calls = []
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


def packets_row(*networks) -> dict:
    """A metrics row's packets sent and lost per direction so far over ``networks`` (``LossyNetwork``s: a
    pipeline's stages, a context group's), and the loss rate over their lossy directions."""
    row = {}
    lost_total = sent_total = 0
    for network in networks:
        for entry in network.summary():
            d = entry["direction"]
            row[f"packets_sent_{d}"] = row.get(f"packets_sent_{d}", 0) + entry["sent"]
            row[f"packets_lost_{d}"] = row.get(f"packets_lost_{d}", 0) + entry["lost"]
            if d in network.lossy:
                sent_total += entry["sent"]
                lost_total += entry["lost"]
    for d in ("fwd", "bwd"):
        row.setdefault(f"packets_sent_{d}", 0)
        row.setdefault(f"packets_lost_{d}", 0)
    row["observed_loss_rate"] = lost_total / sent_total if sent_total else 0.0
    return row


def class_row(name: str, networks) -> dict:
    """``packets_row`` of one traffic class's networks, its keys named by the class (``packets_sent_pp_fwd``,
    ``observed_loss_rate_pp``)."""
    found = packets_row(*networks)
    row = {f"packets_{kind}_{name}_{d}": found[f"packets_{kind}_{d}"] for kind in ("sent", "lost") for d in ("fwd", "bwd")}
    row[f"observed_loss_rate_{name}"] = found["observed_loss_rate"]
    return row
