"""``congestion.carry`` for every connection of a step at once: the same per-message loop, flat.

A TCP step carries each connection's window through its message (``congestion.carry``): a loop over the
message's losses and the delivered packets behind them, a few float operations each, run for millions of
losses in a large job. Here each connection's sends in sending order (a loss and the delivered packets
behind it whose SACKs find it: ``carried_kernel.events``, what ``carry`` does with numpy) and its loop
(``carried_kernel.connection``) run, for every busy connection of a step in one call, compiled with numba
where it is installed and as plain Python where not, on plain floats, without the flow's objects: the same
float operations in the same order as ``carry`` (and ``Flow.plan``, ``Flow.advance``,
``Flow.lose``), so the same floats to the last bit (tests/test_carried.py holds every figure against
``carry``'s). Where the cubic curve rises above the Reno-friendly line (round trips of milliseconds and
more, ``congestion.CURVE``) a connection is left to ``carry`` itself.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import numpy as np

from . import carried_kernel
from .congestion import CUBIC_C, WINDOWS, carry

# whether the busy connections run compiled where numba is installed (tests run both ways)
COMPILED = True

NAN = math.nan


def step(kind: str, windows: np.ndarray, window: np.ndarray, row: np.ndarray, lost: np.ndarray,
         conn: np.ndarray, firsts: np.ndarray, ends: np.ndarray, taus: np.ndarray, rtts: np.ndarray,
         reveal: int, powers: Optional["Powers"] = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One step's connections (``windows``: ``[sends, connections, 3]`` states, updated in place), each
    sending its share of its send's packets (connection ``c`` of send ``r`` the packets ``firsts[r, c]`` to
    ``ends[r, c]``, ``taus[r]`` seconds each, round trips of ``rtts[r]``) and losing those at ``lost``
    (sorted by send, then packet; ``row`` and ``conn`` say whose): per send the seconds beyond its
    loss-free time that its slowest connection's window costs (``carry``'s first figure, 0 at least), and
    per loss where its first and ``reveal``-th SACK come back (``carry``'s last two, in packets of the
    send); each connection's window at the end in ``window``. A send with nothing lost whose connections
    were never cut is left alone (at the pipe). ``powers``: ``Powers.of(kind, taus, rtts)``, which a
    caller that has the same sends again keeps."""
    n, k = windows.shape[:2]
    beta, alpha = WINDOWS[kind]
    cubic = kind == "cubic"
    kernel = carried_kernel.connections() if COMPILED else None
    if kernel is not None:
        powers = powers or Powers.of(kind, taus, rtts)
        states = np.ascontiguousarray(windows, dtype=np.float64)
        last = np.ascontiguousarray(window, dtype=np.float64)
        busy, status, delay_of, position, bounds, F0, F1, delays, sacks, marks = kernel(
            k, cubic, beta, alpha, states, last, row, lost, conn, firsts, ends,
            np.ascontiguousarray(taus, dtype=np.float64), np.ascontiguousarray(rtts, dtype=np.float64), *powers,
            reveal)
        if states is not windows:       # (a copy: written back)
            windows[...] = states
        if last is not window:
            window[...] = last
        if not busy:
            return delays, np.zeros(0), np.zeros(0)
        left = np.flatnonzero(status == carried_kernel.CARRY).tolist()
        if not left:
            return delays, sacks, marks
        loop = False
    else:
        counts = np.bincount(row, minlength=n) if len(row) else np.zeros(n, dtype=np.int64)
        busy = np.flatnonzero((counts > 0) | ~np.isnan(windows[:, :, 1]).all(1))
        if not len(busy):
            return np.zeros(n), np.zeros(0), np.zeros(0)
        group = row * k + conn                                    # sorted: each connection's losses a run
        bounds = np.searchsorted(group, np.arange(n * k + 1)) if len(group) else np.zeros(n * k + 1, dtype=np.int64)
        position = lost - firsts[row, conn]                       # in its connection's packets
        delay_of = np.zeros(n * k)                                # each connection's delay
        F0, F1 = [NAN] * len(row), [NAN] * len(row)              # where each loss's first and reveal-th SACK comes back
        left, loop = [r * k + c for r in busy.tolist() for c in range(k)], True
    packets = ends - firsts + 1                                   # [send, connection]
    _in_python(left, loop, kind, cubic, beta, alpha, windows, window, delay_of, packets.tolist(), taus.tolist(),
               rtts.tolist(), bounds.tolist(), position, reveal, F0, F1)
    # a send's delay: its slowest connection's, 0 at least (``max(0.0, d, ...)``, a NaN passed over)
    slowest = np.fmax.reduce(delay_of.reshape(n, k), axis=1)
    delays = np.where(slowest > 0.0, slowest, 0.0)
    # where a SACK after the stream is (before its pace), in the send's packets
    firsts_l = firsts[row, conn]
    beyond = packets[row, conn] + window[row, conn] + firsts_l
    sacks, marks = np.asarray(F0, dtype=np.float64), np.asarray(F1, dtype=np.float64)
    sacks = np.where(np.isnan(sacks), beyond, sacks + firsts_l)
    marks = np.where(np.isnan(marks), beyond, marks + firsts_l)
    return delays, sacks, marks


