"""Context parallelism's messages in an estimate (``ContextMessages``, a part of ``estimate.job.Job``): ``cp``, every
block's keys and values over each (stage, replica, TP position)'s context group, per micro-batch: the ring's
rounds of point-to-point sends (or an all-gather), and their gradients back (or a reduce-scatter), training's
exchanges (``cp.exchange``), each round's time its slowest send's and what it adds the part not hidden behind
that step's attention (``cp.clock``), the slowest TP position's per block.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Callable, Optional

import numpy as np

from ..estimate.accounting import held_elements, mark
from ..estimate.collisions import stretch_rounds
from ..net import LossyNetwork
from ..net.recovery import packets_of
from ..net.sparse import Losses
from ..tp.parallelize import head_counts
from . import clock as cp_clock


class ContextMessages:
    """``Job``'s context groups' exchanges; on the estimate's clock (``estimate.simulate``, called on the
    class): the row's columns, the replicas whose exchanges differ and what they add on a replica's stream."""

    RUNS_FIRST = True   # its exchanges draw from the job's random stream before TP's messages do
    STREAM = "cp"       # its seconds on a replica's compute stream (``clock.OnStream``)
    # the time keys it stretches itself on a fabric (its rounds, before their overlap with attention), which
    # ``estimate.collisions.stretched`` leaves alone
    STRETCHED = ("cp",)

    @staticmethod
    def columns(shape, config, mesh, w) -> dict:
        """The estimate row's columns of context parallelism: its size and mode."""
        return {"cp_size": mesh.cp, "cp_mode": config.cp_mode if mesh.cp > 1 else ""}

    @staticmethod
    def replica_kind(parts) -> Optional[Callable[[int], int]]:
        """Replica r's kind by its context groups (its own where every one was simulated), None: alike."""
        return (lambda r: r) if any(len(g) > 1 for g in parts.t["cp"]) else None

    @staticmethod
    def on_stream(parts, zero) -> Callable[[int, int], list]:
        """``(replica, k)`` -> [stage][micro-batch] of (forward, backward) seconds (``k`` 0: with loss, 1:
        loss-free) its context exchanges add, each block's slowest TP position's (zeros without context
        parallelism; none with its class in ``zero``)."""
        if "cp" in zero:
            return lambda r, k: ()

        def added(s: int, r: int, k: int) -> np.ndarray:
            groups = parts.t["cp"][s] if parts.t["cp"] else []
            if not groups:
                return np.zeros((parts.m, 2))
            mine = groups if len(groups) == 1 else groups[r * len(groups) // parts.dp:(r + 1) * len(groups) // parts.dp]
            return np.max(np.stack(mine), axis=0)[:, :, k].sum(-1)
        return lambda r, k: [[(f, b) for f, b in added(s, r, k)] for s in range(parts.pp)]

    def init_part(self, shape, config, w, tokens: int, settings: dict) -> None:
        """cp[s]: stage s's context groups, one per replica and TP position (none without context
        parallelism); a context rank's key/value block; one ring step's attention (set by the estimate)."""
        mesh = self.mesh
        tp, pp, dp, cp = mesh.tp, mesh.pp, mesh.dp, mesh.cp
        self.cp = [self.groups_of([mesh.network_spec("cp", mesh.rank(dp=r, tp=t, pp=s), settings,
                                                     config.lossy_directions("cp"))
                                   for r in range(dp) for t in range(tp)]) for s in range(pp)] if cp > 1 else []
        self.attention_s = [0.0, 0.0]   # one ring step's attention per rank and block, forward and backward
        heads, kv, _ = head_counts(shape.plan, shape.config, tp)
        head_dim = getattr(shape.config, "head_dim", None) or shape.hidden // heads
        # a context rank's block: its tokens' keys and values for its TP rank's kv heads
        self.kv_numel = 2 * config.micro_batch_size * max(kv // tp, 1) * (w.seq // cp) * head_dim

    def run_part(self, out: list[dict], steps: int, m: int) -> None:
        """Every step's context exchanges (``out[step][AXIS]``; empty without context parallelism)."""
        for step in out:
            step["cp"] = [[None] * len(g) for g in self.cp]
        self._contexts(out, steps, m)

    def _contexts(self, out: list[dict], steps: int, m: int) -> None:
        """Every stage's context groups' exchanges, per step: ``out[step]["cp"][s][j]``, group j's [micro-batch,
        direction, (with loss, loss-free), block] seconds added (``_context_group``). A loss-free group is the
        same at every micro-batch, step and stage alike (simulated once); with sampled groups, stages alike but
        for their streams (and their number of blocks: a stage of fewer reads its first blocks') share the
        simulated groups of the one with the most blocks, the others' drawn from them, and a simulated group
        simulates ``sampled_groups`` of its micro-batches, the others drawn alike."""
        alike = defaultdict(list)
        for s, groups in enumerate(self.cp):
            spec = dataclasses.replace(groups[0].spec, seed=0)
            alike[(spec, groups[0].copies) if groups[0].copies > 1 or self.sampled else s].append(s)
        for stages in alike.values():
            # the stage with the most blocks stands for the others (a stage of fewer: its first blocks)
            first = max(stages, key=lambda s: len(self.blocks(s)))
            groups, weight = self.cp[first], sum(len(self.blocks(s)) for s in stages) / len(self.blocks(first))
            if groups[0].copies > 1:   # loss-free: one group, deterministic
                net = LossyNetwork(groups[0].spec)
                once = self._context_group(net, 1, first, 1)
                for s in stages:
                    for step in out:
                        step["cp"][s][0] = np.repeat(once[..., :len(self.blocks(s))], m, axis=0)
                self.count("cp", net, groups[0].copies * m * steps * weight)
                continue
            chosen, extra = self._sample(groups, weight)
            # under the model, a simulated group also simulates only k of its micro-batches (alike but for
            # their draws), the others drawn from them as the other groups' are: every block's exchange of
            # every micro-batch is hundreds of sends
            simulated = min(self.sampled, m) if self.sampled else m
            for j, group in enumerate(chosen):
                net = LossyNetwork(group.spec)
                copies = group.copies * m / simulated
                for step in out:
                    step["cp"][first][j] = self._context_group(net, copies, first, simulated)
                self.count("cp", net, copies)
            k = len(chosen)
            pool = np.concatenate([step["cp"][first][j] for step in out for j in range(k)])   # [items, 2, 2, blocks]
            for step in out:
                for j in range(k if simulated < m else 0):
                    drawn = self.rng.integers(len(pool), size=(m - simulated, 2))
                    more = np.stack([pool[drawn[:, 0], 0], pool[drawn[:, 1], 1]], axis=1)
                    step["cp"][first][j] = np.concatenate([step["cp"][first][j], more])
            for s in stages:
                fill = len(groups) - k if s == first else len(groups)
                for step in out:
                    if not fill:
                        continue
                    # forward and backward drawn apart, as ``_draw_groups`` draws TP's
                    drawn = self.rng.integers(len(pool), size=(fill, m, 2))
                    filled = np.stack([pool[drawn[..., 0], 0], pool[drawn[..., 1], 1]], axis=2)[..., :len(self.blocks(s))]
                    step["cp"][s] = (step["cp"][first][:k] if s == first else []) + list(filled)

    def _context_group(self, net: LossyNetwork, copies: float, stage: int, m: int) -> np.ndarray:
        """[micro-batch, direction, (with loss, loss-free), block]: what each block's exchange over this
        context group adds beside its attention (``cp.clock.exposed``), in training's order: every block's
        forward exchange, then every block's backward one, blocks in reverse."""
        cp, mode, dtype, n = self.mesh.cp, self.config.cp_mode, self.dtype, self.kv_numel
        plan, blocks = self.shape.plan, list(self.blocks(stage))
        per_packet, _ = net.packets(n, dtype)
        out = np.zeros((m, 2, 2, len(blocks)))
        for i in range(m):
            for d, direction in enumerate(("fwd", "bwd")):
                order = range(len(blocks)) if direction == "fwd" else reversed(range(len(blocks)))
                for b in order:
                    site = f"{plan.blocks}.{blocks[b]}.{plan.attention}.kv"
                    rounds = self._exchange(net, site, direction, mode, cp, n, per_packet, copies)
                    # on a fabric, shared cables stretch a round's sends before attention hides them
                    rounds = stretch_rounds(rounds, getattr(self, "fabric_factors", {}).get("cp"))
                    for k in (0, 1):
                        out[i, d, k, b] = cp_clock.exposed(mode, [r[k] for r in rounds], self.attention_s[d])
        return out

    def _exchange(self, net: LossyNetwork, site: str, direction: str, mode: str, cp: int, n: int, per_packet: int,
                  copies: float) -> list:
        """One block's exchange (``cp.exchange``'s calls, without tensors): each round's [with loss, loss-free]
        seconds, the slowest send's."""
        dtype = self.dtype
        if mode == "allgather":
            collective = "all_gather" if direction == "fwd" else "reduce_scatter"
            numel = n if direction == "fwd" else cp * per_packet * -(-n // per_packet)   # each origin padded
            before = mark(net)
            delivery = net.simulate(site, direction, numel, dtype, collective, deliver=False)
            after = mark(net)
            self.lost("cp", direction, delivery, per_packet, numel, held_elements(collective, cp, numel), copies,
                      collective)
            return [[after[0] - before[0], after[1] - before[1]]]
        rounds = []
        holes = [np.zeros(0, dtype=np.int64) for _ in range(cp)]   # per origin: the packets its block misses
        short = per_packet * -(-n // per_packet) - n                   # the last packet is partial
        for step in (range(1, cp) if direction == "fwd" else range(cp - 1, 0, -1)):
            slowest = [0.0, 0.0]
            for i in range(cp):
                pair = (i, (i + 1) % cp) if direction == "fwd" else ((i + 1) % cp, i)
                before = mark(net)
                delivery = net.simulate(site, direction, n, dtype, "send", deliver=False, pair=pair)
                after = mark(net)
                slowest = [max(slowest[0], after[0] - before[0]), max(slowest[1], after[1] - before[1])]
                if direction == "bwd":   # a gradient's sum: what this hop lost
                    self.lost("cp", direction, delivery, per_packet, n, n, copies)
                    continue
                # keys and values: a hop forwards what arrived, its receiver misses every hole so far
                origin = (i - step + 1) % cp
                if delivery is not None:
                    holes[origin] = np.union1d(holes[origin], _lost_packets(delivery))
                missed = holes[origin]
                self.received["cp", "fwd"] += n * copies
                self.inexact["cp", "fwd"] += (len(missed) * per_packet -
                                              short * int(len(missed) and missed[-1] == -(-n // per_packet) - 1)) * copies
            rounds.append(slowest)
        return rounds



def _lost_packets(delivery) -> np.ndarray:
    """A send's lost packets, sorted (``delivery``: a policy's draw, or the lost packets as ``Losses``)."""
    if isinstance(delivery, Losses):
        return np.unique(delivery.packet)
    return np.nonzero((packets_of(delivery).weights[0, 0] == 0).cpu().numpy())[0]


PART = ContextMessages
