"""The pipeline clock: when a step of micro-batches ends under a pipeline schedule (docs/pipeline.md).

Each stage runs its forwards (F) and backwards (B) one at a time in the schedule's fixed order; an
op starts when its stage is free and its input is there. F(s, i) needs F(s-1, i) and the activation
message of boundary s-1; B(s, i) needs B(s+1, i) and the gradient message of boundary s; B(p-1, i)
needs F(p-1, i). Messages travel on the NIC, not the compute stream: they delay the receiver only.
With a fixed order per stage, each op's start is the later of those two times, so walking the ops in
dependency order gives the exact critical path (list scheduling on a max-plus system).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import numpy as np

from ..config import PP_SCHEDULES
from ..util import one_of

# the schedules config validates pp_schedule against: one tuple, defined where the key is
SCHEDULES = PP_SCHEDULES


class Op(NamedTuple):
    """One forward or backward of one micro-batch on one stage, and when it ran."""
    stage: int
    kind: str          # "F" or "B"
    microbatch: int
    start: float
    end: float


@dataclass(frozen=True)
class PipelineTiming:
    """One step of a pipeline schedule.

    ``busy_s[s]`` is stage s's compute (its forwards and backwards); ``bubble`` is the share of the
    step a stage idles, averaged over stages: ``1 - mean(busy_s) / step_s``; ``bubble_ratio`` is that
    idle time over the compute: ``step_s / mean(busy_s) - 1``. Loss-free with equal stages and no
    transfer time they are (p-1)/(m+p-1) and (p-1)/m. Message time counts as idle: it is not compute.
    ``peak_in_flight``: the most micro-batches whose activations stage 0 holds at once; ``timeline``:
    every op, stage by stage in the order it ran.
    """
    schedule: str
    stages: int
    microbatches: int
    step_s: float
    busy_s: tuple[float, ...]
    bubble: float
    bubble_ratio: float
    peak_in_flight: int
    timeline: tuple[Op, ...]


@functools.lru_cache(maxsize=64)
def stage_ops(schedule: str, stages: int, microbatches: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Each stage's ops, ``(kind, microbatch)``, in the order the schedule runs them.

    gpipe: F0..F(m-1), then B0..B(m-1), the order torch's ScheduleGPipe runs them. 1f1b (Megatron):
    min(p-s-1, m) warm-up forwards, then one forward and one backward at a time, then the rest of the
    backwards."""
    _check_shape(schedule, stages, microbatches)
    m = microbatches
    if schedule == "gpipe":
        order = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
        return tuple(tuple(order) for _ in range(stages))
    orders = []
    for s in range(stages):
        warmup = min(stages - s - 1, m)
        order = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i), ("B", i)]
        order += [("B", i) for i in range(m - warmup, m)]
        orders.append(tuple(order))
    return tuple(orders)


def pipeline_time(schedule: str, stages: int, microbatches: int, forward_s, backward_s,
                  activation_s=0.0, gradient_s=0.0) -> PipelineTiming:
    """The step of ``microbatches`` micro-batches through ``stages`` stages under ``schedule``.

    ``forward_s``, ``backward_s``: one micro-batch's compute seconds on a stage, as a number (every
    stage), one per stage, or a [stages][microbatches] array. ``activation_s``, ``gradient_s``: the
    seconds of one micro-batch's message over the boundary between stage s and s+1 (with its
    repairs), as a number, one per boundary, or a [stages-1][microbatches] array."""
    _check_shape(schedule, stages, microbatches)
    p, m = stages, microbatches
    f = _per_op("forward_s", forward_s, p, m)
    b = _per_op("backward_s", backward_s, p, m)
    act = _per_op("activation_s", activation_s, p - 1, m)
    grad = _per_op("gradient_s", gradient_s, p - 1, m)
    plan = _dependency_order(schedule, p, m)
    starts, ends = (times[:, 0].tolist() for times in _times(plan, *(x[..., None] for x in (f, b, act, grad))))
    ops: list[list[Op]] = [[] for _ in range(p)]
    free = [0.0] * p
    busy = [0.0] * p     # summed in the order the stage runs: with no idle it equals the stage's end exactly
    f, b = f.tolist(), b.tolist()
    for (s, kind, i, _, _), start, end in zip(plan, starts, ends):
        busy[s] += (f if kind == "F" else b)[s][i]
        free[s] = end
        ops[s].append(Op(s, kind, i, start, end))

    step = max(free)
    mean_busy = sum(busy) / p
    if step == 0:
        bubble, ratio = 0.0, 0.0
    elif mean_busy == 0:       # only messages take time: all idle, no compute to compare it with
        bubble, ratio = 1.0, math.inf
    else:
        bubble, ratio = 1.0 - mean_busy / step, step / mean_busy - 1.0
    return PipelineTiming(schedule, p, m, step, tuple(busy), bubble, ratio,
                          _peak_in_flight(stage_ops(schedule, p, m)[0]), tuple(op for stage in ops for op in stage))


