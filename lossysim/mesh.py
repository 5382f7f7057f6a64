"""Where a run's ranks sit: a mesh of named axes, the groups along each axis, the nodes, and the network
each group trains over.

The axes are Megatron's: ``tp`` (tensor), ``cp`` (context), ``ep`` (expert), ``dp`` (data) and ``pp``
(pipeline), laid out in ``order``, innermost first, as Megatron-core's ``order`` argument spells it
(default ``tp-cp-ep-dp-pp``: a TP group is consecutive ranks, pipeline stages are outermost). Global rank
r has one coordinate per axis, its digits in mixed radix over the axes in that order. As in Megatron,
expert parallelism is carved out of the data-parallel ranks: the dense world is tp x cp x dp x pp, and
``ep`` (which divides dp x cp) has no digit of its own there; an axis of size 1 costs nothing.

Sizes are read by axis name (``size(axis)``, ``sizes``), a rank is named by its coordinates
(``rank(tp=1, dp=2)``), and any axis's groups come from one rule (Megatron's ``RankGenerator``): fix every
other coordinate and walk the axis (``group(axis, rank)``, ``groups(axis)``); ``ep`` and ``edp`` (the ranks
holding the same experts) walk the expert order cut out of dp x cp. Nodes hold ``ranks_per_node``
consecutive ranks (default ``tp``: a TP group to a node).

Every group gets its own ``LossyNetwork`` (``network_spec(axis, rank, settings)``): the run's network
settings (from config) placed on the group's ranks, on the nodes the mesh puts them, its links drawing
from streams named by the group (``_NETWORKS``), except replica 0's first stage's first context rank's TP
group: a run with one replica, one stage and one context rank keeps its streams. A pipeline boundary is
the one network that is not an axis's group: the TP groups of two neighbouring stages.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import NamedTuple, Optional

from .net import NetworkSpec
from .util import stream_seed

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"        # Megatron-core's default: tp innermost, pp outermost
CARVED = ("ep", "edp")                  # cut out of dp x cp: coordinates and groups, no digit of their own


class _Network(NamedTuple):
    """How a group's network differs from the run's: its streams' name, filled from the group's
    coordinates (a bracketed part only where its coordinate is not 0), and whether its ranks have NICs
    of their own (one each) rather than the run's ``nics_per_node``."""
    stream: str
    own_nics: bool


# Every group's network; each but TP's (the run's own) may lose on any layer and site, in its ``lossy``.
_NETWORKS = {
    "tp": _Network("tp.replica{dp}[.stage{pp}][.cp{cp}]", own_nics=False),
    "cp": _Network("cp.replica{dp}.tp{tp}[.stage{pp}]", own_nics=False),
    "dp": _Network("dp[.stage{pp}].group{tp}", own_nics=True),
    # the gradients' group, Megatron's data-parallel group with context parallelism (dp x cp; dp's with cp 1)
    "dp_cp": _Network("dp[.stage{pp}].group{tp}", own_nics=True),
    "pp": _Network("pp.replica{dp}.boundary{pp}[.cp{cp}]", own_nics=False),   # a boundary: see _boundary
    "ep": _Network("{traffic}.tp{tp}.group{edp}[.stage{pp}]", own_nics=True),
    "edp": _Network("edp.tp{tp}.experts{ep}[.stage{pp}]", own_nics=True),
}


