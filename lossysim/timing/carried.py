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

import numpy as np

from . import carried_kernel
from .congestion import CUBIC_C, WINDOWS, carry

# whether the busy connections run compiled where numba is installed (tests run both ways)
COMPILED = True

NAN = math.nan


def step(kind: str, windows: np.ndarray, window: np.ndarray, row: np.ndarray, lost: np.ndarray,
         conn: np.ndarray, firsts: np.ndarray, ends: np.ndarray, taus: np.ndarray, rtts: np.ndarray,
         reveal: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One step's connections (``windows``: ``[sends, connections, 3]`` states, updated in place), each
    sending its share of its send's packets (connection ``c`` of send ``r`` the packets ``firsts[r, c]`` to
    ``ends[r, c]``, ``taus[r]`` seconds each, round trips of ``rtts[r]``) and losing those at ``lost``
    (sorted by send, then packet; ``row`` and ``conn`` say whose): per send the seconds beyond its
    loss-free time that its slowest connection's window costs (``carry``'s first figure, 0 at least), and
    per loss where its first and ``reveal``-th SACK come back (``carry``'s last two, in packets of the
    send); each connection's window at the end in ``window``. A send with nothing lost whose connections
    were never cut is left alone (at the pipe)."""
    n, k = windows.shape[:2]
    beta, alpha = WINDOWS[kind]
    cubic = kind == "cubic"
    delays = np.zeros(n)
    counts = np.bincount(row, minlength=n) if len(row) else np.zeros(n, dtype=np.int64)
    busy = np.flatnonzero((counts > 0) | ~np.isnan(windows[:, :, 1]).all(1))
    if not len(busy):
        return delays, np.zeros(0), np.zeros(0)
    packets = ends - firsts + 1                                   # [send, connection]
    group = row * k + conn                                        # sorted: each connection's losses a run
    m = len(group)
    bounds = np.searchsorted(group, np.arange(n * k + 1)) if m else np.zeros(n * k + 1, dtype=np.int64)
    firsts_l = firsts[row, conn]
    position = lost - firsts_l                                    # in its connection's packets
    delay_of = np.zeros(n * k)                 # each connection's delay
    kernel = carried_kernel.connections() if COMPILED else None
    if kernel is not None:
        status, F0, F1 = _compiled(kernel, busy, k, cubic, beta, alpha, windows, window, delay_of, packets,
                                   np.ascontiguousarray(taus, dtype=np.float64),
                                   np.ascontiguousarray(rtts, dtype=np.float64), position, bounds, reveal)
        left, loop = np.flatnonzero(status == carried_kernel.CARRY).tolist(), False
    else:
        F0, F1 = [NAN] * m, [NAN] * m          # where each loss's first and reveal-th SACK comes back
        left, loop = [r * k + c for r in busy.tolist() for c in range(k)], True
    if left:
        _in_python(left, loop, kind, cubic, beta, alpha, windows, window, delay_of, packets.tolist(), taus.tolist(),
                   rtts.tolist(), bounds.tolist(), position, reveal, F0, F1)
    # a send's delay: its slowest connection's, 0 at least (``max(0.0, d, ...)``, a NaN passed over)
    slowest = np.fmax.reduce(delay_of.reshape(n, k), axis=1)
    delays = np.where(slowest > 0.0, slowest, 0.0)
    # where a SACK after the stream is (before its pace), in the send's packets
    beyond = packets[row, conn] + window[row, conn] + firsts_l
    sacks, marks = np.asarray(F0, dtype=np.float64), np.asarray(F1, dtype=np.float64)
    sacks = np.where(np.isnan(sacks), beyond, sacks + firsts_l)
    marks = np.where(np.isnan(marks), beyond, marks + firsts_l)
    return delays, sacks, marks


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


def _compiled(kernel, busy, k, cubic, beta, alpha, windows, window, delay_of, packets, taus, rtts, position, bounds,
              reveal):
    """Every busy connection through the compiled ``kernel`` (``carried_kernel.connections()``): each one's
    outcome, where SACKs come back (``F0``, ``F1``); a connection carried there has its state, last window
    and delay written in place."""
    n = len(taus)
    # per send, as ``_in_python`` computes them: a division is IEEE's either way, a power Python's (C's pow)
    pipes, p2s, halfs, cubes = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
    pipes[busy] = rtts[busy] / taus[busy]
    p2s[busy] = [_square(pipe) for pipe in pipes[busy].tolist()]
    halfs[busy], cubes[busy] = np.array([_bounds(alpha, rtt) for rtt in rtts[busy].tolist()]).T
    m, n_groups = len(position), len(bounds) - 1
    F0, F1 = np.full(m, NAN), np.full(m, NAN)
    status = np.full(n_groups, -1, dtype=np.int64)   # -1: not busy
    states, last = np.ascontiguousarray(windows, dtype=np.float64), np.ascontiguousarray(window, dtype=np.float64)
    kernel(busy, k, cubic, beta, alpha, states, last, delay_of, packets.astype(np.int64, copy=False), taus, rtts,
           pipes, p2s, halfs, cubes, position.astype(np.int64, copy=False), bounds.astype(np.int64, copy=False),
           reveal, F0, F1, status)
    if states is not windows:       # (a copy: written back)
        windows[...] = states
    if last is not window:
        window[...] = last
    return status, F0, F1