class Ends(NamedTuple):
    """``pipeline_time``'s step end for each of R replicas (``step_s[r]``) and the start and end of each
    stage's last backward (``last_backward[r, s]``), where the stage's gradients are final."""
    step_s: np.ndarray
    last_backward: np.ndarray


def pipeline_ends(schedule: str, stages: int, microbatches: int, forward_s, backward_s, activation_s=None,
                  gradient_s=None) -> Ends:
    """``pipeline_time``'s ends for R replicas at once (the same pass, ``_times``, every replica side by
    side): ``forward_s``, ``backward_s`` as [R][stages][microbatches] arrays, ``activation_s``,
    ``gradient_s`` as [R][stages-1][microbatches] (None: free). A step's clock asks for a hundred
    replicas' schedules (a 405B job's dp 128) and reads these alone."""
    _check_shape(schedule, stages, microbatches)
    p, m = stages, microbatches
    f, b = (_replicas(name, value, p, m) for name, value in (("forward_s", forward_s), ("backward_s", backward_s)))
    r = f.shape[-1]
    act, grad = (np.zeros((p - 1, m, r)) if value is None else _replicas(name, value, p - 1, m, r)
                 for name, value in (("activation_s", activation_s), ("gradient_s", gradient_s)))
    plan = _dependency_order(schedule, p, m)
    start, end = _times(plan, f, b, act, grad)
    last = np.zeros((p, 2, r))
    for k, (s, kind, _, _, _) in enumerate(plan):
        if kind == "B":   # the stage's backwards run in its order: the last one written is its last
            last[s, 0], last[s, 1] = start[k], end[k]
    return Ends(end.max(axis=0), last.transpose(2, 0, 1))   # (a stage's ends only grow: the last is its end)


def _times(plan, f, b, act, grad) -> tuple[np.ndarray, np.ndarray]:
    """Each op's start and end (``[op, replica]``, ops in ``plan``'s order) from its stage's compute
    (``f``, ``b``: [stage][micro-batch][replica]) and the boundaries' messages (``act``, ``grad``): an op
    starts once its stage is free and what it waits on has arrived, so one pass in dependency order is the
    schedule. Every replica's in one float64 add and maximum per op (IEEE, element by element: one
    replica's floats are those of a scalar loop)."""
    p, r = f.shape[0], f.shape[-1]
    free = np.zeros((p, r))
    start, end = np.empty((len(plan), r)), np.empty((len(plan), r))
    for k, (s, kind, i, needs, message) in enumerate(plan):
        if needs < 0:
            start[k] = free[s]
        elif message == "act":
            np.maximum(free[s], end[needs] + act[s - 1, i], out=start[k])
        elif message == "grad":
            np.maximum(free[s], end[needs] + grad[s, i], out=start[k])
        else:
            np.maximum(free[s], end[needs], out=start[k])
        free[s] = end[k] = start[k] + (f if kind == "F" else b)[s, i]
    return start, end


def _replicas(name: str, value, rows: int, m: int, replicas: Optional[int] = None) -> np.ndarray:
    """``value``, [R][rows][m] seconds, as a [rows][m][R] float array (each op's replicas side by side)."""
    arr = np.asarray(value, dtype=float)
    if arr.ndim != 3 or arr.shape[1:] != (rows, m) or (replicas is not None and len(arr) != replicas):
        raise ValueError(f"{name} must be a replicas x {rows} x {m} array, got shape {arr.shape}")
    if not (np.isfinite(arr) & (arr >= 0)).all():
        raise ValueError(f"{name} must be finite seconds >= 0")
    return np.ascontiguousarray(arr.transpose(1, 2, 0))