class Powers(NamedTuple):
    """Each send's powers as Python computes them (C's pow, which numba's ``**`` need not match): its
    round trip in packets squared, the Reno-friendly shortcut's bounds."""
    p2s: np.ndarray
    halfs: np.ndarray
    cubes: np.ndarray

    @classmethod
    def of(cls, kind: str, taus: np.ndarray, rtts: np.ndarray) -> "Powers":
        alpha = WINDOWS[kind][1]
        bounds = np.array([_bounds(alpha, rtt) for rtt in rtts.tolist()], dtype=np.float64).reshape(-1, 2).T
        return cls(np.array([_square(pipe) for pipe in (rtts / taus).tolist()], dtype=np.float64),
                   *(np.ascontiguousarray(column) for column in bounds))


@functools.lru_cache(maxsize=256)
def _bounds(alpha: float, rtt: float) -> tuple[float, float]:
    """The Reno-friendly shortcut's bounds at a round trip, as Python computes them (C's pow): a step's
    sends share a few round trips, a run a few hundred."""
    half = math.sqrt(alpha / (3 * CUBIC_C * rtt)) / 2
    return half, half ** 3


@functools.lru_cache(maxsize=256)
def _square(pipe: float) -> float:
    """``pipe ** 2`` as Python computes it (C's pow, which numba's ``**`` need not match)."""
    return pipe ** 2


def _in_python(groups, loop, kind, cubic, beta, alpha, windows, window, delay_of, packets, taus, rtts, bounds,
               position, reveal, F0, F1) -> None:
    """Connections ``groups`` (``send * connections + connection``) carried in Python: through
    ``carried_kernel.connection`` on their ``events`` (``loop``: without numba), else or where it hands them
    back through ``carry``; their states, last windows and delays written in place, where their SACKs come
    back in ``F0``, ``F1``."""
    k = windows.shape[1]
    longest = 1 + max(bounds[g + 1] - bounds[g] for g in groups)
    A1, A2, ret_w, ret_k, out = [0] * longest, [0] * longest, [0] * 3 * longest, [0] * 3 * longest, [0.0] * 5
    P, W, K, ret_t = [0.0] * 3 * longest, [0] * 3 * longest, [0] * 3 * longest, [0.0] * 3 * longest
    losses = position.tolist() if loop else []
    for g in groups:
        r, c = divmod(g, k)
        tau, rtt, size_c = taus[r], rtts[r], packets[r][c]
        lo, hi = bounds[g], bounds[g + 1]
        outcome = carried_kernel.CARRY
        if loop:
            half, cube = _bounds(alpha, rtt)
            pipe = rtt / tau
            w_max, cut, epoch = windows[r, c].tolist()
            sends = carried_kernel.events(losses, lo, hi, size_c, reveal, A1, A2, P, W, K)
            outcome = carried_kernel.connection(cubic, beta, alpha, w_max, cut, epoch, size_c, tau, rtt, pipe,
                                                pipe ** 2, half, cube, P, W, K, 0, sends, F0, F1,
                                                ret_t, ret_w, ret_k, out)
        if outcome == carried_kernel.DONE:
            delay, *state, last = out
        else:                           # the cubic curve may govern: carry's own loop
            delay, state, last, sacks, marks = carry(kind, windows[r, c], size_c, position[lo:hi], tau, rtt, reveal)
            F0[lo:hi], F1[lo:hi] = sacks.tolist(), marks.tolist()
        windows[r, c], window[r, c], delay_of[g] = state, last, delay
