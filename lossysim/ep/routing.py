"""How many rows each rank's tokens send each expert rank, as an estimate assumes them (training routes with
the model's own router).

Uniform routing sends each expert ``tokens x top_k / experts`` rows. ``skew`` z makes the experts' popularity
follow Zipf's law, the i-th most popular expert's share of a token's slots proportional to 1 / i^z, the
experts ranked in a seeded random order (so hot experts land on random ranks), each share capped at 1 / top_k
(a token picks top_k distinct experts) and the excess spread over the others. Every rank routes alike;
rank d's experts take ``sum`` of their shares of every sender's rows. The same ranks are hot in every
block (a stated assumption: the worst case for the slowest rank).
"""
from __future__ import annotations

import numpy as np


def expert_shares(experts: int, top_k: int, skew: float = 0.0, seed: int = 0) -> np.ndarray:
    """Each expert's expected share of the routed slots (they sum to 1)."""
    if not (skew >= 0 and np.isfinite(skew)):
        raise ValueError(f"routing_skew={skew} must be a finite number >= 0 (0: uniform)")
    if skew == 0:
        return np.full(experts, 1.0 / experts)
    weights = 1.0 / np.arange(1, experts + 1, dtype=np.float64) ** skew
    shares = np.empty(experts)
    shares[np.random.default_rng(seed).permutation(experts)] = weights / weights.sum()
    cap = 1.0 / top_k
    while (shares > cap * (1 + 1e-12)).any():       # water-filling: the excess goes to the uncapped experts
        over = shares > cap
        excess = (shares[over] - cap).sum()
        shares[over] = cap
        free = shares < cap
        shares[free] += excess * shares[free] / shares[free].sum()
    return shares


def rows(tokens: int, top_k: int, experts: int, ep: int, skew: float = 0.0, seed: int = 0) -> list[list[int]]:
    """``rows[s][d]``: the rows rank s sends rank d (its own: ``rows[s][s]``, kept home): every rank's
    ``tokens x top_k`` assignments over the ranks by their experts' shares, rounded by largest remainder."""
    per_rank = expert_shares(experts, top_k, skew, seed).reshape(ep, -1).sum(1)
    total = tokens * top_k
    exact = per_rank * total
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(-(exact - counts), kind="stable")[:total - counts.sum()]] += 1
    return [counts.tolist() for _ in range(ep)]


def imbalance(top_k: int, experts: int, ep: int, skew: float = 0.0, seed: int = 0) -> float:
    """The busiest rank's expert load over the mean (1: balanced): its experts' compute, and what the step
    waits for."""
    return float(expert_shares(experts, top_k, skew, seed).reshape(ep, -1).sum(1).max() * ep)