def timeline_plot(timing: PipelineTiming, path_or_ax):
    """A Gantt chart of ``timing.timeline``, stage 0 on top: written to a file (returns the path) or
    drawn on a matplotlib Axes (returns it)."""
    from matplotlib.figure import Figure   # lazily: the clock itself needs no plotting

    own = not hasattr(path_or_ax, "barh")
    if own:
        fig = Figure(figsize=(max(6.0, 0.35 * len(timing.timeline)), 0.6 * timing.stages + 1.4))
        ax = fig.add_subplot()
    else:
        ax = path_or_ax
    colours = {"F": "#8ab6d6", "B": "#e3a45f"}
    for op in timing.timeline:
        ax.barh(op.stage, op.end - op.start, left=op.start, height=0.8, color=colours[op.kind],
                edgecolor="black", linewidth=0.5)
        ax.text((op.start + op.end) / 2, op.stage, f"{op.kind}{op.microbatch}", ha="center", va="center",
                fontsize=7)
    ax.set_yticks(range(timing.stages), [f"stage {s}" for s in range(timing.stages)])
    ax.set_ylim(timing.stages - 0.5, -0.5)
    ax.set_xlim(0, timing.step_s or 1.0)
    ax.set_xlabel("seconds")
    ax.set_title(f"{timing.schedule}: {timing.stages} stages, {timing.microbatches} micro-batches, "
                 f"step {timing.step_s:.3g} s, bubble {timing.bubble:.0%} of the step")
    if not own:
        return ax
    fig.tight_layout()
    fig.savefig(path_or_ax, dpi=120)
    return path_or_ax


def _check_shape(schedule: str, stages: int, microbatches: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule={schedule!r} must be {one_of(SCHEDULES)}")
    for name, value in (("pp_size", stages), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")


def _per_op(name: str, value, rows: int, m: int) -> np.ndarray:
    """``value`` as a [rows][m] float array: a number for all, one per row, or the array itself."""
    try:
        arr = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be numbers of seconds, got {value!r}") from None
    if arr.ndim == 0:
        arr = np.full((rows, m), float(arr))
    elif arr.shape == (rows,):
        arr = np.repeat(arr[:, None], m, axis=1)
    elif arr.shape != (rows, m):
        raise ValueError(f"{name} must be a number, {rows} numbers or a {rows} x {m} array, "
                         f"got shape {arr.shape}")
    bad = ~(np.isfinite(arr) & (arr >= 0))
    if bad.any():
        where = tuple(int(k) for k in np.argwhere(bad)[0])
        raise ValueError(f"{name} must be finite seconds >= 0, got {arr[where]} at {list(where)}")
    return arr


@functools.lru_cache(maxsize=64)
def _dependency_order(schedule: str, p: int, m: int) -> tuple[tuple[int, str, int, int, str], ...]:
    """Every op ``(stage, kind, microbatch, needs, message)`` in an order that runs each after the op it
    waits on (``needs``, its index here; -1: none) and after its stage's earlier ops; ``message`` the
    message between them ("act", "grad" or ""). Which ops can run depends on which have, never on when, so
    the order is worked out once per shape and every step's times are one pass over it."""
    orders = stage_ops(schedule, p, m)
    done: dict[tuple[int, str, int], int] = {}
    plan, nxt = [], [0] * p
    while len(plan) < 2 * p * m:
        progressed = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                kind, i = orders[s][nxt[s]]
                if kind == "F":
                    wait, message = ((s - 1, "F", i), "act") if s > 0 else (None, "")
                else:
                    wait, message = ((s, "F", i), "") if s == p - 1 else ((s + 1, "B", i), "grad")
                if wait is not None and wait not in done:
                    break
                done[s, kind, i] = len(plan)
                plan.append((s, kind, i, -1 if wait is None else done[wait], message))
                nxt[s] += 1
                progressed = True
        if not progressed:  # a schedule whose orders wait on each other: a bug here, not bad input
            raise RuntimeError(f"{schedule}: stages wait on each other at ops {nxt}")
    return tuple(plan)


def _peak_in_flight(order: Sequence[tuple[str, int]]) -> int:
    """The most micro-batches whose activations a stage holds at once: forwarded, not yet backwarded."""
    alive = peak = 0
    for kind, _ in order:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    return peak
