"""Packet-loss models, stepped once per packet as Linux netem steps them.

Every model gives two closed forms, ``loss_rate`` (stationary probability that a
packet is lost) and ``mean_burst`` (expected length of a run of consecutive lost
packets), and draws loss masks with ``sample(n, generator, state)``.

``n`` is a packet count, or a shape ``(channels, packets)`` for several
independent chains at once; the chain runs along the last dimension. ``state``
is the chain state the next packet arrives in (one bool per chain, True = Bad);
pass the returned state to the next call to continue the same chain. A fresh
chain (``state=None``) starts from the stationary distribution, so statistics
hold from the first packet. The same generator state and chain state give the
same mask, bit for bit.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

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

    def sample(self, n: Shape, generator: torch.Generator, state: Optional[torch.Tensor] = None):
        """Return ``(lost, state)``: a bool mask of shape ``n`` and the next chain state."""
        lost, _, state = self.sample_with_states(n, generator, state)
        return lost, state

    def sample_with_states(self, n: Shape, generator: torch.Generator, state=None, used=None):
        """Like ``sample`` but also returns which packets were sent in the Bad state.

        ``used`` (per chain, optional): only the first ``used`` packets are really sent,
        so the returned state is the chain's after them.
        """
        lost, in_bad, next_state = self._sample(_shape(n), generator, state)
        if used is not None:
            next_state = self.state_after(in_bad, next_state, used)
        return lost, in_bad, next_state

    def _sample(self, shape, generator, state):
        raise NotImplementedError

    def state_after(self, in_bad: torch.Tensor, next_state, used: torch.Tensor):
        """The chain state after the first ``used`` packets of a draw whose arrival
        states were ``in_bad`` (the later packets of that draw were never sent)."""
        return next_state

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

    def _sample(self, shape, generator, state):
        if self.p == 0.0:
            lost = torch.zeros(shape, dtype=torch.bool, device=generator.device)
        else:
            lost = torch.rand(shape, generator=generator, device=generator.device) < self.p
        in_bad = torch.zeros_like(lost)
        return lost, in_bad, state


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

    def state_after(self, in_bad, next_state, used):
        n = in_bad.shape[-1]
        if n == 0:
            return next_state
        used = used.to(in_bad.device)
        inside = in_bad.gather(-1, used.clamp(max=n - 1).unsqueeze(-1)).squeeze(-1)
        return torch.where(used < n, inside, next_state)

    def _sample(self, shape, generator, state):
        device = generator.device
        if state is None:
            state = torch.rand(shape[:-1], generator=generator, device=device) < self.pi_bad
        else:
            state = state.to(device=device, dtype=torch.bool)
        in_bad, next_state = _run_chain(self.p_gb, 1.0 - self.p_bg, shape, generator, state)
        if self.loss_bad == 1.0 and self.loss_good == 0.0:
            lost = in_bad.clone()
        else:
            v = torch.rand(shape, generator=generator, device=device)
            lost = v < torch.where(in_bad, self.loss_bad, self.loss_good)
        return lost, in_bad, next_state


# Scans (cummax/cumsum) cost ~8 ns per element on a CPU, elementwise ops ~1 ns,
# so long chains are cut into blocks of _BLOCK packets: each block's K
# transitions are composed with elementwise ops, only the block sequence is
# scanned, then states are expanded column by column. Short chains (the usual
# per-collective message) take the plain scan, which launches fewer ops.
_BLOCK = 64
_BLOCKED_FROM = 1 << 16


def _run_chain(to_bad_from_good: float, to_bad_from_bad: float, shape, generator, state):
    """Step a two-state chain once per packet along the last dim.

    Packet t arrives in state s_t (s_0 = ``state``); a uniform draw u_t gives
    s_{t+1} = Bad iff u_t < (to_bad_from_bad if s_t is Bad else to_bad_from_good).
    Returns (s_0..s_{n-1}, s_n).
    """
    device = generator.device
    n = shape[-1]
    if n == 0:
        return torch.zeros(shape, dtype=torch.bool, device=device), state
    k = _BLOCK if n >= _BLOCKED_FROM else 1
    m = -(-n // k)
    u = torch.rand(*shape[:-1], k, m, generator=generator, device=device)
    # Packet j*k + c uses u[..., c, j]; a step maps Good -> f_good, Bad -> f_bad.
    f_good, f_bad = u < to_bad_from_good, u < to_bad_from_bad
    if k * m > n:  # padded steps at the end keep the state
        f_good[..., n - (m - 1) * k:, -1] = False
        f_bad[..., n - (m - 1) * k:, -1] = True
    block_good, block_bad = f_good[..., 0, :], f_bad[..., 0, :]
    for c in range(1, k):
        block_good = torch.where(block_good, f_bad[..., c, :], f_good[..., c, :])
        block_bad = torch.where(block_bad, f_bad[..., c, :], f_good[..., c, :])
    after = _scan_maps(block_good, block_bad, state, anti=to_bad_from_good > to_bad_from_bad)
    if k == 1:
        return torch.cat([state.unsqueeze(-1), after[..., :-1]], dim=-1), after[..., -1]
    current = torch.cat([state.unsqueeze(-1), after[..., :-1]], dim=-1)
    arriving = torch.empty(*shape[:-1], m, k, dtype=torch.bool, device=device)
    for c in range(k):
        arriving[..., c] = current
        current = torch.where(current, f_bad[..., c, :], f_good[..., c, :])
    return arriving.flatten(-2)[..., :n], after[..., -1]


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


def _parse_number(field: str, text: str) -> float:
    text = text.strip()
    try:
        return float(text[:-1]) / 100.0 if text.endswith("%") else float(text)
    except ValueError:
        raise ValueError(f"{field}={text!r} is not a number") from None


_SPEC_HELP = ("expected none, bernoulli:P, ge:rate=L,burst=B or "
              "ge:p_gb=P,p_bg=R[,loss_bad=X,loss_good=Y]")


def parse_loss_model(spec: Union[str, LossModel, None]) -> LossModel:
    """Build a loss model from a CLI/config spec.

    ``none``, ``bernoulli:0.01`` (or ``bernoulli:1%``), ``ge:rate=0.01,burst=4``,
    ``ge:p_gb=0.001,p_bg=0.2,loss_bad=0.9,loss_good=0``. Raises ValueError
    naming the bad field and value.
    """
    if isinstance(spec, LossModel):
        return spec
    text = "none" if spec is None else str(spec).strip()
    kind, _, args = text.partition(":")
    kind = kind.strip().lower()
    try:
        if kind in ("none", "", "off"):
            if args.strip():
                raise ValueError(f"'none' takes no parameters, got {args!r}")
            return NoLoss()
        if kind in ("bernoulli", "random"):
            value = args.split("=", 1)[1] if args.strip().startswith("p=") else args
            if not value.strip():
                raise ValueError("p is missing (bernoulli:P)")
            p = _parse_number("p", value)
            return NoLoss() if p == 0.0 else Bernoulli(p)
        if kind in ("ge", "gilbert", "gilbert-elliott"):
            fields = {}
            for item in filter(None, (a.strip() for a in args.split(","))):
                key, eq, value = item.partition("=")
                key = key.strip()
                if not eq:
                    raise ValueError(f"{item!r} is not key=value")
                if key not in ("rate", "burst", "p_gb", "p_bg", "loss_bad", "loss_good"):
                    raise ValueError(f"unknown key {key}={value}")
                fields[key] = _parse_number(key, value)
            if "rate" in fields or "burst" in fields:
                extra = set(fields) - {"rate", "burst"}
                if extra:
                    raise ValueError(f"{sorted(extra)[0]}={fields[sorted(extra)[0]]:g} cannot be "
                                     "combined with rate/burst")
                for key in ("rate", "burst"):
                    if key not in fields:
                        raise ValueError(f"{key} is missing (ge:rate=L,burst=B)")
                return GilbertElliott.from_rate(fields["rate"], fields["burst"])
            for key in ("p_gb", "p_bg"):
                if key not in fields:
                    raise ValueError(f"{key} is missing (ge:p_gb=P,p_bg=R)")
            return GilbertElliott(**fields)
        raise ValueError(f"unknown loss model {kind!r}; {_SPEC_HELP}")
    except ValueError as err:
        raise ValueError(f"bad loss spec {text!r}: {err}") from None
