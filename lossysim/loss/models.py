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

Masks are drawn per loss *event*, not per packet (``sampling.py``); the Markov-chain models are in
``gilbert_elliott.py`` and ``four_state.py``.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from .sampling import _DENSE_BELOW, Shape, _bernoulli_positions, _flat_chains, _put, _shape, _thin, _zeros


def _check_probability(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0 or math.isnan(value):
        raise ValueError(f"{name}={value:g} is not a probability in [0, 1]")
    return value


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
