"""The estimate's clock: one step's end from its messages' seconds, as training ends it (docs/estimate.md,
"The clock").

Compute per micro-batch as a training run models it (``timing.compute``), a stage's share by its FLOPs, a
third forward and two thirds backward, plus its TP traffic; with stages, the schedule's critical path
(``pipeline_time``); DDP's buckets overlap backward and FSDP's gathers are prefetched one unit ahead as
``dp.timeline`` says. ``Clock.step`` ends a step with loss or loss-free, any class's messages taken away,
which is how an estimate's per-class columns and stack are read.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..config import EP_CLASSES, ExperimentConfig
from ..dp import timeline
from ..pp.schedule import pipeline_time

_THIRD = 1 / 3     # forward's share of a micro-batch's compute (2N FLOPs of 6N), as training charges it


class Clock:
    """One step's end from its parts' seconds (``k`` 0: with loss, 1: loss-free), any class zeroed."""

    # a class's times (the experts' buckets are data-parallel traffic)
    KEYS = {"tp": ("tp",), "pp": ("pp",), "dp": ("bucket", "expert_bucket"), "fsdp": ("bucket", "gather"),
            **{cls: (cls,) for cls in EP_CLASSES}, "cp": ("cp",)}

    def __init__(self, times: dict, micro_s: float, shares: list[float], config: ExperimentConfig, pp: int, dp: int,
                 m: int, ready: list, cp: int = 1):
        self.t, self.c, self.shares, self.config, self.pp, self.dp, self.m, self.ready, self.cp = \
            times, micro_s, shares, config, pp, dp, m, ready, cp

    def loss_free(self, cls: str) -> "Clock":
        """This clock with ``cls``'s messages at their loss-free seconds (their repairs taken away)."""
        times = dict(self.t)
        for key in self.KEYS[cls]:
            if key in times:
                times[key] = _at_loss_free(times[key])
        return Clock(times, self.c, self.shares, self.config, self.pp, self.dp, self.m, self.ready, self.cp)

    def _context(self, s: int, r: int, k: int) -> np.ndarray:
        """[micro-batch, direction]: what replica ``r``'s stage ``s``'s context exchanges add, each block's
        slowest TP position's (zeros without context parallelism)."""
        groups = self.t["cp"][s] if self.t["cp"] else []
        if not groups:
            return np.zeros((self.m, 2))
        mine = groups if len(groups) == 1 else groups[r * len(groups) // self.dp:(r + 1) * len(groups) // self.dp]
        return np.max(np.stack(mine), axis=0)[:, :, k].sum(-1)

    def _experts(self, zero) -> Callable:
        """``(stage, replica)`` -> [micro-batch] of (forward, backward) [with loss, loss-free] seconds of the
        replica's all-to-alls: each class's summed (those not in ``zero``), the slowest of its TP ranks' groups."""
        present = [cls for cls in EP_CLASSES if cls in self.t and cls not in zero]
        mesh = self.config.mesh()

        def of(s: int, r: int) -> list:
            total = [([0.0, 0.0], [0.0, 0.0]) for _ in range(self.m)]
            for cls in present:
                groups = self.t[cls][s]
                mine = [groups[0]] if len(groups) == 1 else \
                    [groups[t * (mesh.dp // mesh.ep) + r // mesh.ep] for t in range(mesh.tp)]
                for i, pair in enumerate(total):
                    for d in (0, 1):
                        for q in (0, 1):
                            pair[d][q] += max(group[i][d][q] for group in mine)
            return total
        return of

    def _replicas(self) -> list[int]:
        """One replica of each kind whose paths differ (replica 0 first): a replica's TP groups, pipeline
        boundaries and context groups are its own where every one was simulated, its ep groups its
        expert-data index's."""
        mesh = self.config.mesh()
        tp, pp = self.t["tp"], self.t["pp"]
        experts = any(len(groups) > 1 for cls in EP_CLASSES for groups in self.t.get(cls, []))
        own = any(len(g) > 1 for g in (*tp, *pp, *self.t["cp"]))
        kinds: dict = {}
        for r in range(self.dp if own or experts else 1):
            kinds.setdefault((r if own else 0, r // mesh.ep if experts else 0), r)
        return list(kinds.values())

    def _expert_buckets(self, k: int, zero) -> float:
        """What the experts' buckets add after the backward: the slowest stage's, one after another."""
        if "dp" in zero or not self.t.get("expert_bucket"):
            return 0.0
        return max((sum(seconds[k] for seconds in stage) for stage in self.t["expert_bucket"]), default=0.0)

    def step(self, k: int, zero=()) -> float:
        tp = self.t["tp"]
        tp_of = (lambda s, r: [[[0.0, 0.0]] * 2] * self.m) if "tp" in zero else \
            (lambda s, r: tp[s][r * self.cp if len(tp[s]) > 1 else 0])   # context rank 0's, as training charges
        ep_of = self._experts(zero)
        cp_of = (lambda s, r: np.zeros((self.m, 2))) if "cp" in zero else (lambda s, r: self._context(s, r, k))
        bucket = [[[0.0, 0.0]] * len(b) for b in self.t["bucket"]] if {"dp", "fsdp"} & set(zero) else self.t["bucket"]
        gather = [] if "fsdp" in zero or not self.t["gather"] else [g[k] for g in self.t["gather"]]
        replicas = self._replicas()
        c, m, overlap = self.c, self.m, self.config.dp_overlap
        if self.pp == 1:
            paths = []
            for r in replicas:
                forward = backward = comm = 0.0
                for (f, b), (ef, eb), (cf, cb) in zip(tp_of(0, r), ep_of(0, r), cp_of(0, r)):
                    forward += c / 3 + f[k] + ef[k] + cf
                    backward += c * 2 / 3 + b[k] + eb[k] + cb
                    comm += f[k] + b[k] + ef[k] + eb[k] + cf + cb
                paths.append((forward, backward, comm))
            step = m * c + paths[0][2]
            if self.dp > 1:   # training's ``DataParallel.added_seconds``
                step += timeline.added_seconds([p[:2] for p in paths], self.ready[0], gather,
                                               [s[k] for s in bucket[0]], overlap)
            return step + self._expert_buckets(k, zero)
        pp = self.t["pp"]
        sends = (lambda b, r: [[[0.0, 0.0]] * 2] * m) if "pp" in zero else \
            (lambda b, r: pp[b][r * self.cp if len(pp[b]) > 1 else 0])
        timings = []
        for r in replicas:
            stages = [tp_of(s, r) for s in range(self.pp)]
            moe = [ep_of(s, r) for s in range(self.pp)]
            contexts = [cp_of(s, r) for s in range(self.pp)]
            forward = [[c * _THIRD * share + f[k] + ef[k] + added[0]
                        for (f, _), (ef, _), added in zip(stage, alltoall, context)]
                       for stage, alltoall, context, share in zip(stages, moe, contexts, self.shares)]
            backward = [[c * (2 / 3) * share + b[k] + eb[k] + added[1]
                         for (_, b), (_, eb), added in zip(stage, alltoall, context)]
                        for stage, alltoall, context, share in zip(stages, moe, contexts, self.shares)]
            links = [sends(b, r) for b in range(self.pp - 1)]
            timings.append(pipeline_time(self.config.pp_schedule, self.pp, m, forward, backward,
                                         [[a[k] for a, _ in link] for link in links],
                                         [[g[k] for _, g in link] for link in links]))
        buckets = [[b[k] for b in stage] for stage in bucket] if self.dp > 1 else []
        return timeline.pipeline_step_seconds(timings, self.ready, buckets, overlap) + self._expert_buckets(k, zero)


def _at_loss_free(times):
    """``times`` (nested lists ending in [with loss, loss-free] pairs of seconds, or a context group's
    [micro-batch, direction, (with loss, loss-free), block] array) with every pair [free, free]."""
    if isinstance(times, np.ndarray):
        free = times.copy()
        free[:, :, 0] = free[:, :, 1]
        return free
    if len(times) == 2 and all(isinstance(x, (int, float)) for x in times):
        return [times[1], times[1]]
    return [_at_loss_free(x) for x in times]
