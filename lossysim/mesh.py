"""Where a run's ranks sit: the (data-parallel, tensor-parallel) mesh, and the network each group
trains over.

Global ranks are tp-major (Megatron's order, pipeline stages not yet among them): TP rank t of
replica r is global rank ``r * tp + t``. A replica's TP group is ``tp`` consecutive ranks; TP position
t's data-parallel group is ranks ``t, tp + t, ...``, one per replica. Nodes hold ``ranks_per_node``
consecutive ranks (default ``tp``: one replica per node).

Every group gets its own ``LossyNetwork``, whose spec is the run's network settings (from config)
placed on the group's ranks: a TP group's ranks share a node as far as nodes allow; a DP
group's ranks share a node only when a node holds several replicas. Each group's links draw from
streams of their own, except replica 0's TP group: a run with one replica keeps its streams.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .net import NetworkSpec
from .util import stream_seed


@dataclass(frozen=True)
class Mesh:
    """``tp`` ranks to a replica, ``dp`` replicas, ``ranks_per_node`` consecutive ranks to a node."""
    tp: int
    dp: int = 1
    ranks_per_node: Optional[int] = None   # None: tp, one replica per node

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def per_node(self) -> int:
        return self.tp if self.ranks_per_node is None else self.ranks_per_node

    def rank(self, replica: int, tp_rank: int) -> int:
        """The global rank of TP rank ``tp_rank`` of replica ``replica``."""
        return replica * self.tp + tp_rank

    def coordinate(self, rank: int) -> tuple[int, int]:
        """(replica, tp_rank) of a global rank."""
        return divmod(rank, self.tp)

    def node(self, rank: int) -> int:
        return rank // self.per_node

    def tp_ranks(self, replica: int) -> list[int]:
        return [self.rank(replica, t) for t in range(self.tp)]

    def dp_ranks(self, tp_rank: int) -> list[int]:
        return [self.rank(r, tp_rank) for r in range(self.dp)]

    def tp_network_spec(self, settings: dict, replica: int = 0) -> NetworkSpec:
        """Replica ``replica``'s TP group on the run's network ``settings`` (``NetworkSpec``'s keys):
        at most the group to a node (when several replicas share the nodes) and, beyond replica 0,
        chains of its own."""
        placed = {**settings, "ranks": self.tp}
        if self.ranks_per_node is not None and self.dp > 1:
            placed["ranks_per_node"] = min(self.ranks_per_node, self.tp)
        if replica:
            placed["seed"] = stream_seed(settings["seed"], f"tp.replica{replica}", "network")
        return NetworkSpec(**placed)

    def dp_network_spec(self, settings: dict, tp_rank: int, lossy: tuple[str, ...]) -> NetworkSpec:
        """TP position ``tp_rank``'s data-parallel group: ``dp`` ranks, one per replica, as many to a
        node as a node holds replicas, their own NICs and chains; ``lossy``: the directions of its
        traffic that may lose packets. Every packet is a candidate: site selection picks TP sites."""
        return NetworkSpec(**{**settings, "ranks": self.dp, "ranks_per_node": max(1, self.per_node // self.tp),
                              "nics_per_node": None, "seed": stream_seed(settings["seed"], f"dp.group{tp_rank}", "network"),
                              "lossy_layers": "all", "lossy_sites": "all", "lossy": lossy})

    def process_groups(self) -> dict:
        """dist's groups: each replica's TP ranks, and each TP position's data-parallel ranks (every
        process creates every group, in the same order, as torch.distributed requires)."""
        import torch.distributed as dist
        return {"tp": [dist.new_group(self.tp_ranks(r)) for r in range(self.dp)],
                "dp": [dist.new_group(self.dp_ranks(t)) for t in range(self.tp)]}
