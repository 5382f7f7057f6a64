"""Packet-loss models, stepped once per packet as Linux netem steps them.

Every model gives two closed forms, ``loss_rate`` (stationary probability that a
packet is lost) and ``mean_burst`` (expected length of a run of consecutive lost
packets), and draws loss masks with ``sample_with_states(n, generator, state, used)``.

``n`` is a packet count, or a shape ``(channels, packets)`` for several
independent chains at once; the chain runs along the last dimension. ``state``
is the chain state the next packet arrives in; pass the returned state to the
next call to continue the same chain. A fresh chain (``state=None``) starts from
the stationary distribution, so statistics hold from the first packet. The same
generator state and chain state give the same mask, bit for bit.

Masks are drawn per loss *event*, not per packet: the gaps between independent
losses and the sojourn times of a Markov chain are geometric, so they are drawn
directly (inverse CDF of float64 uniforms) and written into a zero mask. The
work grows with the number of losses and state changes, not with the packets.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import numpy as np
import torch

Shape = Union[int, Sequence[int]]


def _check_probability(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0 or math.isnan(value):
        raise ValueError(f"{name}={value:g} is not a probability in [0, 1]")
    return value


def _shape(n: Shape) -> tuple[int, ...]:
    shape = (int(n),) if isinstance(n, int) else tuple(int(d) for d in n)
    if not shape or min(shape) < 0:
        raise ValueError(f"bad sample shape {n!r}")
    return shape


# -- event sampling ----------------------------------------------------------------------
# Draws are float64 so geometric gaps stay exact for probabilities down to ~1e-12;
# there are only as many as there are events, so their cost does not matter.
_SPARE_SD = 6.0      # events drawn per block: mean + 6 sd (+ a constant), so a second
_SPARE_FIXED = 16    # block is needed about once in 1e9 calls (it is drawn then, exactly)


def _hazard(q: float) -> float:
    """Rate lam with P(Geometric >= k) = exp(-lam k): -log(1 - q); inf at q = 1, 0 at q = 0."""
    return math.inf if q >= 1.0 else -math.log1p(-q)


def _float64(x: float, device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64, device=device)


def _block_size(mean: float) -> int:
    return int(mean + _SPARE_SD * math.sqrt(mean) + _SPARE_FIXED)


def _exponentials(shape, generator: torch.Generator) -> torch.Tensor:
    """Standard exponentials -log(1 - U), U uniform in [0, 1): finite, float64."""
    u = torch.rand(shape, generator=generator, device=generator.device, dtype=torch.float64)
    return u.neg_().log1p_().neg_()


def _geometric(e: torch.Tensor, lam, cap: int) -> torch.Tensor:
    """Failures before the first success, floor(e / lam), capped at ``cap``; lam may be a tensor.

    Overwrites ``e`` when lam is a number (each draw is used once).
    """
    if isinstance(lam, torch.Tensor):
        g = torch.where(lam > 0, e / lam, math.inf)
    elif lam > 0:
        g = e.mul_(1.0 / lam) if math.isfinite(lam) else e.zero_()
    else:
        g = e.fill_(math.inf)
    return g.clamp_(max=cap).floor_().to(torch.int64)


_MAX_EXPONENTIAL = 37.0  # -log(2^-53): the largest exponential a float64 uniform gives


def _steps(size: int, lam: float, cap: int, generator: torch.Generator, xp=torch):
    """``size`` draws of 1 + Geometric failures, floor(E / lam) + 1, capped near ``cap``, as int64 in
    ``xp`` (torch, or numpy for a CPU generator: fewer calls on small draws).

    The same law as ``_geometric(_exponentials(...)) + 1`` in fewer passes: the truncating cast is the
    floor (values are >= 0), and the cap is applied only when a draw could exceed it. The logarithm is
    torch's whatever ``xp`` (its vectorised and scalar paths need not agree to the last bit); what
    follows it is the same IEEE operations in either, so both give the same steps.
    """
    u = torch.rand(size, generator=generator, device=generator.device, dtype=torch.float64)
    x = u.neg_().log1p_()
    if xp is not torch:
        x = x.numpy()
    x *= -1.0 / lam
    if _MAX_EXPONENTIAL / lam > cap:
        x = x.clip(max=cap)
    x += 1.0
    return xp.asarray(x, dtype=xp.int64)


def _bernoulli_positions(total: int, p: float, generator: torch.Generator, xp=torch):
    """Sorted positions in [0, total) of i.i.d. Bernoulli(p) successes, from geometric gaps, as int64 in
    ``xp`` (torch, or numpy for a CPU generator: the same positions from the same draws)."""
    if total == 0 or p == 0.0:
        return xp.asarray(torch.zeros(0, dtype=torch.int64, device=generator.device))
    if p == 1.0:
        return xp.asarray(torch.arange(total, device=generator.device))
    lam, parts, start = _hazard(p), [], 0
    while start < total:
        step = _steps(_block_size((total - start) * p), lam, total, generator, xp)
        step[0] += start - 1
        pos = step.cumsum(0)
        parts.append(pos)
        start = int(pos[-1]) + 1
    pos = xp.concatenate(parts) if len(parts) > 1 else parts[0]
    return pos[:int(xp.searchsorted(pos, total))]


def _thin(total: int, p: float, generator: torch.Generator):
    """``(positions, value)``: i.i.d. Bernoulli(p) over [0, total) as sparse positions.

    value True: the successes are ``positions``. value False (p > 1/2): every
    position succeeds except ``positions``, so the events drawn stay <= total / 2.
    """
    if p > 0.5:
        return _bernoulli_positions(total, 1.0 - p, generator), False
    return _bernoulli_positions(total, p, generator), True


def _zeros(size: int, device: torch.device) -> torch.Tensor:
    """A False mask. On a CPU through calloc: untouched pages cost nothing until read."""
    if torch.device(device).type == "cpu":
        return torch.from_numpy(np.zeros(size, dtype=np.bool_))
    return torch.zeros(size, dtype=torch.bool, device=device)


def _put(mask: torch.Tensor, index: torch.Tensor, value: bool) -> None:
    """mask[index] = value; on a CPU through numpy, whose scatter is several times faster."""
    if mask.device.type == "cpu":
        mask.numpy()[index.numpy()] = value
    else:
        mask[index] = value


_DENSE_BELOW = 8192   # calls of at most this many packets (all chains) draw one uniform per packet
_DENSE_SEGMENTS = 16  # with a segment per 16 packets or more, masks are written packet by packet


def _repeat(values: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
    """values[j] repeated counts[j] times, concatenated (numpy's repeat on a CPU: faster)."""
    if values.device.type == "cpu":
        return torch.from_numpy(np.repeat(values.numpy(), counts.numpy()))
    return torch.repeat_interleave(values, counts, output_size=total)


def _range_indices(base: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """base[j] + 0 .. base[j] + lengths[j] - 1 for every range j, concatenated."""
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=base.device)
    first = lengths.cumsum(0) - lengths
    if base.device.type == "cpu":  # numpy's repeat is several times faster than torch's here
        shift = np.repeat((base - first).numpy(), lengths.numpy())
        shift += np.arange(total)
        return torch.from_numpy(shift)
    shift = torch.repeat_interleave(base - first, lengths, output_size=total)
    return shift.add_(torch.arange(total, device=base.device))


def _thin_ranges(mask: torch.Tensor, base: torch.Tensor, lengths: torch.Tensor, p: float,
                 generator: torch.Generator) -> None:
    """Set ``mask`` (flat) True at an i.i.d. Bernoulli(p) subset of the packets in the ranges.

    The ranges are laid end to end into one coordinate, so one sequence of
    geometric gaps serves all of them; each event is mapped back by a binary search.
    """
    if p == 0.0 or lengths.numel() == 0:
        return
    if p == 1.0:
        _put(mask, _range_indices(base, lengths), True)
        return
    ends = lengths.cumsum(0)
    total = int(ends[-1])
    pos, value = _thin(total, p, generator)
    j = torch.searchsorted(ends, pos, right=True)
    idx = base[j] + pos - (ends[j] - lengths[j])
    if not value:
        _put(mask, _range_indices(base, lengths), True)
    _put(mask, idx, value)


def _alternating(start: torch.Tensor, cover: int, q0: float, q1: float,
                 generator: torch.Generator) -> torch.Tensor:
    """Sojourn ends of two-state chains that alternate 0, 1, 0, ... from ``start``.

    Chain c is in state ``start[c] ^ (j odd)`` during sojourn j, which lasts
    Geometric(q_state) >= 1 steps (q = the probability of leaving per step).
    Returns the exclusive ends [chains, J] (cumulative from step 0), drawn block
    by block until every chain's last end is >= ``cover``. Sojourns are capped
    at cover + 1 steps, which changes nothing inside [0, cover].
    """
    chains = start.shape[0]
    device = generator.device
    cycle = (1.0 / q0 if q0 > 0 else math.inf) + (1.0 / q1 if q1 > 0 else math.inf)
    size = _block_size(2.0 * cover / cycle) if math.isfinite(cycle) else _SPARE_FIXED
    size += size % 2  # even blocks, so the state of column j is start ^ (j odd) in every block
    lam0, lam1 = _hazard(q0), _hazard(q1)
    # log(1 - U) times -1/lam is E/lam; a state never left (lam = 0) gives inf or nan, set to the cap.
    scale = torch.where(start.unsqueeze(-1) ^ (torch.arange(size, device=device) % 2 == 1),
                        _float64(-1.0 / lam1 if lam1 > 0 else -math.inf, device),
                        _float64(-1.0 / lam0 if lam0 > 0 else -math.inf, device))
    parts, offset = [], torch.zeros(chains, 1, dtype=torch.int64, device=device)
    while True:
        u = torch.rand((chains, size), generator=generator, device=device, dtype=torch.float64)
        x = u.neg_().log1p_().mul_(scale)
        if min(lam0, lam1) == 0.0:
            x.nan_to_num_(nan=cover, posinf=cover)
        elif _MAX_EXPONENTIAL / min(lam0, lam1) > cover:
            x.clamp_(max=cover)
        ends = x.add_(1.0).to(torch.int64).cumsum_(1).add_(offset)
        parts.append(ends)
        offset = ends[:, -1:]
        if chains == 0 or int(offset.min()) >= cover:
            break
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


def _scan_chain(p_gb: float, p_bg: float, shape, generator: torch.Generator,
                state: torch.Tensor) -> torch.Tensor:
    """Arrival states s_0..s_n of two-state chains, one uniform u_t per packet (short calls).

    s_{t+1} = Bad iff u_t < (1 - p_bg if s_t is Bad else p_gb); the whole
    sequence comes from one scan, which for a few thousand packets costs less
    than the fixed overhead of drawing sojourns.
    """
    u = torch.rand(shape, generator=generator, device=generator.device, dtype=torch.float64)
    f_good, f_bad = u < p_gb, u < 1.0 - p_bg
    after = _scan_maps(f_good, f_bad, state, anti=p_gb > 1.0 - p_bg)
    return torch.cat([state.unsqueeze(-1), after], -1)


def _scan_maps(f_good, f_bad, state, anti: bool):
    """State after each of a sequence of maps {Good, Bad} -> {Good, Bad} (last dim)."""
    # A map is a reset (f_good == f_bad), keep or flip. Forward-fill the last
    # reset with one cummax: code = 2*(index+1) + value at resets, the initial
    # state (0 or 1) elsewhere; the value sits in the low bit.
    reset = f_good == f_bad
    steps = f_good.shape[-1]
    index = torch.arange(2, 2 * steps + 2, 2, device=f_good.device, dtype=torch.int32)
    code = torch.where(reset, index + f_good, state.unsqueeze(-1).to(torch.int32))
    last = code.cummax(-1).values
    after = (last & 1).bool()
    if anti:  # flips (Good->Bad, Bad->Good) exist only when p_gb > 1 - p_bg
        flips = (f_good & ~f_bad).to(torch.int32).cumsum(-1)
        last_reset = ((last >> 1) - 1).long().clamp(min=0)
        before = torch.where(last >= 2, flips.gather(-1, last_reset), torch.zeros_like(flips))
        after = after ^ ((flips - before) & 1).bool()
    return after




def _flat_chains(shape, state, used, device):
    """(chains, packets, state flattened to [chains] or None, used flattened to [chains])."""
    chains, packets = math.prod(shape[:-1]), shape[-1]
    if state is not None:
        state = state.to(device).reshape(chains)
    if used is None:
        used = torch.full((chains,), packets, dtype=torch.int64, device=device)
    else:
        used = torch.as_tensor(used, device=device).to(torch.int64).reshape(chains)
        # Checked where it costs nothing: on a GPU the check would be a host sync per draw.
        if chains and used.device.type == "cpu" and (int(used.min()) < 0 or int(used.max()) > packets):
            raise ValueError(f"used must lie in [0, {packets}], got [{int(used.min())}, {int(used.max())}]")
    return chains, packets, state, used


def _segments_to_masks(seg_start, seg_end, flags, packets: int):
    """Flat bases and lengths of the segments, clipped to [0, packets); 0 where not ``flags``."""
    chains = seg_start.shape[0]
    lo = seg_start.clamp(min=0)
    length = (seg_end.clamp(max=packets) - lo).clamp_(min=0).mul_(flags)
    lo += torch.arange(chains, device=seg_start.device).unsqueeze(-1) * packets
    return lo.flatten(), length.flatten()


class LossModel:
    """A stationary per-packet loss process."""

    spec: str = "none"

    @property
    def loss_rate(self) -> float:
        raise NotImplementedError

    @property
    def mean_burst(self) -> float:
        raise NotImplementedError

    @property
    def variance_per_packet(self) -> float:
        """Asymptotic Var(number lost in n packets) / n, burst-aware."""
        raise NotImplementedError

    @property
    def lossless(self) -> bool:
        return self.loss_rate == 0.0

    def sample(self, n: Shape, generator: torch.Generator, state: Optional[torch.Tensor] = None,
               used: Optional[torch.Tensor] = None):
        """Return ``(lost, state)``: a bool mask of shape ``n`` and the next chain state."""
        lost, _, state = self.sample_with_states(n, generator, state, used=used)
        return lost, state

    def sample_with_states(self, n: Shape, generator: torch.Generator, state=None, used=None):
        """Return ``(lost, in_bad, next_state)`` for shape ``n`` (chains along the last dim).

        ``in_bad`` marks packets sent while the chain is in a burst (Bad) state.
        ``used`` (integer tensor of shape ``n[:-1]``, 0 <= used <= packets): only
        the first ``used[c]`` packets of chain c are really sent, so ``next_state``
        is the state after exactly that many packets (the rest are discarded).
        """
        raise NotImplementedError

    # Whether ``state_after`` can rewind a full draw to fewer packets (go-back-N needs it).
    rewindable = False
    # Whether the chain has a hidden (Bad, burst) state whose packets ``in_bad`` marks.
    hidden_state = False
    # Whether ``lost_positions`` can stand in for ``sample_with_states`` (net/sparse.py).
    sparse = False

    def state_after(self, in_bad: torch.Tensor, next_state, used: torch.Tensor):
        """The chain state after the first ``used`` packets of a full draw that returned
        ``(lost, in_bad, next_state)``: for a transport that learns only after drawing how
        many of the drawn packets it sent."""
        raise NotImplementedError(f"{type(self).__name__} cannot be rewound after a draw")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, LossModel) and self.spec == other.spec

    def __hash__(self) -> int:
        return hash(self.spec)


