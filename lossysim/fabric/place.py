"""A group's links on the fabric: which cables each directed link between two of its ranks crosses, and
which of those lose packets (``Placement``, what a network under a fabric draws from).

A network's ranks are local (0 .. R-1); ``ranks`` names each one's global rank, which puts it on node
``rank // ranks_per_node`` at local index ``rank % ranks_per_node`` (rail ``local mod rails``). A link
carries ``channels`` connections (NCCL's channels) of ``qps_per_connection`` queue pairs each; packet j of a
link's traffic in a call rides channel ``j mod channels`` (the channels interleave, side by side), and within
it the route whose ``(modulus, residue)`` holds ``j // channels`` (``Route``). A link's flows are its
(src, dst, channel, queue pair): each hashed at every switch (or sprayed), stable across calls and
processes (``routes``).

How a cable's loss process is attached: ``losses`` maps a cable's index to its ``LossModel``
(``cable_losses``: named bad links, a CorrOpt share, every cable alike); ``Placement.model(cable)`` is
what a network's chain for that cable steps. Anything that changes which cables lose packets, or how,
hands a placement another ``losses`` mapping (``Placement.with_losses``); nothing else changes.
"""
from __future__ import annotations

import functools
from typing import Mapping, Optional

from ..loss import Bernoulli, LossModel
from .cables import cable_losses
from .graph import Fabric
from .presets import parse_fabric
from .routes import Routes

ROUTINGS = ("ecmp", "spray")


@functools.lru_cache(maxsize=16)
def fabric_of(text: str) -> Optional[Fabric]:
    """``parse_fabric``, once per spelling: building a 2,048-NIC fabric's graph is most of a spec's cost."""
    return parse_fabric(text)


@functools.lru_cache(maxsize=64)
def routes_of(fabric: Fabric, per_node: int, seed: int, qps: int, pxn: bool, spray: bool) -> Routes:
    """One ``Routes`` per fabric and hash setting, shared by every group (its routes are worked out once)."""
    return Routes(fabric, per_node, seed, qps, pxn, spray)


@functools.lru_cache(maxsize=64)
def losses_of(fabric: Fabric, bad_links: tuple[str, ...], corrupt_share: float, every_cable: Optional[str],
              seed: int) -> tuple[tuple[int, LossModel], ...]:
    return tuple(sorted(cable_losses(fabric, bad_links, corrupt_share, every_cable, seed).items()))


