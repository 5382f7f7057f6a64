"""The step loop of an estimate and its tp, pp, dp and fsdp messages, each through ``LossyNetwork.simulate``
on its group's network (``messages.Messages``, a part of ``job.Job``: its groups, sizes and counters are the
job's; the experts' and context groups' messages are ``ep.estimate`` and ``cp.estimate``).

- ``tp``: every stage's TP all-reduces (``step_calls``), per micro-batch, on each replica's stage group;
- ``pp``: every boundary's activation and its gradient, per micro-batch, TP rank t to TP rank t, a send's
  time its slowest TP rank's;
- ``dp``: DDP's gradient buckets, all-reduced over each (stage, TP position)'s data-parallel group, a
  bucket's time its slowest group's; ``fsdp``: the same units all-gathered before the forward and
  reduce-scattered after the backward.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict, deque
from typing import Callable, Optional

import numpy as np

from ..dp.fsdp import shard_numel
from ..net import LossyNetwork
from .accounting import Group, held_elements, is_lossy, mark


class Messages:
    """``Job``'s step loop and its tp, pp, dp and fsdp messages."""

    def run(self, steps: int, tick: Optional[Callable[[], None]] = None) -> list[dict]:
        """Every class's messages of ``steps`` steps; per step their seconds, each [with loss, loss-free].

        A network's calls depend only on its own streams, so each group runs all its steps in turn and
        its network is let go once counted (its transfers are most of an estimate's memory)."""
        m, dtype, grad = self.config.n_microbatches, self.dtype, self.w.grad_torch_dtype
        out = [{"tp": [[None] * len(g) for g in self.tp], "pp": [[None] * len(g) for g in self.pp],
                "bucket": [], "gather": []} for _ in range(steps)]
        for part in self.PARTS:   # the axes' parts whose draws come first (context exchanges)
            if part.RUNS_FIRST:
                part.run_part(self, out, steps, m)
        shapes: dict = {}
        for s, groups in enumerate(self.tp):
            chosen, extra = self._sample(groups)
            for j, group in enumerate(chosen):
                if group.same_as >= 0:   # a fabric's clean group: its representative's times (below)
                    continue
                net = _network(group.spec, shapes)
                if self.sampled and not is_lossy(net):
                    # loss-free and deterministic: every micro-batch of every step is the first one's
                    once = self._tp_group(net, group.copies * m * steps, s, 1)
                    for step in out:
                        step["tp"][s][j] = once * m
                    self.count("tp", net, group.copies * m * steps)
                    continue
                for step in out:
                    step["tp"][s][j] = self._tp_group(net, group.copies, s, m)
                self.count("tp", net, group.copies)
            _alias(out, "tp", s, chosen)
            if extra:
                self._draw_groups([step["tp"][s] for step in out], len(chosen))
        alike, shapes = defaultdict(list), {}   # boundaries whose groups differ only by their streams: one pool
        for b, groups in enumerate(self.pp):
            chosen, extra = self._sample(groups)
            for j, group in enumerate(chosen):
                if group.same_as >= 0:
                    continue
                net = _network(group.spec, shapes)
                for step in out:
                    step["pp"][b][j] = self._sends(net, group.copies, b, m)
                self.count("pp", net, group.copies)
            _alias(out, "pp", b, chosen)
            if extra:
                alike[dataclasses.replace(groups[0].spec, seed=0), len(chosen)].append(b)
        for (_, k), boundaries in alike.items():
            self._draw_groups([step["pp"][b] for step in out for b in boundaries], k)
        if self.mode == "ddp":
            for step in out:
                step["bucket"] = [None] * len(self.dp)
            alike = defaultdict(list)   # under the model, stages alike but for streams share the simulated groups
            shapes: dict = {}           # and every stage's groups the transfers of its buckets' sizes
            for s, (groups, buckets) in enumerate(zip(self.dp, self.buckets)):
                same = self.sampled and groups[0].copies == 1
                alike[(dataclasses.replace(groups[0].spec, seed=0), tuple(b.numel for b in buckets))
                      if same else s].append(s)
            for stages in alike.values():
                messages = [(f"dp.bucket{b}", "bwd", bucket.numel, grad, "all_reduce")
                            for b, bucket in enumerate(self.buckets[stages[0]])]
                for s, per_step in zip(stages, self._slowest(self.dp[stages[0]], messages, "dp", steps, shapes,
                                                             len(stages))):
                    for step, seconds in zip(out, per_step):
                        step["bucket"][s] = seconds
        elif self.mode == "fsdp":
            units = self.buckets[0]
            messages = [(f"fsdp.gather{b}", "fwd", lambda net, n=unit.numel: shard_numel(net, n, dtype), dtype,
                         "all_gather") for b, unit in enumerate(units)] + \
                [(f"fsdp.reduce{b}", "bwd", lambda net, n=unit.numel: net.ranks * shard_numel(net, n, grad), grad,
                  "reduce_scatter") for b, unit in enumerate(units)]
            for step, seconds in zip(out, self._slowest(self.dp[0], messages, "fsdp", steps, {})[0]):
                step["gather"], step["bucket"] = seconds[:len(units)], [seconds[len(units):]]
        for part in self.PARTS:   # then the others' (the experts' all-to-alls and buckets)
            if not part.RUNS_FIRST:
                part.run_part(self, out, steps, m)
        for _ in range(steps if tick is not None else 0):
            tick()
        return out


    def _tp_group(self, net: LossyNetwork, copies: int, stage: int, m: int) -> list:
        """[micro-batch] of (forward, backward), each [with loss, loss-free] seconds of its all-reduces."""
        calls, dtype = self.calls[stage], self.dtype
        per_packet, _ = net.packets(self.numel, dtype)
        forwards = next((k for k, c in enumerate(calls) if c.direction != "fwd" or c.replay), len(calls))
        out = []
        for _ in range(m):
            record = defaultdict(deque)   # the first forward's deliveries, for the recomputed one
            marks = [mark(net)]
            for k, call in enumerate(calls):
                if k == forwards:
                    marks.append(mark(net))
                if call.replay:
                    with net.replaying(record):
                        net.simulate(call.site, call.direction, self.numel, dtype)
                    continue
                recording = net.recording(record) if self.config.activation_checkpointing else contextlib.nullcontext()
                with recording:
                    delivery = net.simulate(call.site, call.direction, self.numel, dtype, deliver=False)
                self.lost("tp", call.direction, delivery, per_packet, self.numel, net.ranks * self.numel, copies)
            marks.append(mark(net))
            out.append(tuple([b[0] - a[0], b[1] - a[1]] for a, b in zip(marks, marks[1:])))
        return out

    def _sends(self, net: LossyNetwork, copies: int, boundary: int, m: int) -> list:
        """[micro-batch] of (activation, gradient), each [with loss, loss-free] seconds of the slowest of
        the TP ranks' sends over ``boundary``, issued in training's order."""
        dtype, tp = self.dtype, self.mesh.tp
        per_packet, _ = net.packets(self.numel, dtype)
        out = []
        for _ in range(m):
            pair = []
            for direction in ("fwd", "bwd"):
                slowest = [0.0, 0.0]
                for t in range(tp):
                    before = mark(net)
                    delivery = net.simulate(f"pp.boundary{boundary}", direction, self.numel, dtype, "send",
                                            deliver=False, pair=(t, tp + t) if direction == "fwd" else (tp + t, t))
                    after = mark(net)
                    slowest = [max(slowest[0], after[0] - before[0]), max(slowest[1], after[1] - before[1])]
                    self.lost("pp", direction, delivery, per_packet, self.numel, self.numel, copies)
                pair.append(slowest)
            out.append(tuple(pair))
        return out

    def _slowest(self, groups: list[Group], messages: list, cls: str, steps: int, shapes: dict,
                 stages: int = 1) -> list:
        """Per step, each message's [with loss, loss-free] seconds, the slowest group's: groups run side
        by side. ``messages``: (site, direction, numel or numel(network), dtype, collective). Groups
        beyond the sampled ones: each message's slowest repair is drawn from the simulated repairs of
        every message of its kind (direction, collective and packets, on groups alike but for streams),
        added to its own loss-free time (the same in every group). ``stages`` > 1: as many stages alike
        but for their streams, the groups of all but the first drawn whole. ``shapes``: the transfers built so
        far (``_network``'s cache), shared by the calls of other stages: a pipeline's first, middle and last
        stages' groups differ only by their streams, and most of their buckets are the same sizes. Returns
        [stage][step][message]."""
        chosen, extra = self._sample(groups, stages)
        seconds = np.zeros((len(chosen), steps, len(messages), 2))
        kinds = [None] * len(messages)
        for g, group in enumerate(chosen):
            if group.same_as >= 0:   # a fabric's clean group: no slower than its representative
                continue
            net = _network(group.spec, shapes)
            for i in range(steps):
                for k, (site, direction, numel, dtype, collective) in enumerate(messages):
                    numel = numel(net) if callable(numel) else numel
                    per_packet, n_packets = net.packets(numel, dtype)
                    kinds[k] = (direction, collective, n_packets)
                    before = mark(net)
                    delivery = net.simulate(site, direction, numel, dtype, collective, deliver=False)
                    after = mark(net)
                    seconds[g, i, k] = after[0] - before[0], after[1] - before[1]
                    self.lost(cls, direction, delivery, per_packet, numel,
                              held_elements(collective, net.ranks, numel), group.copies, collective)
            self.count(cls, net, group.copies)
        slowest = np.repeat(seconds.max(axis=0)[None], stages, axis=0)
        slowest[1:, :, :, 0] = slowest[1:, :, :, 1]
        for kind in dict.fromkeys(kinds) if extra or stages > 1 else ():
            alike = [k for k, other in enumerate(kinds) if other == kind]
            pool = (seconds[:, :, alike, 0] - seconds[:, :, alike, 1]).ravel()
            for stage, draws in enumerate([extra] + [len(groups)] * (stages - 1)):
                if not draws:
                    continue
                drawn = pool[self.rng.integers(len(pool), size=(steps, len(alike), draws))].max(axis=2)
                both = slowest[stage][:, alike]
                slowest[stage][:, alike, 0] = np.maximum(both[..., 0], both[..., 1] + drawn)
        return slowest.tolist()


def _network(spec, shapes: dict) -> LossyNetwork:
    """A group's network, its transfers shared with the groups alike but for their streams (``shapes``: a
    cache per spec less its seed), so each call shape is built once, not once a group."""
    return LossyNetwork(spec, transfer_cache=shapes.setdefault(dataclasses.replace(spec, seed=0), {}))


def _alias(out: list[dict], cls: str, index: int, groups: list) -> None:
    """A fabric's clean groups take their representative's times (they are loss-free and alike)."""
    for j, group in enumerate(groups):
        if group.same_as >= 0:
            for step in out:
                step[cls][index][j] = step[cls][index][group.same_as]
