"""netem's 4-state loss model (``loss state``), stepped as its loss_4state: masks drawn per sojourn,
a block of slots at a time (``kernels.four_state_slots`` where numba is, numpy or torch otherwise)."""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import numpy as np
import torch

from . import kernels
from .models import LossModel, _check_probability
from .sampling import (_MAX_EXPONENTIAL, _SPARE_FIXED, _alternating, _block_size, _exponentials, _flat_chains,
                       _float64, _geometric, _hazard, _repeat, _shape)


def _cap(x, lam: float, cap: int) -> None:
    """Clamp geometric draws x = E / lam (a tensor or a numpy array) at ``cap`` in place where one could
    exceed it; a rate 0 (inf, or nan from 0 / 0) is the cap, as ``_geometric`` has it."""
    if isinstance(x, np.ndarray):
        if lam == 0.0:
            np.nan_to_num(x, copy=False, nan=cap, posinf=cap)
        if lam == 0.0 or _MAX_EXPONENTIAL / lam > cap:
            np.minimum(x, cap, out=x)
        return
    if lam == 0.0:
        x.nan_to_num_(nan=cap, posinf=cap)
    if lam == 0.0 or _MAX_EXPONENTIAL / lam > cap:
        x.clamp_(max=cap)


def _array_module(device: torch.device):
    """Where a 4-state block's arithmetic runs: numpy on a CPU (its calls cost less), torch on a GPU; the
    same IEEE operations on the same draws, so the same segments either way (tests/test_loss_models.py)."""
    return np if device.type == "cpu" else torch


_CODE_OF_STATE = torch.tensor([0, 0, 2, 3, 1], dtype=torch.uint8)   # indexed by the state, 1..4
_STATE_OF_CODE = torch.tensor([1, 4, 2, 3])


class _Rates(NamedTuple):
    """A 4-state chain's sojourn rates (``_hazard``) and the negated scales its lengths are drawn with."""
    lam_gap: float
    lam_burst: float
    lam_2: float
    neg_gap: object        # -lam_gap: a float, or a tensor on a GPU
    neg_burst: object
    neg_rate_2: float      # -1 / lam_2; -0.0 at lam_2 = inf, -inf at 0

    @classmethod
    def of(cls, model: "FourState", device) -> "_Rates":
        lam_gap, lam_burst = _hazard(model.p13 + model.p14), _hazard(model.p31 + model.p32)
        lam_2 = _hazard(model.p23)
        neg_rate_2 = -1.0 / lam_2 if 0 < lam_2 < math.inf else -0.0 if lam_2 > 0 else -math.inf
        if torch.device(device).type == "cpu":
            return cls(lam_gap, lam_burst, lam_2, -lam_gap, -lam_burst, neg_rate_2)
        return cls(lam_gap, lam_burst, lam_2, _float64(-lam_gap, device), _float64(-lam_burst, device), neg_rate_2)