class Bernoulli(LossModel):
    """Each packet lost independently with probability p (netem ``loss random P``)."""

    def __init__(self, p: float):
        self.p = _check_probability("p", p)
        # repr: the shortest text that parses back to the same float, so specs round-trip.
        self.spec = f"bernoulli:{self.p!r}" if self.p > 0 else "none"

    @property
    def loss_rate(self) -> float:
        return self.p

    @property
    def mean_burst(self) -> float:
        if self.p == 0.0:
            return 0.0
        return math.inf if self.p == 1.0 else 1.0 / (1.0 - self.p)

    @property
    def variance_per_packet(self) -> float:
        return self.p * (1.0 - self.p)

    rewindable = True

    def state_after(self, in_bad, next_state, used):
        return next_state  # memoryless

    def sample_with_states(self, n, generator, state=None, used=None):
        shape = _shape(n)
        _flat_chains(shape, None, used, generator.device)  # validates used
        total = math.prod(shape)
        if 0.0 < self.p < 1.0 and total <= _DENSE_BELOW:
            # A short call (one collective's message): one uniform per packet costs
            # less than the fixed overhead of drawing gaps.
            lost = torch.rand(shape, generator=generator, device=generator.device) < self.p
            return lost, torch.zeros_like(lost), state
        # Chains are i.i.d. packet by packet, so one sequence of gaps covers them all.
        pos, value = _thin(total, self.p, generator)
        lost = _zeros(total, generator.device)
        if not value:
            lost.fill_(True)
        _put(lost, pos, value)
        return lost.view(shape), _zeros(total, generator.device).view(shape), state

    @property
    def sparse(self) -> bool:
        """Whether ``lost_positions`` can stand in for ``sample_with_states`` (0 < p <= 1/2)."""
        return 0.0 < self.p <= 0.5

    def lost_positions(self, rows: int, width: int, generator: torch.Generator, state=None,
                       used=None) -> tuple[np.ndarray, None]:
        """``(positions, next_state)``: the lost packets of ``sample_with_states((rows, width), generator,
        state, used)`` as sorted flat indices (a numpy int64 array), from the very same draws of a CPU
        generator: no mask is written. Memoryless: the state stays None. Needs ``sparse``."""
        total = rows * width
        if total <= _DENSE_BELOW:
            lost = torch.rand((rows, width), generator=generator) < self.p
            return np.flatnonzero(lost.numpy()), state
        return _bernoulli_positions(total, self.p, generator, np), state


