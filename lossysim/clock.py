"""The one step clock of training and the estimate: when a step ends, from what each axis adds to it
(docs/time_model.md, "A step").

Each axis hands its part of a step as a small record; ``step_time`` adds them up:

- ``Compute``: a replica's compute per micro-batch and each stage's share of it (a third forward, two
  thirds backward: 2N FLOPs of 6N);
- ``OnStream`` (tp, ep, cp): seconds serial with the compute on a replica's stream, per stage and
  micro-batch, forward and backward: TP all-reduces, the experts' all-to-alls, what a context exchange adds
  beside its attention (``cp.clock``);
- ``Sends`` (pp): each boundary's activation and gradient per micro-batch; they delay the receiver only;
- ``Buckets`` (dp, fsdp): each stage's gradient buckets (their readiness as a share of backward, their
  seconds), FSDP's gathers before the forward, whether they overlap compute, and what runs after the
  backward (the experts' buckets over their own groups);
- ``Schedule`` (pp): the pipeline schedule a step's stages run (``pp.schedule.pipeline_ends``: every
  replica's at once, ``pipeline_time``'s floats).

``stream`` builds a replica's ``Path`` (its stages' forward and backward seconds) from the first three;
training, which reads its TP and all-to-all seconds off its networks' clock marks around each pass, builds
its own. Without stages the replicas' paths meet at the buckets (``added_seconds``); with them each replica
runs the schedule and each stage's buckets follow its last backward (``pipeline_step_seconds``).

A bucket (DDP) is ready once backward has done the share ``ready_i`` of the model's local bytes (bytes
stand in for FLOPs: a linear layer's backward costs in proportion to its weights). Bucket all-reduces run
one after another on the data-parallel links; a bucket starts at the later of its readiness and the
previous bucket's end. With overlap the step ends at the later of backward's end and the last bucket's
end; without, every bucket waits for backward to end. FSDP first gathers every unit's weights before its
forward (``gathered_forward_seconds``); its reduce-scatters then follow backward as DDP's buckets do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

from .pp.schedule import Ends, pipeline_ends

_THIRD = 1 / 3     # forward's share of a micro-batch's compute (2N FLOPs of 6N)


@dataclass(frozen=True)
class Compute:
    """A replica's compute: ``seconds`` per micro-batch, each stage's share of it (one stage: 1)."""
    seconds: Sequence[float]
    shares: Sequence[float] = (1.0,)

    @property
    def total(self) -> float:
        """The step's compute: equal micro-batches (the estimate's) m times one, else their sum."""
        s = self.seconds
        return len(s) * s[0] if s and all(x == s[0] for x in s) else sum(s)


@dataclass(frozen=True)
class OnStream:
    """One axis's seconds on a replica's compute stream (tp, ep, cp): ``seconds[stage][micro-batch]`` =
    (forward, backward); empty: the axis adds nothing."""
    axis: str
    seconds: Sequence[Sequence[Sequence[float]]] = ()

    def at(self, stage: int, m: int) -> list:
        return list(self.seconds[stage]) if self.seconds else [(0.0, 0.0)] * m


@dataclass(frozen=True)
class Sends:
    """Pipeline boundaries' sends: ``activation[b][micro-batch]``, ``gradient[b][micro-batch]``."""
    activation: Sequence[Sequence[float]] = ()
    gradient: Sequence[Sequence[float]] = ()


@dataclass(frozen=True)
class Buckets:
    """Data-parallel traffic: ``ready[stage]`` (each bucket's readiness), ``seconds[stage]`` (each
    bucket's all-reduce or reduce-scatter), ``gather[stage]`` (FSDP's gathers of the stage's units before
    its forward; none: DDP), ``overlap`` (buckets and gathers overlap compute), ``after`` (seconds after the
    backward: the experts' buckets). No ``seconds``: one replica, nothing to average."""
    ready: Sequence[Sequence[float]] = ()
    seconds: Sequence[Sequence[float]] = ()
    gather: Sequence[float] = ()
    overlap: bool = True
    after: float = 0.0


@dataclass(frozen=True)
class Schedule:
    """A pipeline's schedule (``gpipe``, ``1f1b``) over ``stages`` stages and ``microbatches``."""
    name: str
    stages: int
    microbatches: int


@dataclass(frozen=True)
class Path:
    """One replica's step as its stream runs it: ``forward[stage][micro-batch]``, ``backward`` (compute
    with what is serial on it; a replica without stages may give one sum per pass), its boundaries'
    ``sends``, ``compute_s`` and ``comm_s`` (the compute and the stream's traffic of the step)."""
    forward: Sequence[Sequence[float]]
    backward: Sequence[Sequence[float]]
    sends: Sends = Sends()
    compute_s: float = 0.0
    comm_s: float = 0.0


class Step(NamedTuple):
    """A step's seconds and its parts, named as summary.json and the estimate's columns name them:
    ``compute_s``, ``comm_s`` (replica 0's, without stages), ``pipeline_s`` (the schedule's step, with
    them), ``pp_s`` (what the sends add to it, when asked), ``dp_s`` (what the buckets add), ``dp_after_s``
    (what runs after the backward)."""
    seconds: float
    breakdown: dict