def _block(xp, x, phase_ends, burst, head, offset, rates: _Rates, cover: int):
    """One block's segments ``(length, code, end, burst)``: each chain's sojourns' lengths, codes
    (lost | in_bad << 1: state 1: 0, 4: 1, 2: 2, 3: 3) and exclusive ends (from ``offset``, the last
    block's last end, or 0), led by ``head`` (``(length, code)`` of a leading segment) in the first
    block, and the chains' periods after it. Slot s's primary is 1 + floor(E / lam) packets from -E =
    ``x[:, s, 0]``, its secondary 1 + floor(E' / lam_2) in a burst, 1 in a gap (a single 4), 0 where its
    period ends (``phase_ends``). In one compiled pass where numba is, else in ``xp`` (numpy on a
    CPU, torch on a GPU): the same IEEE operations, so the same integers."""
    chains, slot, first = x.shape[0], x.shape[1], int(head is not None)
    empty, arange = (np.empty, np.arange) if xp is np else (functools.partial(torch.empty, device=x.device),
                                                          functools.partial(torch.arange, device=x.device))
    length = empty((chains, first + 2 * slot), dtype=xp.int64)
    code = empty((chains, first + 2 * slot), dtype=xp.uint8)
    if head is not None:
        length[:, 0], code[:, 0] = head
    compiled = kernels.compiled("four_state_slots") if xp is np else None
    if compiled is not None:
        end = np.empty_like(length)
        offset = np.zeros(chains, dtype=np.int64) if offset is None else np.ascontiguousarray(offset[:, 0])
        after = compiled(x, phase_ends, burst, rates.neg_gap, rates.neg_burst, rates.neg_rate_2, float(cover),
                         length, code, end, offset, first)
        return length, code, end, after
    phase_len = phase_ends.copy() if xp is np else phase_ends.clone()
    phase_len[:, 1:] -= phase_ends[:, :-1]
    odd = (arange(phase_ends.shape[1]) & 1) == 1
    in_burst = _repeat((burst[:, None] ^ odd).reshape(-1), phase_len.reshape(-1),
                       chains * (slot + 1)).reshape(chains, slot + 1)    # phase of slots 0..slot
    ends_period = in_burst[:, 1:] != in_burst[:, :-1]
    in_burst = in_burst[:, :-1]
    pair, code_pair = length[:, first:].reshape(chains, slot, 2), code[:, first:].reshape(chains, slot, 2)
    primary = x[..., 0] / xp.where(in_burst, rates.neg_burst, rates.neg_gap)
    secondary = x[..., 1] * rates.neg_rate_2
    _cap(primary, min(rates.lam_gap, rates.lam_burst), cover)
    _cap(secondary, rates.lam_2, cover)
    # Casts truncate, which is floor here (draws >= 0); every length is 1 + its draw: a secondary's
    # draw is 0 in a gap (a single 4) and -1 where the period ends (no secondary).
    pair[..., 0] = primary
    pair[..., 1] = secondary
    pair[..., 1] *= in_burst
    pair[..., 1] -= ends_period * (pair[..., 1] + 1)   # -1 where the period ends
    pair += 1
    burst_code = in_burst.view(xp.uint8)
    code_pair[..., 0] = burst_code * 3
    code_pair[..., 1] = burst_code + 1
    end = length.cumsum(1)
    if offset is not None:
        end += offset
    return length, code, end, in_burst[:, -1] ^ ends_period[:, -1]


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
        rates = _Rates.of(self, device)
        lead = torch.where(state == 4, 1, 0)
        e = _exponentials(chains, generator)
        lead = torch.where(state == 2, _geometric(e, rates.lam_2, cover) + 1, lead)
        burst = (state == 2) | (state == 3)
        slot = self._slot_size(cover)
        # A segment is a sojourn: its length, its code and its end (exclusive, steps from -1), ``_block``.
        xp = _array_module(device)
        if xp is np:
            burst, lead, state_code = burst.numpy(), lead.numpy(), _CODE_OF_STATE.numpy()[state.numpy()]
        else:
            state_code = _CODE_OF_STATE.to(device)[state]
        lengths, codes, ends, head = [], [], [], (lead, state_code)   # the first block leads with a segment
        while True:
            phase_ends = _alternating(torch.as_tensor(burst), slot + 1, leave_gap, leave_burst,
                                      generator).clamp_(max=slot + 1)
            x = torch.rand((chains, slot, 2), generator=generator, device=device, dtype=torch.float64)
            x = x.neg_().log1p_()                                               # -E, as _exponentials
            if xp is np:
                phase_ends, x = phase_ends.numpy(), x.numpy()
            length, code, end, burst = _block(xp, x, phase_ends, burst, head, ends[-1][:, -1:] if ends else None,
                                              rates, cover)
            lengths.append(length)
            codes.append(code)
            ends.append(end)
            head = None
            if chains == 0 or int(end[:, -1].min()) >= cover:
                break
        if xp is np:
            lengths, codes, ends = ([torch.from_numpy(a) for a in x] for x in (lengths, codes, ends))
        length, codes, ends = (torch.cat(x, 1) if len(x) > 1 else x[0] for x in (lengths, codes, ends))
        which = torch.searchsorted(ends, used.unsqueeze(-1), right=True)
        next_state = _STATE_OF_CODE.to(device)[codes.gather(1, which).squeeze(-1).long()]
        # Clipped to the call's packets, steps 1 .. cover - 1 of each segment's [end - length, end): only
        # the first two segments (where step 0, the packet before the call, lies) and the last ones change.
        tail = int(torch.searchsorted(ends, torch.full((chains, 1), cover, device=device), right=True).min()) \
            if chains else 0
        for lo, hi in ((0, min(2, tail)), (tail, ends.shape[1])):
            end = ends[:, lo:hi]
            length[:, lo:hi] = end.clamp(max=cover).sub_((end - length[:, lo:hi]).clamp_(min=1)).clamp_(min=0)
        code = _repeat(codes.flatten(), length.flatten(), chains * packets)
        if device.type == "cpu":    # numpy's bitwise ops are several times faster; lost overwrites the codes
            code = code.numpy()
            in_bad = torch.from_numpy(code >> 1)
            lost = torch.from_numpy(np.bitwise_and(code, 1, out=code))
        else:
            in_bad, lost = code >> 1, code.bitwise_and_(1)
        return lost.view(torch.bool).view(shape), in_bad.view(torch.bool).view(shape), next_state.view(shape[:-1])

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
