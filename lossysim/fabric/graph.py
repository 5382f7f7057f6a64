"""A fabric: the nodes' NICs (one per rail), the switches above them and the directed cables between.

Endpoints are named: a NIC ``node{n}.nic{r}`` (node n's NIC on rail r), a switch by its own name
(``leaf3``, ``spine1``, ``core0``). A physical cable is two directed cables, each its own loss
process: ``leaf3-spine1`` carries leaf3's packets up to spine1, ``spine1-leaf3`` the way back.
Parallel cables between one pair are ``leaf3-spine1.0``, ``leaf3-spine1.1``, ...; each is its own
ECMP member. NICs never forward: a route runs NIC, switches, NIC along a shortest path (in hops),
and ``next_hops`` gives the cables that bring a packet one hop nearer its destination NIC: the
equal-cost choices a switch's ECMP hash picks from.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

NIC = re.compile(r"^node(\d+)\.nic(\d+)$")


@dataclass(frozen=True)
class Cable:
    name: str
    src: str
    dst: str
    gbps: float


def nic(node: int, rail: int) -> str:
    return f"node{node}.nic{rail}"


class Fabric:
    """``nodes`` servers of ``rails`` NICs each, ``switches`` (named, lowest tier first) and
    ``links``: physical cables ``(a, b, gbps, count)``, each made two directed cables per count.
    Building one checks it: an unknown endpoint, a NIC without a cable or two NICs no route joins
    is a one-line ValueError naming it."""

    def __init__(self, name: str, nodes: int, rails: int, switches: list[str],
                 links: list[tuple[str, str, float, int]]):
        self.name, self.nodes, self.rails = name, int(nodes), int(rails)
        self.switches = tuple(switches)
        if len(set(self.switches)) != len(self.switches):
            raise ValueError(f"fabric {name}: a switch is named twice")
        known = set(self.switches)
        cables, out = [], {}
        for a, b, gbps, count in links:
            for end in (a, b):
                if end not in known and not self._is_nic(end):
                    raise ValueError(f"fabric {name}: cable {a}-{b} names {end!r}, which is neither a switch "
                                     f"nor a NIC node0.nic0 .. node{self.nodes - 1}.nic{self.rails - 1}")
            if a == b or (self._is_nic(a) and self._is_nic(b)):
                raise ValueError(f"fabric {name}: cable {a}-{b} must join a switch to a NIC or another switch")
            for src, dst in ((a, b), (b, a)):
                for k in range(count):
                    cable = f"{src}-{dst}" + (f".{k}" if count > 1 else "")
                    out.setdefault(src, []).append(len(cables))
                    cables.append(Cable(cable, src, dst, float(gbps)))
        self.cables = tuple(cables)
        self.index = {c.name: i for i, c in enumerate(cables)}
        if len(self.index) != len(cables):
            raise ValueError(f"fabric {name}: two entries cable the same pair; give one entry a count")
        self._out = {end: tuple(ids) for end, ids in out.items()}
        self._far: dict[tuple[str, ...], dict[str, int]] = {}
        self._hops: dict[tuple[str, str], tuple[int, ...]] = {}   # next_hops, once per (switch, NIC)
        import networkx as nx   # here: a run without a fabric never builds one, and never pays its import
        self._graph = nx.Graph()
        self._graph.add_nodes_from(self.switches)
        self._graph.add_edges_from((c.src, c.dst) for c in cables if c.src in known and c.dst in known)
        for n in range(self.nodes):
            for r in range(self.rails):
                if not self._attached(nic(n, r)):
                    raise ValueError(f"fabric {name}: {nic(n, r)} has no cable to a switch")
        joined = nx.node_connected_component(self._graph, self._attached(nic(0, 0))[0])
        unreached = [nic(n, r) for n in range(self.nodes) for r in range(self.rails)
                     if self._attached(nic(n, r))[0] not in joined]
        if unreached:
            raise ValueError(f"fabric {name}: no route joins {nic(0, 0)} to {unreached[0]}")

    def _is_nic(self, end: str) -> bool:
        match = NIC.match(end)
        return bool(match) and int(match[1]) < self.nodes and int(match[2]) < self.rails

    def _attached(self, end: str) -> tuple[str, ...]:
        """The switches a NIC's cables reach."""
        return tuple(dict.fromkeys(self.cables[i].dst for i in self._out.get(end, ())))

    # -- what a user names ---------------------------------------------------------------------------
    def cable(self, name: str) -> int:
        """The index of the directed cable ``name``, or a one-line ValueError with the nearest names."""
        if name in self.index:
            return self.index[name]
        near = difflib.get_close_matches(name, self.index, n=3) or \
            [c for c in self.index if c.startswith(f"{name}.")][:3]
        hint = f" (nearest: {', '.join(near)})" if near else ""
        raise ValueError(f"cable {name!r} is not in fabric {self.name}{hint}")

    def tier(self, end: str) -> str:
        """``nic``, or a switch's name without its number (``leaf``, ``spine``, ``core``)."""
        return "nic" if NIC.match(end) else end.rstrip("0123456789")

    def count(self) -> dict[str, int]:
        """Switches per tier and physical cables per pair of tiers (``leaf-spine``: 512, ...)."""
        tiers = ["nic", *dict.fromkeys(self.tier(s) for s in self.switches)]
        out: dict[str, int] = {}
        for switch in self.switches:
            out[self.tier(switch)] = out.get(self.tier(switch), 0) + 1
        for c in self.cables:
            low, high = sorted((self.tier(c.src), self.tier(c.dst)), key=tiers.index)
            if self.tier(c.src) == low:      # each physical cable once: its upward direction
                out[f"{low}-{high}"] = out.get(f"{low}-{high}", 0) + 1
        return out

    def check_nodes(self, nodes: int) -> None:
        if nodes > self.nodes:
            raise ValueError(f"fabric {self.name} has {self.nodes} nodes; the layout needs {nodes}")

    # -- routes ----------------------------------------------------------------------------------------
    def next_hops(self, at: str, dst: str) -> tuple[int, ...]:
        """The cables from ``at`` one hop nearer NIC ``dst`` along a shortest path (ECMP's choices)."""
        key = (at, dst)
        if key not in self._hops:
            self._hops[key] = self._next_hops(at, dst)
        return self._hops[key]

    def _next_hops(self, at: str, dst: str) -> tuple[int, ...]:
        far = self._distances(self._attached(dst))
        ids = self._out[at]
        direct = tuple(i for i in ids if self.cables[i].dst == dst)
        if direct:
            return direct
        ahead = [i for i in ids if self.cables[i].dst in far]
        best = min(far[self.cables[i].dst] for i in ahead)
        return tuple(i for i in ahead if far[self.cables[i].dst] == best)

    def _distances(self, targets: tuple[str, ...]) -> dict[str, int]:
        """Hops from each switch to the nearest of ``targets`` (a NIC's switches), kept per target set."""
        if targets not in self._far:
            import networkx as nx
            self._far[targets] = nx.multi_source_dijkstra_path_length(self._graph, set(targets))
        return self._far[targets]

    def __repr__(self) -> str:
        return f"Fabric({self.name!r}: {self.nodes} nodes x {self.rails} NICs, {len(self.switches)} switches)"