class NoLoss(Bernoulli):
    """No packet is ever lost; packets are still counted."""

    def __init__(self):
        super().__init__(0.0)


class GilbertElliott(LossModel):
    """Two-state Markov chain (Good/Bad) stepped once per packet, as netem ``loss gemodel``.

    A packet is lost with the loss probability of the state it arrives in
    (``loss_good`` or ``loss_bad``); then the chain moves Good->Bad with
    probability ``p_gb`` or Bad->Good with probability ``p_bg``.
    """

    def __init__(self, p_gb: float, p_bg: float, loss_good: float = 0.0, loss_bad: float = 1.0):
        self.p_gb = _check_probability("p_gb", p_gb)
        self.p_bg = _check_probability("p_bg", p_bg)
        self.loss_good = _check_probability("loss_good", loss_good)
        self.loss_bad = _check_probability("loss_bad", loss_bad)
        if self.p_gb + self.p_bg == 0.0:
            raise ValueError("p_gb=0 and p_bg=0: the chain never moves, so it has no stationary loss rate")
        self.spec = (f"ge:p_gb={self.p_gb!r},p_bg={self.p_bg!r},"
                     f"loss_bad={self.loss_bad!r},loss_good={self.loss_good!r}")

    @classmethod
    def from_rate(cls, loss_rate: float, mean_burst: float) -> "GilbertElliott":
        """Simple Gilbert (lose all in Bad, none in Good) with this average loss and mean burst."""
        loss_rate = float(loss_rate)
        mean_burst = float(mean_burst)
        if not 0.0 <= loss_rate < 1.0:
            raise ValueError(f"rate={loss_rate:g} must be in [0, 1)")
        if not mean_burst >= 1.0:
            raise ValueError(f"burst={mean_burst:g} must be >= 1 (it counts packets)")
        p_bg = 1.0 / mean_burst
        p_gb = loss_rate * p_bg / (1.0 - loss_rate)
        if p_gb > 1.0:
            limit = mean_burst / (mean_burst + 1.0)
            raise ValueError(f"rate={loss_rate:g} is not reachable with burst={mean_burst:g} "
                             f"(a simple Gilbert chain needs rate <= burst/(burst+1) = {limit:.3g})")
        return cls(p_gb, p_bg, loss_good=0.0, loss_bad=1.0)

    @classmethod
    def from_netem(cls, p: float, r: Optional[float] = None, one_minus_h: float = 1.0,
                   one_minus_k: float = 0.0) -> "GilbertElliott":
        """netem's ``loss gemodel p r 1-h 1-k``; ``r`` defaults to ``1 - p`` (Bernoulli), as netem."""
        r = 1.0 - float(p) if r is None else r
        return cls(p, r, loss_good=one_minus_k, loss_bad=one_minus_h)

    @property
    def pi_bad(self) -> float:
        return self.p_gb / (self.p_gb + self.p_bg)

    @property
    def loss_rate(self) -> float:
        return ((self.loss_good * self.p_bg + self.loss_bad * self.p_gb)
                / (self.p_gb + self.p_bg))

    @property
    def mean_burst(self) -> float:
        # NTIA TM-23-565 (Pieper & Voran 2023), with h, k the no-loss probabilities.
        p, r = self.p_gb, self.p_bg
        h, k = 1.0 - self.loss_bad, 1.0 - self.loss_good
        num = (1 - k) * r + (1 - h) * p
        if num == 0.0:
            return 0.0
        den = (1 - k) * r * ((1 - p) * k + p * h) + (1 - h) * p * ((1 - r) * h + r * k)
        return math.inf if den == 0.0 else num / den

    @property
    def variance_per_packet(self) -> float:
        # Loss indicators are conditionally independent given the states, and
        # the state indicator's autocovariance at lag j is pi_B pi_G lam^j.
        rate = self.loss_rate
        lam = 1.0 - self.p_gb - self.p_bg
        pi_b = self.pi_bad
        spread = (self.loss_bad - self.loss_good) ** 2 * pi_b * (1.0 - pi_b)
        return rate * (1.0 - rate) + 2.0 * spread * lam / (1.0 - lam)

    rewindable = True
    hidden_state = True

    def state_after(self, in_bad, next_state, used):
        # in_bad holds the state each packet arrived in: packet `used`'s is the chain's state after `used`.
        n = in_bad.shape[-1]
        if n == 0:
            return next_state
        used = used.to(in_bad.device)
        inside = in_bad.gather(-1, used.clamp(max=n - 1).unsqueeze(-1)).squeeze(-1)
        return torch.where(used < n, inside, next_state)

    @property
    def simple(self) -> bool:
        """A simple Gilbert chain: every packet lost in Bad, none in Good (the lost packets are the Bad ones)."""
        return self.loss_bad == 1.0 and self.loss_good == 0.0

    @property
    def sparse(self) -> bool:
        """Whether ``lost_positions`` can stand in for ``sample_with_states``: a simple chain that moves
        both ways (losses are runs of Bad packets, as few as the chain's sojourns)."""
        return self.simple and self.p_gb > 0.0 and self.p_bg > 0.0

    def lost_positions(self, rows: int, width: int, generator: torch.Generator, state=None,
                       used=None) -> tuple[np.ndarray, torch.Tensor]:
        """``(positions, next_state)``: the lost packets of ``sample_with_states((rows, width), generator,
        state, used)`` as sorted flat indices (a numpy int64 array), and its next state, from the very same
        draws of a CPU generator: no mask is written. Needs ``sparse``."""
        in_bad, sojourns, next_state = self._bad((rows, width), generator, state, used)
        if in_bad is not None:
            return np.flatnonzero(in_bad.numpy()), next_state
        return _range_indices(*_segments_to_masks(*sojourns, width)).numpy(), next_state

    def _bad(self, shape, generator, state, used):
        """The chains' states of a draw of ``shape``, the part of ``sample_with_states`` that
        ``lost_positions`` shares: ``(in_bad, sojourns, next_state)``, ``in_bad`` the ``[chains, packets]``
        mask of a short call (one uniform per packet) and ``sojourns`` None, or for a long one ``in_bad``
        None and ``sojourns`` ``(starts, ends, bad)`` ``[chains, J]``, the sojourns drawn."""
        device = generator.device
        chains, packets, state, used = _flat_chains(shape, state, used, device)
        if state is None:
            state = torch.rand(chains, generator=generator, device=device) < self.pi_bad
        state = state.to(torch.bool)
        if chains * packets <= _DENSE_BELOW:
            states = _scan_chain(self.p_gb, self.p_bg, (chains, packets), generator, state)
            return states[:, :-1], None, states.gather(1, used.unsqueeze(-1)).squeeze(-1)
        # Packet t arrives in the state of the sojourn covering step t; step
        # ``packets`` is where the next call's first packet arrives.
        ends = _alternating(state, packets + 1, self.p_gb, self.p_bg, generator)
        bad = state.unsqueeze(-1) ^ (torch.arange(ends.shape[1], device=device) % 2 == 1)
        starts = torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1]], 1)
        which = torch.searchsorted(ends, used.unsqueeze(-1), right=True).squeeze(-1)
        return None, (starts, ends, bad), state ^ (which % 2 == 1)

    def sample_with_states(self, n, generator, state=None, used=None):
        shape = _shape(n)
        device = generator.device
        chains, packets = math.prod(shape[:-1]), shape[-1]
        in_bad, sojourns, next_state = self._bad(shape, generator, state, used)
        if in_bad is not None:
            in_bad = in_bad.contiguous()
            if self.simple:
                lost = in_bad.clone()
            else:
                v = torch.rand((chains, packets), generator=generator, device=device, dtype=torch.float64)
                lost = v < torch.where(in_bad, _float64(self.loss_bad, device), _float64(self.loss_good, device))
            return lost.view(shape), in_bad.view(shape), next_state.view(shape[:-1])
        starts, ends, bad = sojourns
        bad_base, bad_len = _segments_to_masks(starts, ends, bad, packets)
        in_bad = _zeros(chains * packets, device)
        bad_idx = _range_indices(bad_base, bad_len)
        _put(in_bad, bad_idx, True)
        lost = _zeros(chains * packets, device)   # written sparsely: cheaper than copying in_bad
        if self.simple:
            _put(lost, bad_idx, True)
        else:
            if self.loss_bad == 1.0:
                _put(lost, bad_idx, True)
            elif self.loss_bad > 0.0:
                pos, value = _thin(bad_idx.numel(), self.loss_bad, generator)
                if not value:
                    _put(lost, bad_idx, True)
                _put(lost, bad_idx[pos], value)
            _thin_ranges(lost, *_segments_to_masks(starts, ends, ~bad, packets), self.loss_good, generator)
        return lost.view(shape), in_bad.view(shape), next_state.view(shape[:-1])