class Placement:
    """A network's ranks (``ranks``: the global rank of each local one) on ``fabric``: per directed link
    (src, dst local ranks, worked out on first use), the entries of its packets that cross each lossy cable,
    and the probability that one of its packets is lost somewhere on its route (memoryless, for ``rescale``)."""

    def __init__(self, fabric: Fabric, routes: Routes, ranks: tuple[int, ...], channels: int,
                 losses: Mapping[int, LossModel]):
        self.fabric, self.routes, self.ranks, self.channels = fabric, routes, tuple(ranks), int(channels)
        self.losses = dict(losses)
        self._paths: dict[tuple[int, int], list] = {}
        self._lossy: dict[tuple[int, int], tuple] = {}

    def paths(self, src: int, dst: int) -> list[tuple[tuple[int, ...], int, int]]:
        """The link's flows: (cables, modulus, residue) of each (channel, queue pair or sprayed path)."""
        key = (src, dst)
        if key not in self._paths:
            flows = []
            for c in range(self.channels):
                for route in self.routes.connection(self.ranks[src], self.ranks[dst], c):
                    flows.append((route.cables, self.channels * route.modulus, c + self.channels * route.residue))
            self._paths[key] = flows
        return self._paths[key]

    def lossy(self, src: int, dst: int) -> tuple[tuple[int, int, int], ...]:
        """(cable, modulus, residue) of each flow of the link on each lossy cable it crosses."""
        key = (src, dst)
        if key not in self._lossy:
            self._lossy[key] = tuple((cable, m, r) for cables, m, r in self.paths(src, dst)
                                     for cable in cables if cable in self.losses)
        return self._lossy[key]

    def rate(self, src: int, dst: int) -> float:
        """The share of the link's packets lost somewhere on their routes, each cable at its loss rate."""
        total = 0.0
        for cables, modulus, _ in self.paths(src, dst):
            arrive = 1.0
            for cable in cables:
                if cable in self.losses:
                    arrive *= 1.0 - self.losses[cable].loss_rate
            total += (1.0 - arrive) / modulus
        return total

    def crosses(self, src: int, dst: int) -> dict[int, float]:
        """Each lossy cable the link crosses -> the share of the link's packets that cross it."""
        out: dict[int, float] = {}
        for cable, modulus, _ in self.lossy(src, dst):
            out[cable] = out.get(cable, 0.0) + 1.0 / modulus
        return out

    def counts(self, src: int, dst: int) -> tuple[tuple[int, int, int], ...]:
        """The link's flows as (modulus, residue, lossy cables crossed): all that a packet's fate depends on
        when the fabric is ``uniform``."""
        return tuple((m, r, sum(cable in self.losses for cable in cables)) for cables, m, r in self.paths(src, dst))

    @property
    def uniform(self) -> bool:
        """Whether every cable of the fabric loses packets independently at one rate (one Bernoulli model on
        all of them: ``every_cable`` with no named cable or CorrOpt draw that differs). A packet over c cables
        is then lost with probability 1 - (1 - p)^c, whichever cables they are, and flows that share a cable
        share nothing but its stream."""
        models = list(self.losses.values())
        return len(models) == len(self.fabric.cables) and all(
            isinstance(m, Bernoulli) and m.p == models[0].p for m in models)

    def any_lossy(self) -> bool:
        """Whether a link between two of the ranks (on different nodes) crosses a lossy cable (once)."""
        if not hasattr(self, "_any"):
            count = len(self.ranks)
            self._any = bool(self.losses) and any(self.lossy(s, d) for s in range(count)
                                                  for d in range(count) if s != d)
        return self._any

    def with_losses(self, losses: Mapping[int, LossModel]) -> "Placement":
        """The same routes with other cables lossy, or the same ones with other models."""
        return Placement(self.fabric, self.routes, self.ranks, self.channels, losses)

    def model(self, cable: int) -> LossModel:
        """The loss process a lossy cable's chains step."""
        return self.losses[cable]

    def name(self, cable: int) -> str:
        return self.fabric.cables[cable].name


@functools.lru_cache(maxsize=8192)
def placement(fabric_text: str, ranks: tuple[int, ...], per_node: int, *,
              channels: int, seed: int, qps_per_connection: int = 1, pxn: bool = True, routing: str = "ecmp",
              bad_link: tuple[str, ...] = (), corrupt_share: float = 0.0,
              every_cable: Optional[str] = None) -> Placement:
    """The placement of a network whose local rank i is global rank ``ranks[i]``, ``per_node``
    global ranks to a node; ``seed``: the run's root seed (ECMP's hash and CorrOpt's draw, alike for every
    group). A fabric too small for the ranks, an unknown cable or a bad setting: a one-line ValueError."""
    fabric = fabric_of(str(fabric_text))
    if routing not in ROUTINGS:
        raise ValueError(f"routing={routing!r} must be one of {', '.join(ROUTINGS)}")
    nodes = max(ranks) // per_node + 1
    fabric.check_nodes(nodes)
    if per_node % fabric.rails and fabric.rails % per_node and per_node > 1:
        raise ValueError(f"fabric {fabric.name} has {fabric.rails} rails: ranks_per_node={per_node} must be a "
                         "multiple or a divisor of it")
    routes = routes_of(fabric, int(per_node), int(seed), int(qps_per_connection), bool(pxn), routing == "spray")
    losses = dict(losses_of(fabric, tuple(bad_link), float(corrupt_share), every_cable, int(seed)))
    return Placement(fabric, routes, ranks, channels, losses)