def _stream(template: str, at: dict) -> str:
    """``template`` filled from ``at``, each ``[...]`` part kept only where the coordinate it names is not 0."""
    def part(match: re.Match) -> str:
        return match.group(1) if at[re.search(r"\{(\w+)\}", match.group(1)).group(1)] else ""
    return re.sub(r"\[(.*?)\]", part, template).format(**at)




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
    The fields are the constructor (Megatron's ``RankGenerator``'s); code that walks axes reads
    ``size(axis)``. Building one checks the layout: a bad one is a one-line ValueError naming the setting."""
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
        """Every axis's size (summary.json's ``axes``)."""
        return {axis: getattr(self, axis) for axis in AXES}

    def size(self, axis: str) -> int:
        """An axis's size, ``edp`` too (the ranks holding the same experts: dp x cp / ep), and ``dp_cp``'s
        (the gradients' group: dp x cp)."""
        if axis == "edp":
            return self.dp * self.cp // self.ep
        if axis == "dp_cp":
            return self.dp * self.cp
        if axis not in AXES:
            raise ValueError(f"axis={axis!r} is not one of {', '.join(AXES + ('edp',))}")
        return getattr(self, axis)

    @property
    def world(self) -> int:
        return math.prod(self.size(axis) for axis in self.axes)

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
        """Each axis's coordinate of a global rank, ``ep`` and ``edp`` too: its (cp, dp) index
        ``cp + cp_size x dp`` cut as Megatron's expert layers cut it, ep innermost (the expert order:
        expert-tensor = tp, ep, expert-data, pp)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank={rank} is not in a world of {self.world}")
        out = dict.fromkeys(AXES, 0)
        for axis in self.axes:
            rank, out[axis] = divmod(rank, self.size(axis))
        out["edp"], out["ep"] = divmod(out["cp"] + self.cp * out["dp"], self.ep)
        return out

    def rank(self, **coordinates: int) -> int:
        """The global rank at these coordinates (``rank(tp=1, dp=2)``; an axis left out: 0). ``ep`` and
        ``edp`` follow from dp and cp: given, they must be those."""
        unknown = set(coordinates) - set(AXES + CARVED)
        if unknown:
            raise ValueError(f"{', '.join(sorted(unknown))}: a coordinate is one of {', '.join(AXES + ('edp',))}")
        rank, stride = 0, 1
        for axis in self.axes:
            index = coordinates.get(axis, 0)
            if not 0 <= index < self.size(axis):
                raise ValueError(f"{axis}={index} is not a coordinate of an axis of size {self.size(axis)}")
            rank += index * stride
            stride *= self.size(axis)
        carved = set(CARVED) & set(coordinates)
        at = self.coordinates(rank) if carved else {}
        for axis in carved:
            if coordinates[axis] != at[axis]:
                raise ValueError(f"{axis}={coordinates[axis]} is carved out of dp x cp: at dp={at['dp']}, "
                                 f"cp={at['cp']} it is {at[axis]}")
        return rank

    def moved(self, rank: int, **coordinates: int) -> int:
        """The global rank at ``rank``'s coordinates with these changed (``moved(r, tp=0)``: the first of
        r's TP group), so a caller placing a group needs no axis it leaves as it is."""
        at = self.coordinates(rank)
        return self.rank(**({axis: at[axis] for axis in self.axes} | coordinates))

    def alike(self, rank: int, *axes: str) -> int:
        """The first rank alike ``rank`` but in ``axes`` (each with a digit in a global rank): its coordinates
        with those at 0 (``alike(r, "tp", "pp")``: the first of r's TP group at stage 0), so a caller keying,
        seeding or placing a group by its first rank names no axis it keeps."""
        dense = self.axes
        for axis in axes:
            if axis not in dense:
                raise ValueError(f"axis={axis!r}: a rank is alike another but in one of {', '.join(dense)}")
        return self.moved(rank, **dict.fromkeys(axes, 0))

    def group(self, axis: str, rank: int) -> list[int]:
        """The ranks that differ from ``rank`` in ``axis`` alone, in that axis's order; ``ep``, ``edp``:
        the ranks at the same tp and pp whose (cp, dp) index differs in that expert coordinate alone."""
        at, size, place = self.coordinates(rank), self.size(axis), self._places()
        if axis in place:   # a digit of its own: walk it (a 16,384-GPU job asks for thousands of groups)
            first = rank - at[axis] * place[axis]
            return list(range(first, first + size * place[axis], place[axis]))
        if axis == "dp_cp":   # Megatron's data-parallel group with context parallelism: (cp, dp) index cp + cp x dp
            index = range(size)
        elif axis == "ep":
            index = [at["edp"] * self.ep + i for i in range(size)]
        else:   # edp (size has refused any other name)
            index = [i * self.ep + at["ep"] for i in range(size)]
        base = rank - at["cp"] * place["cp"] - at["dp"] * place["dp"]
        return [base + c % self.cp * place["cp"] + c // self.cp * place["dp"] for c in index]

    def _places(self) -> dict[str, int]:
        """Each digit's place value in a global rank (its axis's stride)."""
        places, stride = {}, 1
        for axis in self.axes:
            places[axis], stride = stride, stride * self.size(axis)
        return places

    def _dense(self, at: dict, axis: Optional[str] = None, index: int = 0) -> int:
        """The rank at ``at``'s dense coordinates (``axis`` moved to ``index``), its carved ones ignored."""
        return self.rank(**{a: at[a] for a in AXES if a != "ep"} | ({axis: index} if axis else {}))

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` (fix every other coordinate, walk the axis), by their first rank."""
        return [self.group(axis, r) for r in range(self.world) if self.coordinates(r)[axis] == 0]

    def node(self, rank: int) -> int:
        return rank // self.per_node

    # -- each group's network ----------------------------------------------------------------------
    @staticmethod
    def class_of(axis: str, name: str) -> Optional[str]:
        """``name`` where ``axis``'s network is one per traffic class (each with chains of its own), else None:
        what ``network_spec`` takes as ``traffic`` for that class."""
        return name if "{traffic}" in _NETWORKS[axis].stream else None

    def network_spec(self, axis: str, rank: int, settings: dict, lossy: Optional[tuple[str, ...]] = None,
                     traffic: Optional[str] = None) -> NetworkSpec:
        """The network of ``rank``'s ``axis`` group (``tp``, ``cp``, ``dp``, ``dp_cp``, ``ep``, ``edp``; ``pp``: the
        pipeline boundary after ``rank``'s stage) on the run's network ``settings`` (``NetworkSpec``'s keys):
        its ranks on the nodes the mesh puts them, streams of its own (``_NETWORKS``). ``lossy``: the
        directions that may lose packets, every message a candidate (site selection picks TP sites); TP's
        group is the run's own network and takes none. ``traffic``: ``ep``'s class (``ep_dispatch`` or
        ``ep_combine``), each with chains of its own."""
        if axis not in _NETWORKS:
            raise ValueError(f"axis={axis!r}: a group's network is one of {', '.join(_NETWORKS)}")
        if (lossy is None) != (axis == "tp") or (traffic is not None) != (axis == "ep"):
            raise ValueError(f"{axis}'s network takes {'no ' if axis == 'tp' else ''}lossy directions and "
                             f"{'a' if axis == 'ep' else 'no'} traffic class")
        ranks = self._boundary(rank) if axis == "pp" else self.group(axis, rank)
        at, declared = self.coordinates(rank), _NETWORKS[axis]
        seed = stream_seed(settings["seed"], _stream(declared.stream, {**at, "traffic": traffic}), "network")
        placed = {**settings, "ranks": len(ranks)} | ({"nics_per_node": None} if declared.own_nics else {})
        if str(settings.get("fabric") or "none").strip().lower() not in ("none", ""):
            # on a fabric, the group's routes follow its global ranks; ECMP's hash, the run's seed
            placed["placement"] = (tuple(ranks), self.per_node, settings["seed"])
        if axis == "tp":   # the run's own network: moved only where the mesh spreads ranks over nodes
            if self.ranks_per_node is not None and self.world > self.tp:
                placed["ranks_per_node"] = self._per_node(ranks)
            return NetworkSpec(**{**placed, **({"seed": seed} if at["dp"] or at["pp"] or at["cp"] else {})})
        return NetworkSpec(**{**placed, "ranks_per_node": self._per_node(ranks), "seed": seed,
                              "lossy_layers": "all", "lossy_sites": "all", "lossy": lossy})

    def _boundary(self, rank: int) -> list[int]:
        """The pipeline boundary after ``rank``'s stage b, the one network that is no axis's group: stage b's
        TP group then stage b + 1's (local rank t and ``tp + t``) at ``rank``'s replica and context rank."""
        at = self.coordinates(rank)
        if at["pp"] >= self.pp - 1:
            has = f"a pipeline of {self.pp} stages has boundaries 0..{self.pp - 2}" if self.pp > 1 else \
                "one stage has no pipeline boundary"
            raise ValueError(f"boundary={at['pp']}: {has}")
        return self.group("tp", rank) + self.group("tp", self._dense(at, "pp", at["pp"] + 1))

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
        """dist's process groups: per axis (``tp``, ``dp``, ``pp``, ...; ``ep`` and ``edp`` with experts), each
        global rank's group. Every process creates every group, in the same order, as torch.distributed
        requires."""
        import torch.distributed as dist
        out = {}
        for axis in self.axes + (CARVED if self.ep > 1 else ()):
            out[axis] = {}
            for ranks in self.groups(axis):
                out[axis].update(dict.fromkeys(ranks, dist.new_group(ranks)))
        if self.cp > 1:   # the gradients' group (``dp_cp``; one replica's: its context group's ranks)
            out["dp_cp"] = {}
            for ranks in [self.group("dp_cp", r) for r in range(self.world) if self.coordinates(r)["dp"] ==
                          self.coordinates(r)["cp"] == 0]:
                out["dp_cp"].update(dict.fromkeys(ranks, dist.new_group(ranks)))
        return out