class FourState(LossModel):
    """netem's 4-state model (``loss state p13 p31 p32 p23 p14``), stepped as its loss_4state.

    States, numbered as netem numbers them: 1 good reception in a gap period,
    2 good reception in a burst period, 3 loss in a burst, 4 isolated loss.
    Each packet draws one uniform u and moves from the state the previous packet
    left: 1 -> 4 if u < p14, 1 -> 3 if u < p14 + p13, else stays 1; 2 -> 3 if
    u < p23, else stays 2; 3 -> 2 if u < p32, 3 -> 1 if u < p32 + p31, else stays
    3; 4 -> 1 always. The packet is lost when the state it moves to is 3 or 4
    (ranges without gaps, as after the 2026 kernel fix). ``in_bad`` marks the
    burst period, packets whose state is 2 or 3; the chain state passed between
    calls is the state the last packet left (int64, 1..4).
    """

    def __init__(self, p13: float, p31: Optional[float] = None, p32: float = 0.0, p23: float = 1.0,
                 p14: float = 0.0):
        self.p13 = _check_probability("p13", p13)
        self.p31 = _check_probability("p31", 1.0 - self.p13 if p31 is None else p31)
        self.p32 = _check_probability("p32", p32)
        self.p23 = _check_probability("p23", p23)
        self.p14 = _check_probability("p14", p14)
        if self.p13 + self.p14 > 1.0:
            raise ValueError(f"p13={self.p13:g} + p14={self.p14:g} exceeds 1")
        if self.p31 + self.p32 > 1.0:
            raise ValueError(f"p31={self.p31:g} + p32={self.p32:g} exceeds 1")
        if sum(self._weights()) == 0.0:
            raise ValueError(f"p13={self.p13:g}, p31={self.p31:g}, p32={self.p32:g}, p23={self.p23:g}: "
                             "the chain has no unique stationary distribution")
        self.spec = (f"netem:loss state {self.p13!r} {self.p31!r} {self.p32!r} {self.p23!r} {self.p14!r}")

    hidden_state = True

    def _weights(self):
        # Balance: pi3 p31 = pi1 p13, pi2 p23 = pi3 p32, pi4 = pi1 p14, scaled free of divisions.
        return (self.p31 * self.p23, self.p13 * self.p32, self.p13 * self.p23, self.p14 * self.p31 * self.p23)

    @property
    def transition_matrix(self) -> np.ndarray:
        """P[i, j] = P(state j+1 after a packet | state i+1 before it)."""
        p13, p31, p32, p23, p14 = self.p13, self.p31, self.p32, self.p23, self.p14
        return np.array([[1 - p13 - p14, 0.0, p13, p14],
                         [0.0, 1 - p23, p23, 0.0],
                         [p31, p32, 1 - p31 - p32, 0.0],
                         [1.0, 0.0, 0.0, 0.0]])

    @property
    def stationary(self) -> np.ndarray:
        w = np.array(self._weights())
        return w / w.sum()

    @property
    def loss_rate(self) -> float:
        pi = self.stationary
        return float(pi[2] + pi[3])

    @property
    def mean_burst(self) -> float:
        # Lost packets over runs started: a run starts on a move 1 -> 3, 1 -> 4 or 2 -> 3.
        pi = self.stationary
        starts = pi[0] * (self.p13 + self.p14) + pi[1] * self.p23
        if self.loss_rate == 0.0:
            return 0.0
        return math.inf if starts == 0.0 else float(self.loss_rate / starts)

    @property
    def variance_per_packet(self) -> float:
        # sigma^2 = Var(x) + 2 sum_k>=1 Cov(x_0, x_k) = rho(1-rho) + 2 (pi*f)(Z - I)f,
        # with Z = (I - P + 1 pi)^-1 the fundamental matrix of the chain.
        pi, move = self.stationary, self.transition_matrix
        f = np.array([0.0, 0.0, 1.0, 1.0])
        z = np.linalg.inv(np.eye(4) - move + np.outer(np.ones(4), pi))
        rho = self.loss_rate
        return float(max(rho * (1 - rho) + 2.0 * (pi * f) @ (z - np.eye(4)) @ f, 0.0))

    def sample_with_states(self, n, generator, state=None, used=None):
        shape = _shape(n)
        device = generator.device
        chains, packets, state, used = _flat_chains(shape, state, used, device)
        if state is None:
            cdf = torch.tensor(np.cumsum(self.stationary)[:3], device=device, dtype=torch.float64)
            u = torch.rand(chains, generator=generator, device=device, dtype=torch.float64)
            state = torch.searchsorted(cdf, u, right=True) + 1
        state = state.to(torch.int64)
        # Event view: the chain alternates gap and burst periods. A gap period is
        # 1-sojourns (Geometric(p13 + p14) packets) separated by single 4s; each
        # 1-sojourn ends the period w.p. p13 / (p13 + p14). A burst period is
        # 3-sojourns (Geometric(p31 + p32)) separated by 2-sojourns (Geometric(p23));
        # each 3-sojourn ends it w.p. p31 / (p31 + p32). A "slot" is one primary
        # sojourn (1 or 3) plus, unless the period ends there, one secondary (4 or 2).
        # Step -1 is the packet before this call, whose state is ``state``: it
        # sits in the first slot's primary (memoryless), or in a leading 4 or 2.
        q_gap, q_burst = self.p13 + self.p14, self.p31 + self.p32
        leave_gap = self.p13 / q_gap if q_gap > 0 else 0.0
        leave_burst = self.p31 / q_burst if q_burst > 0 else 0.0
        cover = packets + 1                      # steps -1 .. packets - 1
        lead = torch.where(state == 4, 1, 0)
        e = _exponentials(chains, generator)
        lead = torch.where(state == 2, _geometric(e, _hazard(self.p23), cover) + 1, lead)
        burst = (state == 2) | (state == 3)
        slot = self._slot_size(cover)
        seg_len, seg_state = [lead.unsqueeze(-1)], [state.unsqueeze(-1)]
        covered = lead.clone()
        while True:
            phase_ends = _alternating(burst, slot + 1, leave_gap, leave_burst, generator)
            flips = torch.zeros(chains, slot + 2, dtype=torch.int32, device=device)
            flips.scatter_add_(1, phase_ends.clamp(max=slot + 1), torch.ones_like(phase_ends, dtype=torch.int32))
            in_burst = burst.unsqueeze(-1) ^ (flips[:, :-1].cumsum(1) % 2 == 1)   # phase of slots 0..slot
            ends_period = in_burst[:, 1:] != in_burst[:, :-1]
            in_burst = in_burst[:, :-1]
            e = _exponentials((chains, slot, 2), generator)
            primary = _geometric(e[..., 0], torch.where(in_burst, _float64(_hazard(q_burst), device),
                                                        _float64(_hazard(q_gap), device)), cover) + 1
            secondary = torch.where(in_burst, _geometric(e[..., 1], _hazard(self.p23), cover) + 1, 1)
            secondary = torch.where(ends_period, 0, secondary)
            seg_len.append(torch.stack([primary, secondary], -1).flatten(1))
            seg_state.append(torch.stack([torch.where(in_burst, 3, 1), torch.where(in_burst, 2, 4)],
                                         -1).flatten(1))
            covered = covered + (primary + secondary).sum(1)
            burst = in_burst[:, -1] ^ ends_period[:, -1]
            if chains == 0 or int(covered.min()) >= cover:
                break
        seg_len, seg_state = torch.cat(seg_len, 1), torch.cat(seg_state, 1)
        seg_end = seg_len.cumsum(1) - 1                     # exclusive, packet index (step -1 first)
        seg_start = seg_end - seg_len
        which = torch.searchsorted(seg_end, (used - 1).unsqueeze(-1), right=True)
        next_state = seg_state.gather(1, which).squeeze(-1)
        if seg_len.shape[1] * _DENSE_SEGMENTS >= packets:
            # Dense chains (a state change every few packets): write every packet's
            # state once, 1 byte each, rather than index lists 8 bytes per packet.
            _, length = _segments_to_masks(seg_start, seg_end, torch.ones_like(seg_state, dtype=torch.bool),
                                           packets)
            states = _repeat(seg_state.to(torch.int8).flatten(), length, chains * packets)
            lost = states >= 3
            return lost.view(shape), (states == 2).logical_or_(states == 3).view(shape), next_state.view(shape[:-1])
        lost, in_bad = _zeros(chains * packets, device), _zeros(chains * packets, device)
        _put(lost, _range_indices(*_segments_to_masks(seg_start, seg_end, seg_state >= 3, packets)), True)
        bad = (seg_state == 2) | (seg_state == 3)
        _put(in_bad, _range_indices(*_segments_to_masks(seg_start, seg_end, bad, packets)), True)
        return lost.view(shape), in_bad.view(shape), next_state.view(shape[:-1])

    def _slot_size(self, cover: int) -> int:
        """Slots per block: the expected number in ``cover`` steps, plus spare."""
        q_gap, q_burst = self.p13 + self.p14, self.p31 + self.p32
        leave_gap = self.p13 / q_gap if q_gap > 0 else 0.0
        leave_burst = self.p31 / q_burst if q_burst > 0 else 0.0
        gap_slot = (1 / q_gap if q_gap > 0 else math.inf) + (1 - leave_gap)
        burst_slot = ((1 / q_burst if q_burst > 0 else math.inf)
                      + (1 - leave_burst) * (1 / self.p23 if self.p23 > 0 else math.inf))
        if leave_gap > 0 and leave_burst > 0:   # slots in each period: Geometric(leave)
            share = (1 / leave_gap) / (1 / leave_gap + 1 / leave_burst)
            mean_slot = share * gap_slot + (1 - share) * burst_slot
        else:
            mean_slot = min(gap_slot, burst_slot)
        return _block_size(cover / mean_slot) if math.isfinite(mean_slot) else _SPARE_FIXED
