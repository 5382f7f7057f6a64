"""Where the ranks sit: nodes, link classes, and which links can lose packets.

Ranks ``0 .. R-1`` are placed on nodes in order, ``ranks_per_node`` to a node
(rank r is on node ``r // ranks_per_node``). A directed link between two ranks of
the same node is ``intra`` (NVLink inside a server), otherwise ``inter`` (the
network between servers). With ``lossy_links="inter_node"`` only inter-node links
lose packets: the setting for tensor parallelism that spans machines.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

LINK_CLASSES = ("intra", "inter")
LOSSY_LINKS = ("all", "inter_node")


@dataclass(frozen=True)
class Topology:
    ranks: int
    ranks_per_node: Optional[int] = None    # None: every rank on one node
    lossy_links: str = "all"                 # all | inter_node

    def __post_init__(self):
        if int(self.ranks) < 1:
            raise ValueError(f"ranks={self.ranks} must be >= 1")
        per_node = self.ranks if self.ranks_per_node is None else int(self.ranks_per_node)
        if per_node < 1:
            raise ValueError(f"ranks_per_node={self.ranks_per_node} must be >= 1")
        if self.ranks % per_node:
            raise ValueError(f"ranks_per_node={per_node} does not divide ranks={self.ranks}")
        if self.lossy_links not in LOSSY_LINKS:
            raise ValueError(f"lossy_links={self.lossy_links!r} must be one of {', '.join(LOSSY_LINKS)}")
        object.__setattr__(self, "ranks_per_node", per_node)

    @property
    def nodes(self) -> int:
        return self.ranks // self.ranks_per_node

    @property
    def has_lossy_link(self) -> bool:
        """Whether any link between two ranks can lose packets."""
        return self.ranks > 1 and (self.lossy_links == "all" or self.nodes > 1)

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def link_class(self, src: int, dst: int) -> str:
        return "intra" if self.node(src) == self.node(dst) else "inter"

    def lossy(self, src: int, dst: int) -> bool:
        """Whether packets on the link src -> dst can be lost."""
        return self.lossy_links == "all" or self.link_class(src, dst) == "inter"
