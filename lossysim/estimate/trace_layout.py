"""A profiler trace's process groups on a config's mesh (``Layout``): each group's axis and traffic class,
and the network each call goes to, or why it is not sent (docs/estimate.md, "Estimate your own job").

Each process group is matched to the mesh axis whose group it is (``Mesh.group``): a TP group's calls are
``tp``, a data-parallel group's all-reduces ``dp`` and its all-gathers and reduce-scatters ``fsdp``, a send
between neighbouring pipeline stages ``pp`` (activations forward, gradients back); any other axis's, the
traffic class ``traffic`` declares for it. A group that is no axis's group (the world group of a 3-D job) and
a send between stages that are not neighbours go nowhere. Each group's network is the one the mesh gives that
group (``Mesh.network_spec`` of its axis; any other group placed on its nodes with
streams of its own), every packet a candidate.

On a fabric every group's network sits on the traced job's own global ranks (its nodes and rails), so its
routes, the lossy cables it crosses and the blast radius are the traced job's: a group of another axis
carries its ranks as its placement, and with context parallelism each context rank's data-parallel group
is a network of its own (without a fabric they are alike and share one, as before). A call's local ranks
are the network's order of them, whatever order the trace lists the group in.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from .. import traffic
from ..config import ExperimentConfig
from ..net import NetworkSpec
from ..util import stream_seed
from .trace import Call, Trace

_GATHER = ("all_gather", "reduce_scatter")


class Place(NamedTuple):
    """Where a group's calls go: their class, the network's key and spec, and each global rank's index."""
    cls: str
    key: tuple
    spec: NetworkSpec
    local: dict


