"""Where a run's ranks sit: a mesh of named axes, the groups along each axis, the nodes, and the network
each group trains over.

The axes are Megatron's: ``tp`` (tensor), ``cp`` (context), ``ep`` (expert), ``dp`` (data) and ``pp``
(pipeline), laid out in ``order``, innermost first, as Megatron-core's ``order`` argument spells it
(default ``tp-cp-ep-dp-pp``: a TP group is consecutive ranks, pipeline stages are outermost). Global rank
r has one coordinate per axis, its digits in mixed radix over the axes in that order. As in Megatron,
expert parallelism is carved out of the data-parallel ranks: the dense world is tp x cp x dp x pp, and
``ep`` (which divides dp x cp) has no digit of its own there; an axis of size 1 costs nothing.

Any axis's groups come from one rule (Megatron's ``RankGenerator``): fix every other coordinate and
walk the axis. Nodes hold ``ranks_per_node`` consecutive ranks (default ``tp``: a TP group to a node).

Every group gets its own ``LossyNetwork``, whose spec is the run's network settings (from config)
placed on the group's ranks: each group's topology puts its ranks on the nodes the mesh puts them. A
TP group's network is replica r's stage s's; a DP group's joins one rank per replica at one stage and
TP position; a pipeline boundary's holds the two stages' TP groups. Each group's links draw from
streams of their own, named by the group (``tp.replica1.stage2``, ``dp.stage1.group0``,
``pp.replica0.boundary1``), except replica 0's first stage's TP group: a run with one replica and one
stage keeps its streams.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .net import NetworkSpec
from .util import stream_seed

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"        # Megatron-core's default: tp innermost, pp outermost


def parse_order(value: str) -> tuple[str, ...]:
    """``parallel_order``: every axis once, innermost first, separated by ``-`` (``tp-cp-ep-dp-pp``)."""
    axes = tuple(part.strip().lower() for part in str(value).split("-"))
    if sorted(axes) != sorted(AXES):
        raise ValueError(f"parallel_order={value!r} must name each of {', '.join(AXES)} once, innermost "
                         f"first, separated by '-' (default {DEFAULT_ORDER})")
    return axes


@dataclass(frozen=True)
class Mesh:
    """``tp`` ranks to a TP group, ``cp`` to a context group, ``dp`` replicas, ``pp`` stages (``ep`` carved
    out of dp x cp), laid out in ``order``; ``ranks_per_node`` consecutive ranks to a node (None: tp).
    Building one checks the layout: a bad one is a one-line ValueError naming the setting."""
    tp: int
    dp: int = 1
    ranks_per_node: Optional[int] = None
    pp: int = 1
    cp: int = 1
    ep: int = 1
    order: str = DEFAULT_ORDER

    def __post_init__(self):
        for axis in AXES:
            size = getattr(self, axis)
            if isinstance(size, bool) or int(size) != size or size < 1:
                raise ValueError(f"{axis}_size={size!r} must be an integer >= 1")
        object.__setattr__(self, "order", "-".join(parse_order(self.order)))
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep_size={self.ep} must divide dp_size x cp_size = {self.dp * self.cp} "
                             "(expert parallelism is carved out of the data-parallel ranks)")
        per, world = self.ranks_per_node, self.world
        if per is None:
            return
        if isinstance(per, bool) or int(per) != per or per < 1:
            raise ValueError(f"ranks_per_node={per!r} must be an integer >= 1")
        if per > world:
            raise ValueError(f"ranks_per_node={per} is more GPUs than the layout's {self.name.split(' = ')[0]} = "
                             f"{world}")
        if world % per or (self.tp % per and per % self.tp):
            raise ValueError(f"ranks_per_node={per} must divide tp_size={self.tp} or be a multiple of it, and "
                             f"divide the world {self.name.split(' = ')[0]} = {world}")

    # -- the layout --------------------------------------------------------------------------------
    @property
    def axes(self) -> tuple[str, ...]:
        """The axes with a digit in a global rank, innermost first (``ep`` lives inside dp x cp)."""
        return tuple(a for a in self.order.split("-") if a != "ep")

    @property
    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def world(self) -> int:
        return math.prod(getattr(self, axis) for axis in self.axes)

    @property
    def per_node(self) -> int:
        return self.tp if self.ranks_per_node is None else self.ranks_per_node

    @property
    def nodes(self) -> int:
        return -(-self.world // self.per_node)

    @property
    def name(self) -> str:
        """``tp8 x pp4 x dp8 = 256 GPUs on 32 nodes`` (cp and ep named where they are used)."""
        parts = [f"tp{self.tp}"] + ([f"cp{self.cp}"] if self.cp > 1 else []) + [f"pp{self.pp}", f"dp{self.dp}"]
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        return f"{' x '.join(parts)} = {self.world} GPUs on {self.nodes} node{'s' if self.nodes > 1 else ''}"

    def describe(self) -> dict:
        """summary.json's ``mesh``: the order, every axis's size, the world, nodes and ranks per node."""
        return {"order": self.order, "axes": self.sizes, "world": self.world,
                "ranks_per_node": self.per_node, "nodes": self.nodes}

    def coordinates(self, rank: int) -> dict[str, int]:
        """Each axis's coordinate of a global rank (``ep``'s: 0, it has no digit of its own)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank={rank} is not in a world of {self.world}")
        out = dict.fromkeys(AXES, 0)
        for axis in self.axes:
            rank, out[axis] = divmod(rank, getattr(self, axis))
        return out

    def rank_at(self, **coordinates: int) -> int:
        """The global rank at these coordinates (an axis left out: 0)."""
        rank, stride = 0, 1
        for axis in self.axes:
            index = coordinates.get(axis, 0)
            if not 0 <= index < getattr(self, axis):
                raise ValueError(f"{axis}={index} is not a coordinate of an axis of size {getattr(self, axis)}")
            rank += index * stride
            stride *= getattr(self, axis)
        return rank

    def group(self, axis: str, rank: int) -> list[int]:
        """The ranks that differ from ``rank`` in ``axis`` alone, in that axis's order."""
        at = self.coordinates(rank)
        return [self.rank_at(**{**at, axis: i}) for i in range(getattr(self, axis))]

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` (fix every other coordinate, walk the axis), by their first rank."""
        return [self.group(axis, r) for r in range(self.world) if self.coordinates(r)[axis] == 0]

    def node(self, rank: int) -> int:
        return rank // self.per_node

    # -- the coordinates the training code names -----------------------------------------------------
    def rank(self, replica: int, tp_rank: int, stage: int = 0) -> int:
        """The global rank of TP rank ``tp_rank`` of stage ``stage`` of replica ``replica``."""
        return self.rank_at(tp=tp_rank, dp=replica, pp=stage)

    def position(self, rank: int) -> tuple[int, int, int]:
        """(replica, stage, tp_rank) of a global rank."""
        at = self.coordinates(rank)
        return at["dp"], at["pp"], at["tp"]

    def coordinate(self, rank: int) -> tuple[int, int]:
        """(replica, tp_rank) of a global rank (its stage: ``position``)."""
        replica, _, tp_rank = self.position(rank)
        return replica, tp_rank

    def tp_ranks(self, replica: int, stage: int = 0) -> list[int]:
        return self.group("tp", self.rank(replica, 0, stage))

    def dp_ranks(self, tp_rank: int, stage: int = 0) -> list[int]:
        return self.group("dp", self.rank(0, tp_rank, stage))

    def pp_ranks(self, replica: int, tp_rank: int) -> list[int]:
        """Replica ``replica``'s TP position ``tp_rank`` stage by stage: one pipeline."""
        return self.group("pp", self.rank(replica, tp_rank, 0))

    def stage_ranks(self, stage: int) -> list[int]:
        """Every rank that holds stage ``stage`` (of every replica, at every TP position)."""
        return [r for r in range(self.world) if self.coordinates(r)["pp"] == stage]

    # -- each group's network ----------------------------------------------------------------------
    def tp_network_spec(self, settings: dict, replica: int = 0, stage: int = 0) -> NetworkSpec:
        """Replica ``replica``'s stage ``stage``'s TP group on the run's network ``settings``
        (``NetworkSpec``'s keys), on the nodes the mesh puts it and, beyond replica 0's first stage,
        chains of its own."""
        placed = {**settings, "ranks": self.tp}
        if self.ranks_per_node is not None and self.world > self.tp:
            placed["ranks_per_node"] = self._per_node(self.tp_ranks(replica, stage))
        if stage:
            placed["seed"] = stream_seed(settings["seed"], f"tp.replica{replica}.stage{stage}", "network")
        elif replica:
            placed["seed"] = stream_seed(settings["seed"], f"tp.replica{replica}", "network")
        return NetworkSpec(**placed)

    def dp_network_spec(self, settings: dict, tp_rank: int, lossy: tuple[str, ...], stage: int = 0) -> NetworkSpec:
        """Stage ``stage``'s TP position ``tp_rank``'s data-parallel group: ``dp`` ranks, one per
        replica, on the nodes the mesh puts them, their own NICs and chains; ``lossy``: the directions
        of its traffic that may lose packets. Every packet is a candidate: site selection picks TP sites."""
        group = f"dp.group{tp_rank}" if not stage else f"dp.stage{stage}.group{tp_rank}"
        ranks = self.dp_ranks(tp_rank, stage)
        return NetworkSpec(**{**settings, "ranks": self.dp, "ranks_per_node": self._per_node(ranks),
                              "nics_per_node": None, "seed": stream_seed(settings["seed"], group, "network"),
                              "lossy_layers": "all", "lossy_sites": "all", "lossy": lossy})

    def pp_network_spec(self, settings: dict, replica: int, boundary: int, lossy: tuple[str, ...]) -> NetworkSpec:
        """Replica ``replica``'s pipeline boundary ``boundary`` (between stages ``boundary`` and
        ``boundary + 1``): ``2 tp`` ranks, stage ``boundary``'s TP ranks then the next stage's (local rank
        t and ``tp + t`` are the global ranks ``rank(replica, t, boundary)`` and ``rank(replica, t,
        boundary + 1)``), on the nodes the mesh puts them, chains of their own; ``lossy``: the directions
        that may lose packets (``fwd``: activations, ``bwd``: their gradients). Every message is a
        candidate: site selection picks TP sites."""
        if not 0 <= boundary < self.pp - 1:
            has = f"a pipeline of {self.pp} stages has boundaries 0..{self.pp - 2}" if self.pp > 1 else \
                "one stage has no pipeline boundary"
            raise ValueError(f"boundary={boundary}: {has}")
        ranks = self.tp_ranks(replica, boundary) + self.tp_ranks(replica, boundary + 1)
        return NetworkSpec(**{**settings, "ranks": len(ranks), "ranks_per_node": self._per_node(ranks),
                              "seed": stream_seed(settings["seed"], f"pp.replica{replica}.boundary{boundary}",
                                                  "network"),
                              "lossy_layers": "all", "lossy_sites": "all", "lossy": lossy})

    def _per_node(self, ranks: list[int]) -> int:
        """The ranks to a node that a group's own topology (consecutive blocks of one size) needs to put
        the group's ``ranks`` on the nodes the mesh puts them."""
        nodes = [self.node(r) for r in ranks]
        for size in range(1, len(ranks) + 1):   # a new node exactly where a block begins
            if len(ranks) % size == 0 and all((nodes[i] != nodes[i - 1]) == (i % size == 0)
                                              for i in range(1, len(ranks))):
                return size
        raise ValueError(f"ranks_per_node={self.per_node} puts ranks {ranks} on nodes {nodes}, "
                         "unevenly: use a multiple or a divisor of tp_size")

    def process_groups(self) -> dict[str, dict[int, object]]:
        """dist's process groups: per axis (``tp``, ``dp``, ``pp``, ...), each global rank's group. Every
        process creates every group, in the same order, as torch.distributed requires."""
        import torch.distributed as dist
        out = {}
        for axis in self.axes:
            out[axis] = {}
            for ranks in self.groups(axis):
                out[axis].update(dict.fromkeys(ranks, dist.new_group(ranks)))
        return out
