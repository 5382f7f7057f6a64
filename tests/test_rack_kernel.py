"""RACK's round 0 (``rack_kernel.first``), compiled and as Python, against the numpy passes per connection
that ``tcp._Rack.first`` ran before it (``_by_connection``, kept here as the reference): every wait, timer,
latest position, resend position and suspect to the bit, on random steps of final and not final sends, one
to four connections, scattered and bursty losses, with CUBIC's window and without one (BBR)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lossysim.net.transport import rack_kernel
from lossysim.net.transport.sends import HostSends
from lossysim.net.transport.tcp import _Rack
from lossysim.timing import congestion
from lossysim.timing.retransmission import NIC_PRESETS


def _by_connection(rack: _Rack, row, packet, sacks, marks):
    """Round 0's bookkeeping as it was written before the kernel: numpy per connection, a Python loop over
    each connection's losses. Returns (latest, waits, timer, next, suspects)."""
    a, nic = rack.a, rack.nic
    latest, nxt = rack.ends.astype(np.float64), np.zeros(len(row))
    waits, timer = np.zeros_like(rack.spent), np.zeros(rack.spent.shape, dtype=bool)
    conn = rack.connection(row, packet) if len(row) else row
    suspects = []
    for r, c in sorted(set(zip(row.tolist(), conn.tolist()))):
        at = np.flatnonzero((row == r) & (conn == c))
        mine, end, window = packet[at], int(rack.ends[r, c]), rack.window[r, c]
        behind = (end - mine) - (len(mine) - 1 - np.arange(len(mine)))
        trailing = behind == 0
        latest[r, c] = end - int(trailing.sum())
        waits[r, c] = a.rtt[r]
        if not a.final[r]:
            nxt[at] = mine + window
            continue
        if len(sacks):
            sack_at, mark_at = sacks[at], marks[at]
        else:
            first = int(rack.firsts[r, c])
            sack_at, mark_at = (congestion.behind(mine - first, end - first + 1, n) + first + window
                                for n in (1, nic.dupacks))
        episode, reordered = (-math.inf, -math.inf), False
        for k, (i, b, sack, mark) in enumerate(zip(mine.tolist(), behind.tolist(), sack_at.tolist(),
                                                   mark_at.tolist())):
            if b == 0:
                continue
            sack = sack - 0.5
            if episode[0] <= sack < episode[1]:
                resend = sack
            elif b >= nic.dupacks:
                resend = mark - 0.5
                if resend >= episode[1]:
                    episode = (resend, episode[1])
            else:
                reordered = True
                nxt[at[k]] = float(end) + rack_kernel.AFTER_TIMER + rack_kernel.TIE * i
                continue
            nxt[at[k]] = resend + rack_kernel.TIE * i
            episode = (episode[0], max(episode[1], resend + window))
        if reordered:
            waits[r, c], timer[r, c] = max(waits[r, c], float(nic.reorder_s(a.rtt[r:r + 1])[0])), True
        if trailing.any():
            last_ack = end - int(trailing.sum()) + window
            if episode[0] <= last_ack < episode[1]:
                fallback = ("rto", True)
            else:
                fallback = ("probe", bool(trailing.sum() == 1 and not (nxt[at[~trailing]] > last_ack).any()))
            nxt[at[trailing]] = end + window + rack_kernel.TIE * mine[trailing]
            suspects.append((r, c, float(end), fallback, mine[trailing].tolist()))
    return latest, waits, timer, nxt, suspects


def _random_step(rng, n: int, k: int, rate: float, bursty: bool):
    packets = rng.integers(k, 3000, size=n)
    rtt = 10 ** rng.uniform(-6, -4, size=n)
    a = HostSends(packets, int(packets.max()), rtt / 10 ** rng.uniform(0.5, 3, size=n), rtt,
                  rng.random(n) < 0.7, None, True, np.zeros(n, dtype=np.int64), connections=k)
    rows, lost = [], []
    for r in range(n):
        at = np.flatnonzero(rng.random(packets[r]) < rate * rng.uniform(0, 2))
        if bursty:     # runs of up to 6 lost in a row, and often the last packets
            at = np.concatenate([at + j for j in range(int(rng.integers(1, 7)))])
            if rng.random() < 0.3:
                at = np.concatenate([at, packets[r] - 1 - np.arange(int(rng.integers(1, 4)))])
            at = np.unique(np.clip(at, 0, packets[r] - 1))
        rows.append(np.full(len(at), r)), lost.append(at)
    return a, np.concatenate(rows).astype(np.int64), np.concatenate(lost).astype(np.int64)


def _kernels(compiled: bool, monkeypatch) -> None:
    """The kernels compiled (numba is in the dev extra) or as Python."""
    if compiled:
        pytest.importorskip("numba")
    monkeypatch.setattr(rack_kernel, "COMPILED", compiled)


def _listed(suspects: rack_kernel.Suspects) -> list:
    """The suspects as the reference lists them: (send, connection, position, (timer, flag), packets)."""
    return [(r, c, at, ("rto" if kind == rack_kernel.RTO else "probe", flag),
             suspects.packet[suspects.start[i]:suspects.start[i + 1]].tolist())
            for i, (r, c, at, kind, flag) in enumerate(zip(suspects.row.tolist(), suspects.conn.tolist(),
                                                           suspects.at.tolist(), suspects.kind.tolist(),
                                                           suspects.flag.tolist()))]


def _same(a, b) -> bool:
    return np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("preset", ["tcp", "tcp-bbr"])
@pytest.mark.parametrize("bursty", [False, True], ids=["scattered", "bursty"])
def test_round_0_is_the_numpy_passes_to_the_bit(compiled, preset, bursty, monkeypatch):
    _kernels(compiled, monkeypatch)
    nic = NIC_PRESETS[preset]
    rng = np.random.default_rng(11 + bursty)
    checked = suspects_seen = 0
    for k in (1, 2, 4):
        for rate in (0.002, 0.02, 0.2):
            a, row, packet = _random_step(rng, 40, k, rate, bursty)
            rack = _Rack(nic, a, None)
            rack.first(row, packet)
            # the reference reads the same SACK positions the window's carry gave (none without a window)
            fresh = _Rack(nic, a, None)
            sacks = marks = np.zeros(0)
            if nic.window:
                _, sacks, marks = fresh._windows(row, packet, fresh.connection(row, packet))
            latest, waits, timer, nxt, suspects = _by_connection(fresh, row, packet, sacks, marks)
            assert _same(rack.latest, latest) and _same(rack.next, nxt)
            assert _same(rack.provisional, waits) and _same(rack.timed, timer)
            assert _listed(rack.suspects) == suspects
            checked += len(row)
            suspects_seen += len(suspects)
    assert checked > 10_000 and suspects_seen > 20     # the cases reached: many losses, some tails