class Layout:
    """The process groups of a trace on a config's mesh: each group's axis and traffic class, or why none."""

    def __init__(self, trace: Trace, config: ExperimentConfig):
        self.mesh = mesh = config.mesh()
        if mesh.world != trace.world:
            raise ValueError(f"the trace's world is {trace.world} ranks, the layout's {mesh.name}: give "
                             "--tp-size, --pp-size and --dp-size (and --ranks-per-node) that make the traced job")
        self.config, self.settings = config, config.network_settings()
        self.fabric = str(self.settings.get("fabric") or "none").strip().lower() not in ("none", "")
        if self.fabric and trace.mirrored:   # its groups stand for alike groups; a fabric's cables make them unalike
            raise ValueError(f"fabric={self.settings['fabric']} needs every rank's trace (a folder of them): one "
                             "file whose peers mirror it simulates only its own groups, which may cross no lossy cable")
        self.axis = {name: self._axis(ranks) for name, ranks in trace.groups.items()}
        self._placed: dict = {}

    def _axis(self, ranks: tuple) -> Optional[str]:
        for axis in self.mesh.axes:
            if self.mesh.sizes[axis] == len(ranks) and set(self.mesh.group(axis, ranks[0])) == set(ranks):
                return axis
        return None

    def describe(self, trace: Trace) -> dict:
        return {name: self.axis[name] or f"no axis of {self.mesh.name}" for name in trace.groups}

    def place(self, call: Call, ranks: tuple) -> tuple[Optional[Place], Optional[tuple], str]:
        """(where the call goes or None, a send's (source, destination) in that network, its direction)."""
        p2p = call.kind in ("send", "recv")
        key = (call.group, call.kind, call.rank, call.peer) if p2p else (call.group, call.kind in _GATHER)
        if key not in self._placed:
            self._placed[key] = self._place(call, ranks)
        place, pair, direction = self._placed[key]
        cls = place.cls if place else None
        return place, pair, direction if p2p or cls is None else _direction(cls, call)

    def _place(self, call: Call, ranks: tuple) -> tuple[Optional[Place], Optional[tuple], str]:
        axis = self.axis.get(call.group)
        if axis is None or len(ranks) < 2:
            return None, None, "fwd"
        if call.kind in ("send", "recv"):
            src, dst = (call.rank, call.peer) if call.kind == "send" else (call.peer, call.rank)
            return self._p2p(axis, ranks, src, dst)
        cls = _class_of(axis, call.kind)
        if cls is None:
            return None, None, "fwd"
        direction = _direction(cls, call)
        mesh, at = self.mesh, self.mesh.coordinates(ranks[0])
        members = tuple(ranks)
        if axis == "tp":   # each TP group is a group of its own (a context rank's too), as in training
            first = mesh.alike(ranks[0], "tp")
            spec = mesh.network_spec("tp", first, self.settings)
            key, members = ("tp", first), tuple(mesh.group("tp", ranks[0]))
        elif axis == "dp":
            # the DP groups at a TP rank and stage are alike and share the first's network (every other
            # coordinate 0); on a fabric each (a context rank's) sits on other nodes, a network of its own
            shared = mesh.rank(tp=at["tp"], pp=at["pp"])
            first = mesh.alike(ranks[0], "dp") if self.fabric else shared
            spec = mesh.network_spec("dp", first, self.settings, self.config.lossy_directions(cls))
            key, members = (cls, first), tuple(mesh.group("dp", ranks[0]))
            if first != shared:   # dp's stream names tp and pp alone: the other coordinates make its draws its own
                own, theirs = mesh.coordinates(first), mesh.coordinates(shared)
                named = "".join(f".{a}{own[a]}" for a in own if a in mesh.axes and own[a] != theirs[a])
                spec = spec.replace(seed=stream_seed(spec.seed, f"trace.dp{named}", "network"))
        else:
            spec, key = self._group_spec(axis, ranks, cls), (cls, tuple(ranks))
        spec = spec.replace(lossy_layers="all", lossy_sites="all", lossy=self._lossy(cls, spec))
        return Place(cls, key, spec, {r: i for i, r in enumerate(members)}), None, direction

    def _p2p(self, axis: str, ranks: tuple, src: int, dst: int):
        mesh = self.mesh
        a, b = mesh.coordinates(src), mesh.coordinates(dst)
        if axis == "pp" and abs(a["pp"] - b["pp"]) == 1:
            boundary = min(a["pp"], b["pp"])
            first = mesh.moved(mesh.alike(src, "tp"), pp=boundary)   # the boundary's stage's TP group's first
            spec = mesh.network_spec("pp", first, self.settings, self.config.lossy_directions("pp"))
            members = mesh.group("tp", first) + mesh.group("tp", mesh.moved(first, pp=boundary + 1))
            place = Place("pp", ("pp", first), spec, {r: i for i, r in enumerate(members)})
            return place, (place.local[src], place.local[dst]), "fwd" if b["pp"] > a["pp"] else "bwd"
        cls = _class_of(axis, "send")
        if cls is None or axis == "pp":     # a send between stages that are not neighbours: not modelled
            return None, None, "fwd"
        spec = self._group_spec(axis, ranks, cls)
        place = Place(cls, (cls, tuple(ranks)), spec, {r: i for i, r in enumerate(ranks)})
        return place, (place.local[src], place.local[dst]), "fwd"

    def _group_spec(self, axis: str, ranks: tuple, cls: str) -> NetworkSpec:
        """Any other axis's group on the nodes the mesh puts its ranks, with streams of its own."""
        # on a fabric its routes follow its global ranks (ECMP's hash, the run's seed), as the mesh's groups'
        placed = {"placement": (tuple(ranks), self.mesh.per_node, self.settings["seed"])} if self.fabric else {}
        return NetworkSpec(**{**self.settings, "ranks": len(ranks), "ranks_per_node": self.mesh._per_node(list(ranks)),
                              "seed": stream_seed(self.settings["seed"], f"trace.{axis}.group{ranks[0]}", "network"),
                              "lossy_layers": "all", "lossy_sites": "all",
                              "lossy": self.config.lossy_directions(cls), **placed})

    def _lossy(self, cls: str, spec: NetworkSpec) -> tuple:
        """TP's lossy directions are the spec's (``lossy`` and ``lossy_traffic``); the others', their class's."""
        return spec.lossy if cls == "tp" else self.config.lossy_directions(cls)


def _class_of(axis: str, collective: str) -> Optional[str]:
    if axis == "dp":
        return "fsdp" if collective in _GATHER else "dp"
    named = [c.name for c in traffic.CLASSES if c.axis == axis]
    return named[0] if named else None


def _direction(cls: str, call: Call) -> str:
    if cls == "fsdp":
        return "fwd" if call.kind == "all_gather" else "bwd"
    directions = [d.direction for d in traffic.BY_NAME[cls].directions]
    if len(directions) == 1:
        return directions[0]
    return "bwd" if call.backward else "fwd"
