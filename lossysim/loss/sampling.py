"""The draws behind the loss models (``models.py``, ``gilbert_elliott.py``, ``four_state.py``): masks drawn
per loss *event*.

The gaps between independent losses and the sojourn times of a Markov chain are geometric, so they are
drawn directly (inverse CDF of float64 uniforms) and written into a zero mask. The work grows with the
number of losses and state changes, not with the packets. Short calls draw one uniform per packet
instead (``_DENSE_BELOW``).
"""
from __future__ import annotations

import math
from typing import Sequence, Union

import numpy as np
import torch

from . import kernels

Shape = Union[int, Sequence[int]]


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


def _thin(total: int, p: float, generator: torch.Generator, xp=torch):
    """``(positions, value)``: i.i.d. Bernoulli(p) over [0, total) as sparse positions (in ``xp``).

    value True: the successes are ``positions``. value False (p > 1/2): every
    position succeeds except ``positions``, so the events drawn stay <= total / 2.
    """
    if p > 0.5:
        return _bernoulli_positions(total, 1.0 - p, generator, xp), False
    return _bernoulli_positions(total, p, generator, xp), True


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


def _repeat(values, counts, total: int):
    """values[j] repeated counts[j] times, concatenated, ``total`` in all; numpy arrays give a numpy
    array. On a CPU through numpy (faster than torch's), byte values through the compiled
    ``kernels.repeat_into`` where numba is (faster again on short runs)."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            return torch.repeat_interleave(values, counts, output_size=total)
        return torch.from_numpy(_repeat(values.numpy(), counts.numpy(), total))
    fill = kernels.compiled("repeat_into") if values.itemsize == 1 else None
    if fill is None:
        return np.repeat(values, counts)
    out = np.empty(total + 8, dtype=values.dtype)
    if fill(out, values, counts) != total:
        raise ValueError(f"the counts do not sum to {total}")
    return out[:total]


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


_SEARCH_OVER_REPEAT = 8  # a binary search per position costs about what writing 8 packets' offsets does


def _in_ranges(base, lengths, total: int, pos, xp=torch):
    """Flat packet indices of positions ``pos`` (sorted) of the ranges laid end to end into one
    coordinate of ``total`` packets: range j holds base[j] .. base[j] + lengths[j] - 1."""
    ends = lengths.cumsum(0)
    shift = base - ends + lengths
    if total <= _SEARCH_OVER_REPEAT * len(pos):  # dense: every packet's shift, then look each one up
        return _repeat(shift, lengths, total)[pos] + pos
    j = np.searchsorted(ends, pos, side="right") if xp is np else torch.searchsorted(ends, pos, right=True)
    return shift[j] + pos


def _mark(lost, base, lengths, total: int, pos, value: bool, xp) -> None:
    """``lost[_in_ranges(base, lengths, total, pos)] = value``; on a CPU with numba (the ``fast``
    extra) in one compiled walk along the positions and the ranges, with no index array (the same
    packets)."""
    walk = kernels.compiled("walk_ranges") if xp is np else None
    if walk is None:
        lost[_in_ranges(base, lengths, total, pos, xp)] = value
    else:
        ends = lengths.cumsum(0)
        walk(lost, ends, base - ends + lengths, pos, value)


def _sojourn_masks(ends: torch.Tensor, state: torch.Tensor, packets: int, loss_bad: float, loss_good: float,
                   generator: torch.Generator, xp=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ``(lost, in_bad)`` masks of two-state chains over ``packets`` from their sojourn ends
    (``_alternating``, state 1 = Bad): the Bad packets lose i.i.d. ``loss_bad``, then the Good ones
    ``loss_good``, each drawn as one sequence of events over its packets laid end to end.

    Clipped to the call, the sojourns tile each chain's packets, so ``in_bad`` is their states
    repeated, written once (no index list, no zero fill). On a CPU the small arrays go through numpy
    (``xp``), whose calls cost less; torch's path, a GPU's, gives the same masks from the same draws.
    """
    device = generator.device
    if xp is None:
        xp = np if device.type == "cpu" else torch
    chains, sojourns = ends.shape
    if xp is np:
        ends, state = ends.numpy(), state.numpy()
        bad = np.empty((chains, sojourns), dtype=np.bool_)
        bad[:, 0::2], bad[:, 1::2] = state[:, None], ~state[:, None]
        bad = bad.reshape(-1)
        chain_base = np.arange(chains)[:, None] * packets
    else:
        odd = torch.arange(sojourns, device=device).bitwise_and_(1).bool()
        bad = (state[:, None] ^ odd).reshape(-1)
        chain_base = torch.arange(chains, device=device).unsqueeze(-1) * packets
    clipped = ends.clip(max=packets)
    length = clipped.copy() if xp is np else clipped.clone()
    length[:, 1:] -= clipped[:, :-1]
    base = (clipped - length + chain_base).reshape(-1)
    length = length.reshape(-1)
    total = chains * packets
    in_bad = _repeat(bad, length, total)

    def copy_of_in_bad():
        if sojourns * _DENSE_SEGMENTS >= packets:  # short sojourns: one memcpy beats repeating each
            return in_bad.copy() if xp is np else in_bad.clone()
        return _repeat(bad, length, total)          # long ones: repeating again reads nothing

    def zeros():
        return np.zeros(total, dtype=np.bool_) if xp is np else _zeros(total, device)

    bad_len = length * bad
    if loss_bad == 1.0:
        lost = copy_of_in_bad()
    elif loss_bad == 0.0:
        lost = zeros()
    else:
        n_bad = int(bad_len.sum())
        pos, value = _thin(n_bad, loss_bad, generator, xp)
        lost = zeros() if value else copy_of_in_bad()
        _mark(lost, base, bad_len, n_bad, pos, value, xp)
    if loss_good == 1.0:
        lost |= ~in_bad
    elif loss_good > 0.0:
        good_len = length - bad_len
        n_good = int(good_len.sum())
        pos, value = _thin(n_good, loss_good, generator, xp)
        if not value:
            lost |= ~in_bad
        _mark(lost, base, good_len, n_good, pos, value, xp)
    if xp is np:
        return torch.from_numpy(lost), torch.from_numpy(in_bad)
    return lost, in_bad


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
    # One (state 0, state 1) pair of scales per chain, broadcast over the block's column pairs.
    pair = torch.tensor([-1.0 / lam0 if lam0 > 0 else -math.inf, -1.0 / lam1 if lam1 > 0 else -math.inf],
                        dtype=torch.float64, device=device)
    scale = torch.where(start.view(chains, 1, 1), pair.flip(0), pair)
    parts, offset = [], torch.zeros(chains, 1, dtype=torch.int64, device=device)
    while True:
        u = torch.rand((chains, size), generator=generator, device=device, dtype=torch.float64)
        x = u.neg_().log1p_()
        x.view(chains, size // 2, 2).mul_(scale)
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
