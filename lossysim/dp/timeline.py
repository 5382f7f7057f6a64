"""When a step ends with DDP's bucket all-reduces (see docs/time_model.md, "Data parallelism").

A replica's step runs forward, then backward; compute and its TP collectives are serial on it. Backward
produces gradients in reverse parameter order, so bucket i is ready once backward has done the share
``ready_i`` of the model's local bytes (bytes stand in for FLOPs: a linear layer's backward costs in
proportion to its weights). Bucket all-reduces run one after another on the data-parallel links; a bucket
starts at the later of its readiness and the previous bucket's end. With overlap the step ends at the
later of backward's end and the last bucket's end; without, every bucket waits for backward to end.
"""
from __future__ import annotations

from typing import Sequence


def step_seconds(forward_s: float, backward_s: float, ready: Sequence[float], bucket_s: Sequence[float],
                 overlap: bool = True) -> float:
    """Seconds from the step's start to its end: ``forward_s`` and ``backward_s`` (compute with the TP
    collectives inside them), each bucket's readiness as a share of backward and its all-reduce time."""
    compute_end = forward_s + backward_s
    end = forward_s if overlap else compute_end
    for share, seconds in zip(ready, bucket_s):
        start = max(end, forward_s + share * backward_s) if overlap else end
        end = start + seconds
    return max(compute_end, end)
