"""Runs of lost packets counted, a batch at a time: ``count_runs`` in numpy or torch (whichever holds the
losses: a GPU's stay there), and ``count``, one compiled pass where numba is installed (the ``fast`` extra)
over a CPU batch of losses (``stats.Counters._count_lost``): the same counts, bursts and run lengths,
exactly (integers; tests/test_network.py runs both). A wide network's step queues tens of millions of
losses; numpy's dozen passes over them (a stable sort by link, the run boundaries, the scatters) were a
quarter of the 405B step, where one loop over them in link order costs a few nanoseconds a loss.
"""
from __future__ import annotations

import numpy as np

from ..util import numba_compiled


def count(row, position, bounds, phase, slot, bad, used, link_ids, open_run, max_burst, links,
          sent, lost, sent_bad, bursts, hist, after):
    """Count a batch of draws' losses: draw e's are ``row[k], position[k]`` for k in ``bounds[e] ..
    bounds[e + 1]`` (row-major), ``used[e, row]`` packets sent. A draw of a phase (``phase[e] >= 0``)
    counts into the slots ``phase * links + link``, its sent packets too; another's losses count into
    their ``slot[k]`` (its sent packets counted by the caller). ``bad[e]``: its losses were sent in the
    burst state. ``open_run[row]`` the run each row's link left open before. Adds to ``sent``, ``lost``,
    ``sent_bad``, ``bursts`` (by slot) and ``hist`` (flat ``[length, link]``, the last length pooling
    longer runs, as ``count_runs``); writes the run each row leaves open into ``after``."""
    draws, rows = used.shape
    n = len(row)
    total = np.zeros(rows, dtype=np.int64)
    start = np.zeros(rows + 1, dtype=np.int64)
    for k in range(n):
        start[row[k] + 1] += 1
    for r in range(rows):
        start[r + 1] += start[r]
    fill = start[:rows].copy()
    # The losses in link order, each link's in queue order (a counting sort: stable, so in stream order),
    # written in place as they are read: the runs below walk each link's losses front to back.
    stream = np.empty(n, dtype=np.int64)   # each loss's place in its link's packets of the batch
    slots = np.empty(n, dtype=np.int64)
    for e in range(draws):
        for k in range(bounds[e], bounds[e + 1]):
            r = row[k]
            s = phase[e] * links + link_ids[r] if phase[e] >= 0 else slot[k]
            lost[s] += 1
            if bad[e]:
                sent_bad[s] += 1
            i = fill[r]
            fill[r] = i + 1
            stream[i] = total[r] + position[k]
            slots[i] = s
        for r in range(rows):
            if phase[e] >= 0:
                sent[phase[e] * links + link_ids[r]] += used[e, r]
            total[r] += used[e, r]
    for r in range(rows):
        link, opened, packets = link_ids[r], open_run[r], total[r]
        after[r] = 0 if packets > 0 else opened
        k, end = start[r], start[r + 1]
        if opened > 0 and packets > 0 and not (k < end and stream[k] == 0):
            hist[min(opened, max_burst) * links + link] += 1   # the batch's first packet arrived: it ends
        while k < end:
            last = stream[k]
            carried = last == 0 and opened > 0             # the run left open before goes on
            if not carried:
                bursts[slots[k]] += 1
            length = opened if carried else 0
            while True:
                length += 1
                k += 1
                if k == end or stream[k] != last + 1:
                    break
                last += 1
            if last == packets - 1:                        # reaches the link's last packet: stays open
                after[r] = length
            else:
                hist[min(length, max_burst) * links + link] += 1


def count_runs(xp, row, stream, total, link_ids, slot, open_run, max_burst: int, bursts, hist):
    """Runs of consecutive lost packets on each link, in ``xp`` (the numpy or torch module: whichever
    holds the arrays): ``row``/``stream`` each lost packet's link row and stream position in the batch,
    sorted; ``total`` the packets sent per row; ``open_run`` the run each row's link left open before.
    Adds the bursts begun to ``bursts[slot]`` and the lengths of the runs that ended to ``hist[length,
    link]`` (flat, ``max_burst + 1`` rows of a network's links, the last holding longer runs); returns the
    run each row leaves open."""
    continues = xp.ones_like(row, dtype=bool)
    continues[1:] = (row[1:] == row[:-1]) & (stream[1:] == stream[:-1] + 1)
    if len(row):
        continues[0] = False
    start = ~continues
    # A run whose first packet is its link's first in this batch carries on the run left open before.
    carried = start & (stream == 0) & (open_run[row] > 0)
    tally(xp, bursts, slot[start & ~carried])
    run = start.cumsum(0) - 1
    here = xp.bincount(run, minlength=int(start.sum()))                 # each run's packets in this batch
    run_row = row[start]
    ends_open = stream[start] + here - 1 == total[run_row] - 1          # reaches its link's last packet
    length = here + xp.where(carried[start], open_run[run_row], 0)
    links, closed = len(hist) // (max_burst + 1), ~ends_open
    tally(xp, hist, length[closed].clip(max=max_burst) * links + link_ids[run_row[closed]])
    # A run left open before that this batch's first packet on its link closes.
    first_lost = xp.zeros_like(link_ids, dtype=bool)
    first_lost[row[stream == 0]] = True
    ended = (open_run > 0) & (total > 0) & ~first_lost
    tally(xp, hist, (open_run.clip(max=max_burst) * links + link_ids)[ended])
    after = xp.where(total > 0, 0, open_run)
    after[run_row[ends_open]] = length[ends_open]
    return after


def tally(xp, counts, index) -> None:
    """counts[i] += 1 for each i in ``index``. In numpy, at the few slots touched: a bincount the length of
    ``counts`` (a network's links times the burst bins, tens of thousands) cost far more than a batch's few
    hundred losses; torch keeps the bincount (one kernel, no host sync on a GPU)."""
    if xp is np:
        np.add.at(counts, index, 1)
    else:
        counts += xp.bincount(index, minlength=len(counts))


_compiled: dict = {}


def compiled():
    """``count`` compiled, or None where numba is not installed (``stats.Counters`` counts in numpy)."""
    return numba_compiled(_compiled, "count", count)
