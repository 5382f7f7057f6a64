"""When a step ends with DDP's bucket all-reduces (see docs/time_model.md, "Data parallelism").

A replica's step runs forward, then backward; compute and its TP collectives are serial on it. Backward
produces gradients in reverse parameter order, so bucket i is ready once backward has done the share
``ready_i`` of the model's local bytes (bytes stand in for FLOPs: a linear layer's backward costs in
proportion to its weights). Bucket all-reduces run one after another on the data-parallel links; a bucket
starts at the later of its readiness and the previous bucket's end. With overlap the step ends at the
later of backward's end and the last bucket's end; without, every bucket waits for backward to end.
FSDP first gathers every unit's weights before its forward (``gathered_forward_seconds``); its
reduce-scatters then follow backward as DDP's buckets do.

Training and the estimate both end a step here: without pipeline stages, ``added_seconds`` (what the
data-parallel traffic adds to replica 0's compute and TP traffic); with them, ``pipeline_step_seconds``
(the slowest replica's schedule, each stage's buckets overlapping its last backward).
"""
from __future__ import annotations

from typing import Sequence

from ..pp.schedule import PipelineTiming


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


def gathered_forward_seconds(forward_s: float, ready: Sequence[float], gather_s: Sequence[float],
                             overlap: bool = True) -> float:
    """FSDP: seconds until the forward ends when every unit's weights are all-gathered before it runs.

    Units run forward in the reverse of their (backward) order, each computing its share of the
    forward (its bytes: ``ready`` is the cumulative share in backward order). With overlap, a unit's
    gather is issued when the previous unit starts computing (FSDP's prefetch of one unit ahead), the
    gathers one after another on the data-parallel links; without, every gather precedes the forward."""
    if not gather_s:
        return forward_s
    if not overlap:
        return sum(gather_s) + forward_s
    shares = [b - a for a, b in zip([0.0, *ready[:-1]], ready)]
    links = computed = started = 0.0
    for share, seconds in reversed(list(zip(shares, gather_s))):
        links = max(links, started) + seconds        # this unit's gather ends
        started = max(computed, links)               # its forward starts once its weights are here
        computed = started + share * forward_s
    return computed


def added_seconds(times: Sequence[Sequence[float]], ready: Sequence[float], gather_s: Sequence[float],
                  bucket_s: Sequence[float], overlap: bool = True) -> float:
    """What data parallelism adds to replica 0's step, given every replica's (forward, backward) seconds
    (compute and TP traffic): the slowest replica's forward, FSDP's gathers before it, then the slowest
    backward and the buckets it waits for, less replica 0's own forward and backward."""
    slowest_forward, slowest_backward = max(t[0] for t in times), max(t[1] for t in times)
    forward_end = gathered_forward_seconds(slowest_forward, ready, gather_s, overlap)
    end = step_seconds(forward_end, slowest_backward, ready, bucket_s, overlap)
    return end - times[0][0] - times[0][1]


def pipeline_step_seconds(timings: Sequence[PipelineTiming], ready: Sequence[Sequence[float]] = (),
                          bucket_s: Sequence[Sequence[float]] = (), overlap: bool = True) -> float:
    """A pipelined step over every replica's schedule (``timings``): the slowest replica's end, or later
    where a stage's buckets end later. A stage's gradients are final once its last backward ends
    (accumulation over micro-batches): its buckets (``ready[s]``, ``bucket_s[s]``) fill during that
    backward, on every replica, and overlap it as DDP's do."""
    step = max(t.step_s for t in timings)
    for stage, (shares, seconds) in enumerate(zip(ready, bucket_s)):
        if not seconds:
            continue
        last = [[op for op in t.timeline if op.stage == stage and op.kind == "B"][-1] for t in timings]
        start, end = max(op.start for op in last), max(op.end for op in last)
        step = max(step, step_seconds(start, end - start, shares, seconds, overlap))
    return step
