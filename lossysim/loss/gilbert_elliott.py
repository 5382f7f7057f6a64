"""netem's Gilbert-Elliott loss model (``loss gemodel``): a two-state Markov chain stepped once per
packet, its masks drawn per sojourn (``sampling.py``)."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from .models import LossModel, _check_probability
from .sampling import (_DENSE_BELOW, _alternating, _flat_chains, _float64, _range_indices, _scan_chain,
                       _segments_to_masks, _shape, _sojourn_masks)


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
        ends, state = sojourns
        bad = state.unsqueeze(-1) ^ (torch.arange(ends.shape[1], device=ends.device) % 2 == 1)
        starts = torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1]], 1)
        return _range_indices(*_segments_to_masks(starts, ends, bad, width)).numpy(), next_state

    def _bad(self, shape, generator, state, used):
        """The chains' states of a draw of ``shape``, the part of ``sample_with_states`` that
        ``lost_positions`` shares: ``(in_bad, sojourns, next_state)``, ``in_bad`` the ``[chains, packets]``
        mask of a short call (one uniform per packet) and ``sojourns`` None, or for a long one ``in_bad``
        None and ``sojourns`` ``(ends, state)``: the sojourns' ends ``[chains, J]`` (``_alternating``) and
        the chains' states in their first."""
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
        which = torch.searchsorted(ends, used.unsqueeze(-1), right=True).squeeze(-1)
        return None, (ends, state), state ^ (which % 2 == 1)

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
        lost, in_bad = _sojourn_masks(*sojourns, packets, self.loss_bad, self.loss_good, generator)
        return lost.view(shape), in_bad.view(shape), next_state.view(shape[:-1])