def stream(compute: Compute, *axes: OnStream, sends: Sends = Sends()) -> Path:
    """A replica's path from its compute and the axes serial on its stream (tp, ep, cp, in that order):
    per stage and micro-batch, its share of the compute plus every axis's seconds."""
    m, stages = len(compute.seconds), len(compute.shares)
    per = [[axis.at(s, m) for axis in axes] for s in range(stages)]
    if stages == 1:     # one stage: a third of each micro-batch forward, as training charges it
        forward = backward = comm = 0.0
        for i, c in enumerate(compute.seconds):
            f, b, cm = c / 3, c * 2 / 3, 0.0
            for axis in per[0]:
                f, b = f + axis[i][0], b + axis[i][1]
                cm = cm + axis[i][0] + axis[i][1]
            forward, backward, comm = forward + f, backward + b, comm + cm
        return Path([[forward]], [[backward]], sends, compute.total, comm)
    forward, backward = [], []
    for s, share in enumerate(compute.shares):
        fs, bs = [], []
        for i, c in enumerate(compute.seconds):
            f, b = c * _THIRD * share, c * (2 / 3) * share
            for axis in per[s]:
                f, b = f + axis[i][0], b + axis[i][1]
            fs.append(f)
            bs.append(b)
        forward.append(fs)
        backward.append(bs)
    return Path(forward, backward, sends, compute.total)


def step_time(paths: Sequence[Path], buckets: Buckets = Buckets(), schedule: Optional[Schedule] = None,
              pp_added: bool = False) -> Step:
    """A step's end over every replica's path (replica 0 first; one of each kind whose paths differ will
    do): without ``schedule``, replica 0's compute and stream traffic plus what the slowest replica's path
    and the buckets add (``added_seconds``); with it, the slowest replica's schedule, or later where a
    stage's buckets end later (``pipeline_step_seconds``), each stage's first forward after its FSDP
    gathers (``pipeline_s`` is the schedule without them). Then whatever runs after the backward.
    ``pp_added``: also what the boundaries' sends add (the same schedules with free sends)."""
    if schedule is None:
        first = paths[0]
        seconds = first.compute_s + first.comm_s
        dp_s = 0.0
        if buckets.seconds:
            dp_s = added_seconds([(sum(p.forward[0]), sum(p.backward[0])) for p in paths], buckets.ready[0],
                                 buckets.gather[0] if buckets.gather else (), buckets.seconds[0], buckets.overlap)
            seconds += dp_s
        return Step(seconds + buckets.after, {"compute_s": first.compute_s, "comm_s": first.comm_s, "dp_s": dp_s,
                                              "dp_after_s": buckets.after})
    ends = _schedule(schedule, paths)
    pipeline_s = float(ends.step_s.max())
    if buckets.gather:    # FSDP's gathers delay each stage's first forward: what they add is dp_s's
        ends = _schedule(schedule, [_gathered(p, buckets) for p in paths])
    seconds = pipeline_step_seconds(ends, buckets.ready, buckets.seconds, buckets.overlap)
    parts = {"compute_s": paths[0].compute_s, "pipeline_s": pipeline_s, "dp_s": seconds - pipeline_s,
             "dp_after_s": buckets.after}
    if pp_added:
        parts["pp_s"] = pipeline_s - float(_schedule(schedule, paths, sends=False).step_s.max())
    return Step(seconds + buckets.after, parts)


def _gathered(path: Path, buckets: Buckets) -> Path:
    """``path`` with each stage's first forward waiting for its units' gathers (``reshard_after_forward``
    off: one gather per step), prefetched as without stages (``gathered_forward_seconds``)."""
    forward = [list(stage) for stage in path.forward]
    for s, seconds in enumerate(buckets.gather):
        forward[s][0] = gathered_forward_seconds(forward[s][0], buckets.ready[s], seconds, buckets.overlap)
    return Path(forward, path.backward, path.sends, path.compute_s, path.comm_s)


def _schedule(schedule: Schedule, paths: Sequence[Path], sends: bool = True) -> Ends:
    """Every replica's schedule at once; ``sends`` False: the boundaries' sends free (as a path without)."""
    free = [[0.0] * schedule.microbatches] * (schedule.stages - 1)
    act, grad = ([x if sends and len(x) else free for x in (getattr(p.sends, kind) for p in paths)]
                 for kind in ("activation", "gradient"))
    return pipeline_ends(schedule.name, schedule.stages, schedule.microbatches, [p.forward for p in paths],
                         [p.backward for p in paths], act, grad)


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


def pipeline_step_seconds(ends: Ends, ready: Sequence[Sequence[float]] = (),
                          bucket_s: Sequence[Sequence[float]] = (), overlap: bool = True) -> float:
    """A pipelined step over every replica's schedule (``ends``, ``pp.schedule.pipeline_ends``): the
    slowest replica's end, or later where a stage's buckets end later. A stage's gradients are final once
    its last backward ends (accumulation over micro-batches): its buckets (``ready[s]``, ``bucket_s[s]``)
    fill during that backward, on every replica, and overlap it as DDP's do."""
    step = float(ends.step_s.max())
    for stage, (shares, seconds) in enumerate(zip(ready, bucket_s)):
        if not seconds:
            continue
        start, end = (float(ends.last_backward[:, stage, k].max()) for k in (0, 1))
        step = max(step, step_seconds(start, end - start, shares, seconds, overlap))
    return step
