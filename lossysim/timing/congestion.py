"""A TCP connection's congestion window, carried from message to message: how much longer a connection
takes to send its packets because a loss cut its window, now or in an earlier message.

Linux (``net/ipv4/tcp_cubic.c``, RFC 9438) cuts CUBIC's window to beta = 717/1024 of itself at a loss,
one cut per recovery episode, remembers the window it had (W_max, lowered by fast convergence when the
window had not regained its last W_max) and grows it back as the larger of two curves of the time t
spent sending since the cut (idle time is not counted: tcp_cubic shifts its epoch after an idle spell):

    cubic(t)  = W_max + C (t - K)^3,     C = 0.4 (bic_scale 41 x 10 / 1024), K = cbrt((W_max - cut) / C)
    reno(t)   = cut + alpha t / rtt,     alpha = 3 (1 - beta) / (1 + beta) packets per round trip

(the Reno-friendly estimate, RFC 9438 section 4.3). At a cluster's microsecond round trips the second
governs: K is seconds, and the cubic curve rises a few dozen packets a second. Reno (RFC 5681) halves and
grows one packet a round trip. BBR (``tcp_bbr.c``) paces at the bottleneck it measures and does not treat
random loss as congestion: its window is never cut (``kind`` empty).

A connection is one flow, fluid: it sends ``w / rtt`` packets a second, at most its share of the link
(``pipe = rtt / tau`` packets a round trip, ``tau`` its packets' spacing at that share; the links here
have no queues, so a window beyond the pipe would only queue). The ACK clock: a packet's SACK comes back
a round trip after it went out, as the stream's packet then goes out. A loss is found when the SACK of
the third delivered packet behind it comes back (tp->reordering); the first loss of an episode cuts the
window there, and for recovery's round trip it holds at the cut (PRR brings it down, nothing grows it)
before it grows; the losses sent before the cut are the same episode. A fresh connection is warm, at the
pipe (NCCL's connections live as long as the job), so a loss-free connection never costs a thing. The
state of one connection is three numbers, ``(w_max, cut, epoch)``: W_max, the window right after the
last cut (NaN: never cut) and the seconds sent since the end of its recovery (negative: in recovery).
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

CUBIC_BETA = 717 / 1024                     # tcp_cubic.c: beta = 717 (of BICTCP_BETA_SCALE 1024)
CUBIC_C = 41 * 10 / 1024                    # bic_scale = 41: C = 0.4004 packets / s^3
# The cut and the Reno-friendly growth per round trip at a loss (CUBIC: RFC 9438 section 4.3; Reno:
# RFC 5681, halve, then one packet per round trip).
WINDOWS = {"cubic": (CUBIC_BETA, 3 * (1 - CUBIC_BETA) / (1 + CUBIC_BETA)), "reno": (0.5, 1.0)}
CONGESTION = ("cubic", "reno", "bbr")       # what a TCP nic's window does at a loss (bbr: nothing)
FRESH = (math.nan, math.nan, 0.0)           # (w_max, cut, epoch) of a connection never cut: at the pipe
PIPE, LINE, CURVE = 0, 1, 2                 # the window's form until the next cut: never cut, the line, the curve


def fresh(*shape) -> np.ndarray:
    """``shape`` connections never cut, as ``[..., 3]`` states."""
    return np.broadcast_to(np.asarray(FRESH), (*shape, 3)).copy()


class Flow:
    """One connection of ``kind`` (``cubic``, ``reno``) sending at most ``pipe`` packets a round trip of
    ``rtt`` seconds (``tau`` seconds a packet at the pipe), from the state ``(w_max, cut, epoch)``."""

    def __init__(self, kind: str, state, tau: float, rtt: float):
        self.beta, self.alpha = WINDOWS[kind]
        self.cubic = kind == "cubic"
        self.tau, self.rtt, self.pipe = tau, rtt, rtt / tau
        self.w_max, self.cut, self.epoch = (float(x) for x in state)
        self._governs, self._k_value, self._mode = None, None, None

    @property
    def state(self) -> tuple[float, float, float]:
        return self.w_max, self.cut, self.epoch

    def window(self) -> float:
        """Packets a round trip now."""
        return self._held() if self.epoch < 0 else self._window(self.epoch)

    def send(self, packets: float) -> float:
        """Send ``packets`` packets: the seconds they take (the epoch moves on by as much)."""
        seconds, self.epoch = self.plan(packets)
        return seconds

    def plan(self, packets: float) -> tuple[float, float]:
        """(the seconds sending ``packets`` would take, the epoch after), sending nothing."""
        if packets <= 0:
            return 0.0, self.epoch
        seconds, epoch = 0.0, self.epoch
        if epoch < 0:   # recovery's round trip: the window holds at its cut
            held_window = min(self.cut, self.pipe)
            held = min(packets, -epoch * held_window / self.rtt)
            seconds, packets = held * self.rtt / held_window, packets - held
            if packets <= 0:
                return seconds, min(epoch + seconds, 0.0)
            epoch = 0.0
        mode = self._mode if self._mode is not None else self._find_mode()
        if mode == PIPE:                             # never cut, at the pipe
            more = packets * self.tau
        elif mode == LINE:                           # the Reno-friendly line (closed form)
            w, pipe, alpha = self.cut + self.alpha * epoch / self.rtt, self.pipe, self.alpha
            if w >= pipe:
                more = packets * self.tau
            else:
                to_pipe = (pipe * pipe - w * w) / (2 * alpha)
                more = ((pipe - w) * self.rtt / alpha + (packets - to_pipe) * self.tau if packets >= to_pipe
                        else (math.sqrt(w * w + 2 * alpha * packets) - w) * self.rtt / alpha)
        elif self._window(epoch) >= self.pipe:
            more = packets * self.tau
        else:
            more = self._curve_send(packets, epoch)
        return seconds + more, epoch + more

    def advance(self, seconds: float) -> float:
        """Send for ``seconds``: the packets that go out (the epoch moves on by as much)."""
        if seconds <= 0:
            return 0.0
        packets = 0.0
        if self.epoch < 0:   # recovery's round trip: the window holds at its cut
            held = min(seconds, -self.epoch)
            packets, seconds, self.epoch = held * self._held() / self.rtt, seconds - held, self.epoch + held
            if seconds <= 0:
                return packets
        mode = self._mode if self._mode is not None else self._find_mode()
        w = self.cut + self.alpha * self.epoch / self.rtt if mode == LINE else math.nan
        if mode == PIPE or (w >= self.pipe if mode == LINE else self._window(self.epoch) >= self.pipe):
            more = seconds / self.tau
        elif mode == LINE:
            alpha = self.alpha
            to_pipe = (self.pipe - w) * self.rtt / alpha
            if seconds >= to_pipe:
                more = (self.pipe ** 2 - w * w) / (2 * alpha) + (seconds - to_pipe) / self.tau
            else:
                grown = w + alpha * seconds / self.rtt
                more = (grown * grown - w * w) / (2 * alpha)
        else:   # the cubic curve: the packets whose sending takes ``seconds`` (it grows with them)
            lo, hi = 0.0, seconds / self.tau
            for _ in range(100):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if self.seconds(mid) < seconds else (lo, mid)
            more = lo
        self.epoch += seconds
        return packets + more

    def _held(self) -> float:
        return min(self.cut, self.pipe)

    def _line(self) -> bool:
        """Whether the window is the Reno-friendly line alone (Reno, or CUBIC where its curve stays under)."""
        return not self.cubic or self._reno_governs()

    def _find_mode(self) -> int:
        """Which of the window's forms holds until the next cut (found once per cut: every send between
        cuts reads it)."""
        self._mode = PIPE if self.cut != self.cut else (LINE if self._line() else CURVE)
        return self._mode

    def seconds(self, packets: float) -> float:
        """The seconds ``send(packets)`` would take, sending nothing."""
        return self.plan(packets)[0]

    def lose(self) -> None:
        """A loss is known now: the window is cut (tcp_cubic.c's ssthresh, with fast convergence). For the
        round trip of recovery that follows it holds there (PRR brings the window down to the cut and
        nothing grows it, tcp_cwnd_reduction); then it grows, its epoch starting at 0."""
        w = self.window()
        converging = self.cubic and not math.isnan(self.w_max) and w < self.w_max
        self.w_max = w * (1 + self.beta) / 2 if converging else w
        self.cut, self.epoch = max(self.beta * w, 2.0), -self.rtt
        self._governs, self._k_value, self._mode = None, None, None

    # -- the window as a function of the time sent since the cut --------------------------------
    def _k(self) -> float:
        if self._k_value is None:
            self._k_value = float(np.cbrt(max(self.w_max - self.cut, 0.0) / CUBIC_C))
        return self._k_value

    def _reno(self, t: float) -> float:
        return self.cut + self.alpha * t / self.rtt

    def _cubic(self, t: float) -> float:
        return self.w_max + CUBIC_C * (t - self._k()) ** 3 if self.w_max > self.cut else self.cut + CUBIC_C * t ** 3

    def _window(self, t: float) -> float:
        if self.cut != self.cut:
            return self.pipe
        w = self._reno(t) if self._line() else max(self._reno(t), self._cubic(t))
        return min(w, self.pipe)

    def _reno_governs(self) -> bool:
        """Whether the cubic curve stays under the Reno-friendly line from the cut until that reaches the
        pipe (then the closed form holds; found once per cut): their difference is a cubic polynomial of
        t, so its largest value on that span is at an end or at a stationary point, K +- sqrt(alpha / (3 C
        rtt))."""
        if self._governs is None:
            end = (self.pipe - self.cut) * self.rtt / self.alpha
            spread = math.sqrt(self.alpha / (3 * CUBIC_C * self.rtt))
            if end < spread / 2 and max(self.w_max - self.cut, 0.0) / CUBIC_C < (spread / 2) ** 3:
                # |t - K| < spread / 2 over the whole span (every cluster round trip): the curve's slope
                # stays under a quarter of the line's, so their difference only falls from the cut, where
                # they meet, and every point below evaluates to at most rounding (1e-15 of the pipe, the
                # slack 1e-9): the answer below without finding K, whose cube root is most of a cut's cost
                self._governs = True
                return True
            k = self._k() if self.w_max > self.cut else 0.0
            points = [t for t in (0.0, end, k - spread, k + spread) if 0.0 <= t <= end]
            slack = 1e-9 * self.pipe   # the curves meet at the cut: rounding must not send every call the long way
            self._governs = all(self._cubic(t) - self._reno(t) <= slack for t in points)
        return self._governs

    def _curve_send(self, packets: float, epoch: float) -> float:
        """Where the cubic curve rises above the Reno-friendly line (long round trips): the window is the
        larger of the two, under the pipe, piece by piece between the times where one overtakes the
        other or reaches the pipe; each piece's packets are its integral of w / rtt."""
        t0, k, rtt = epoch, self._k(), self.rtt
        origin = self.w_max if self.w_max > self.cut else self.cut
        # cubic - reno = C (t - K)^3 + origin - cut - alpha t / rtt, as a polynomial in t
        crossings = np.roots([CUBIC_C, -3 * CUBIC_C * k, 3 * CUBIC_C * k * k - self.alpha / rtt,
                              origin - self.cut - CUBIC_C * k ** 3])
        ends = [t.real for t in crossings if abs(t.imag) < 1e-12 and t.real > t0]
        ends += [t for t in ((self.pipe - self.cut) * rtt / self.alpha,
                             k + np.cbrt((self.pipe - origin) / CUBIC_C)) if t > t0]
        sent, start = 0.0, t0
        for end in sorted(ends) + [math.inf]:
            piece = self._piece((start + end) / 2 if end < math.inf else start + 1.0)
            more = self._integral(piece, start, end, k, origin)
            if sent + more >= packets:
                return self._solve(piece, start, end, packets - sent, k, origin) - t0
            sent, start = sent + more, end
        raise AssertionError("unreachable: the last piece is unbounded")

    def _piece(self, t: float) -> str:
        reno, cubic = self._reno(t), self._cubic(t)
        return "pipe" if max(reno, cubic) >= self.pipe else ("reno" if reno >= cubic else "cubic")

    def _integral(self, piece: str, a: float, b: float, k: float, origin: float) -> float:
        """Packets sent from t = a to b on one piece: the integral of w / rtt."""
        if b == math.inf:
            return math.inf
        if piece == "pipe":
            return (b - a) * self.pipe / self.rtt
        if piece == "reno":
            return (self.cut * (b - a) + self.alpha * (b * b - a * a) / (2 * self.rtt)) / self.rtt
        return (origin * (b - a) + CUBIC_C * ((b - k) ** 4 - (a - k) ** 4) / 4) / self.rtt

    def _solve(self, piece: str, a: float, b: float, packets: float, k: float, origin: float) -> float:
        """The time at which ``packets`` more have gone out from t = a on one piece."""
        if piece == "pipe":
            return a + packets * self.rtt / self.pipe
        lo, hi = a, b if b < math.inf else a + 1.0
        while self._integral(piece, a, hi, k, origin) < packets:
            hi = a + 2 * (hi - a)
        for _ in range(100):   # the integral grows with t: bisection to float precision
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self._integral(piece, a, mid, k, origin) < packets else (lo, mid)
        return hi


def carry(kind: str, state, packets: int, lost, tau: float, rtt: float,
          reveal: int = 3) -> tuple[float, tuple, float, np.ndarray, np.ndarray]:
    """One connection sends ``packets`` packets from ``state``, losing those at the sorted positions
    ``lost`` (in sending order): (the seconds beyond ``packets * tau`` it takes, its state after, the
    window its last packets went out with, and for each loss where the stream is (in packets, fractional)
    when the SACK of the first and of the ``reveal``-th delivered packet behind it comes back, a round
    trip after that packet went out; beyond the end, at the last window's pace).

    The SACK of the ``reveal``-th delivered packet behind a loss marks it lost (tp->reordering); the first
    loss of an episode cuts the window there, once, and the losses sent before that are the same episode.
    A cut found after the last packet is what the next message starts from (recovery over: the message's
    repairs take a round trip at least)."""
    flow = Flow(kind, state, tau, rtt)
    positions = np.asarray(lost, dtype=np.int64)
    n = len(positions)
    after = (behind(positions, packets, 1).tolist(), behind(positions, packets, reveal).tolist())
    found = ([math.nan] * n, [math.nan] * n)
    # the sends that matter, in sending order: a loss (0) and the delivered packets behind it (1, 2)
    sends = sorted([(x, 0, k) for k, x in enumerate(positions.tolist())] +
                   [(x, 1 + j, k) for j in (0, 1) for k, x in enumerate(after[j]) if x < packets])
    sends.append((packets, -1, -1))
    # The flow's arithmetic inline, on locals (a message's loop runs it a few times per loss): the same
    # expressions as ``Flow.plan`` and ``Flow.advance``, in the same order, so the same floats; the cubic
    # curve's pieces (long round trips) are the flow's own.
    pipe, alpha, cut, mode = flow.pipe, flow.alpha, flow.cut, flow._find_mode()

    def plan(packets, epoch):
        if mode == CURVE:
            flow.epoch = epoch
            return flow.plan(packets)
        if packets <= 0:
            return 0.0, epoch
        seconds = 0.0
        if epoch < 0:
            held_window = min(cut, pipe)
            held = min(packets, -epoch * held_window / rtt)
            seconds, packets = held * rtt / held_window, packets - held
            if packets <= 0:
                return seconds, min(epoch + seconds, 0.0)
            epoch = 0.0
        if mode == PIPE:
            more = packets * tau
        else:
            w = cut + alpha * epoch / rtt
            if w >= pipe:
                more = packets * tau
            else:
                to_pipe = (pipe * pipe - w * w) / (2 * alpha)
                more = ((pipe - w) * rtt / alpha + (packets - to_pipe) * tau if packets >= to_pipe
                        else (math.sqrt(w * w + 2 * alpha * packets) - w) * rtt / alpha)
        return seconds + more, epoch + more

    def advance(seconds, epoch):
        if mode == CURVE:
            flow.epoch = epoch
            return flow.advance(seconds), flow.epoch
        if seconds <= 0:
            return 0.0, epoch
        packets = 0.0
        if epoch < 0:
            held = min(seconds, -epoch)
            packets, seconds, epoch = held * min(cut, pipe) / rtt, seconds - held, epoch + held
            if seconds <= 0:
                return packets, epoch
        w = cut + alpha * epoch / rtt if mode == LINE else pipe
        if w >= pipe:
            more = seconds / tau
        else:
            to_pipe = (pipe - w) * rtt / alpha
            if seconds >= to_pipe:
                more = (pipe ** 2 - w * w) / (2 * alpha) + (seconds - to_pipe) / tau
            else:
                grown = w + alpha * seconds / rtt
                more = (grown * grown - w * w) / (2 * alpha)
        return packets + more, epoch + seconds

    returns = deque()       # (time, which, loss): SACKs on their way back, in the order they went out
    now, at, starter, cut_at, epoch = 0.0, 0.0, None, None, flow.epoch
    for position, what, k in sends:
        # the SACKs that come back before this packet goes out: where the stream is then
        seconds, planned = plan(position - at, epoch)
        while returns and returns[0][0] <= now + seconds:
            back, j, i = returns.popleft()
            sent, epoch = advance(back - now, epoch)
            at += sent
            now = back
            found[j][i] = at
            if j == 1 and i == starter and cut_at is None:   # the episode's first loss is found: cut
                flow.epoch = epoch
                flow.lose()
                cut, mode, epoch = flow.cut, flow._find_mode(), flow.epoch
                cut_at, starter = at, None
            seconds, planned = plan(position - at, epoch)
        now, at, epoch = now + seconds, float(position), planned
        if what == -1:
            break
        if what == 0 and starter is None and (cut_at is None or position >= cut_at):
            starter, cut_at = k, None
        elif what:
            returns.append((now + rtt, what - 1, k))
    flow.epoch = epoch
    end = now
    last = flow.window()
    for back, j, i in returns:                        # found after the stream: at the last window's pace
        found[j][i] = packets + (back - end) / rtt * last
        if j == 1 and i == starter and cut_at is None:
            flow.lose()
            cut_at, starter = found[j][i], None
    # the message's repairs take a round trip after its end at least: what recovery has left is over by the
    # next message, which starts from the cut
    flow.epoch = max(flow.epoch, 0.0)
    beyond = packets + last                           # no delivered packet behind it: after the stream
    sacks, marks = (np.array([beyond if x != x else x for x in row]) if n else np.full(0, math.nan) for row in found)
    return end - packets * tau, flow.state, last, sacks, marks


def behind(lost: np.ndarray, packets: int, n: int) -> np.ndarray:
    """For each of the sorted lost positions, the n-th delivered packet after it among ``packets``
    (``packets`` where there is none)."""
    delivered_before = lost - np.arange(len(lost))           # delivered packets before each loss
    # the n-th delivered after loss k is the (delivered_before[k] + n)-th delivered overall, at the position
    # where that count of delivered packets is reached: count + the losses before it
    target = delivered_before + n - 1
    losses_before = np.searchsorted(delivered_before, target, side="right")
    return np.minimum(target + losses_before, packets)


def response_packets_per_rtt(p: float) -> float:
    """A TCP flow's mean window under a loss every 1/p packets, below the pipe: sqrt(3 / (2 p)).

    Cut to beta W at each loss, growing alpha per round trip: a cycle sends (1 + beta) W / 2 packets a
    round trip for (1 - beta) W / alpha round trips, 1/p packets in all. With CUBIC's Reno-friendly
    alpha = 3 (1 - beta) / (1 + beta) or Reno's (beta 1/2, alpha 1) the mean is sqrt(3 / (2 p)): the
    Mathis et al. bound MSS / (RTT sqrt(p)) x sqrt(3/2), and RFC 9438 section 5's AIMD response
    function (CUBIC's own cubic region, (C (3 + beta) / (4 (1 - beta)))^(1/4) (RTT/p)^(3/4) with RTT in
    seconds, is far below it at a cluster's microsecond round trips)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p={p!r} must be a loss probability in (0, 1): without loss the window is the pipe")
    return math.sqrt(1.5 / p)
