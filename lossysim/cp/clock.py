"""What a context group's exchange adds to a step: the seconds of its rounds not hidden behind attention.

``ring``: round s's sends carry the block the next attention step needs while the rank computes attention
with the block it already holds (Megatron overlaps each step's send and compute), so a round costs the longer
of the two and adds ``max(0, send - compute)``: a repaired block delays only what waits for it. ``allgather``:
the all-gather comes before the attention that reads it (and the reduce-scatter after the backward that
wrote its gradients): every second of it is added. Training (``lossysim.cp.context``) and the estimate
(``lossysim.estimate.simulate``) end their steps with these same functions.
"""
from __future__ import annotations

from typing import Sequence


def attention_step_flops(batch: int, seq: int, hidden: int, tp: int, cp: int, direction: str = "fwd") -> float:
    """FLOPs one rank spends on one ring step's attention in one layer: attention's 4 s^2 h per sequence and
    layer forward (its two matmuls; twice that backward, as ``lossysim.models.cost`` counts it), shared by
    the tp x cp ranks and the cp steps."""
    forward = 4.0 * seq ** 2 * hidden * batch / (tp * cp * cp)
    return forward if direction == "fwd" else 2 * forward


def exposed(mode: str, rounds: Sequence[float], compute_s: float) -> float:
    """Seconds an exchange's ``rounds`` (each its slowest send's, or the collective's) add beside
    ``compute_s`` of attention per ring step."""
    if mode == "allgather":
        return float(sum(rounds))
    return float(sum(max(0.0, r - compute_s) for r in rounds))
