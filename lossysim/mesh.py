"""Where a run's ranks sit: the (data-parallel, pipeline, tensor-parallel) mesh, and the network each
group trains over.

Global ranks are laid out tp innermost, then pp, then dp (Megatron's and torchtitan's order): TP rank
t of pipeline stage s of replica r is global rank ``(r * pp + s) * tp + t``. A stage's TP group is
``tp`` consecutive ranks; TP position t of stage s has a data-parallel group (one rank per replica)
and each replica's TP position t a pipeline (one rank per stage). Nodes hold ``ranks_per_node``
consecutive ranks (default ``tp``: a stage's TP group to a node, so every pipeline boundary and every
data-parallel link crosses nodes). With ``pp == 1`` this is the (replica, TP rank) mesh it always was.

Every group gets its own ``LossyNetwork``, whose spec is the run's network settings (from config)
placed on the group's ranks: a TP group's ranks share a node as far as nodes allow; a DP group's
ranks share a node only when a node holds several replicas; a pipeline boundary's network holds the
two stages' TP groups. Each group's links draw from streams of their own, except replica 0's first
stage's TP group: a run with one replica and one stage keeps its streams.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .net import NetworkSpec
from .util import stream_seed


@dataclass(frozen=True)
class Mesh:
    """``tp`` ranks to a stage, ``pp`` stages to a replica, ``dp`` replicas, ``ranks_per_node``
    consecutive ranks to a node."""
    tp: int
    dp: int = 1
    ranks_per_node: Optional[int] = None   # None: tp, one stage's TP group per node
    pp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def per_node(self) -> int:
        return self.tp if self.ranks_per_node is None else self.ranks_per_node

    def rank(self, replica: int, tp_rank: int, stage: int = 0) -> int:
        """The global rank of TP rank ``tp_rank`` of stage ``stage`` of replica ``replica``."""
        return (replica * self.pp + stage) * self.tp + tp_rank

    def position(self, rank: int) -> tuple[int, int, int]:
        """(replica, stage, tp_rank) of a global rank."""
        group, tp_rank = divmod(rank, self.tp)
        replica, stage = divmod(group, self.pp)
        return replica, stage, tp_rank

    def coordinate(self, rank: int) -> tuple[int, int]:
        """(replica, tp_rank) of a global rank (its stage: ``position``)."""
        replica, _, tp_rank = self.position(rank)
        return replica, tp_rank

    def node(self, rank: int) -> int:
        return rank // self.per_node

    def tp_ranks(self, replica: int, stage: int = 0) -> list[int]:
        return [self.rank(replica, t, stage) for t in range(self.tp)]

    def dp_ranks(self, tp_rank: int, stage: int = 0) -> list[int]:
        return [self.rank(r, tp_rank, stage) for r in range(self.dp)]

    def pp_ranks(self, replica: int, tp_rank: int) -> list[int]:
        """Replica ``replica``'s TP position ``tp_rank`` stage by stage: one pipeline."""
        return [self.rank(replica, tp_rank, s) for s in range(self.pp)]

    def stage_ranks(self, stage: int) -> list[int]:
        """Every rank that holds stage ``stage`` (of every replica, at every TP position)."""
        return [self.rank(r, t, stage) for r in range(self.dp) for t in range(self.tp)]

    def tp_network_spec(self, settings: dict, replica: int = 0, stage: int = 0) -> NetworkSpec:
        """Replica ``replica``'s stage ``stage``'s TP group on the run's network ``settings``
        (``NetworkSpec``'s keys): at most the group to a node (when several groups share the nodes)
        and, beyond replica 0's first stage, chains of its own."""
        placed = {**settings, "ranks": self.tp}
        if self.ranks_per_node is not None and self.dp * self.pp > 1:
            placed["ranks_per_node"] = min(self.ranks_per_node, self.tp)
        if stage:
            placed["seed"] = stream_seed(settings["seed"], f"tp.replica{replica}.stage{stage}", "network")
        elif replica:
            placed["seed"] = stream_seed(settings["seed"], f"tp.replica{replica}", "network")
        return NetworkSpec(**placed)

    def dp_network_spec(self, settings: dict, tp_rank: int, lossy: tuple[str, ...], stage: int = 0) -> NetworkSpec:
        """Stage ``stage``'s TP position ``tp_rank``'s data-parallel group: ``dp`` ranks, one per
        replica, as many to a node as a node holds replicas, their own NICs and chains; ``lossy``: the
        directions of its traffic that may lose packets. Every packet is a candidate: site selection
        picks TP sites."""
        group = f"dp.group{tp_rank}" if not stage else f"dp.stage{stage}.group{tp_rank}"
        replicas_per_node = max(1, self.per_node // (self.tp * self.pp))
        return NetworkSpec(**{**settings, "ranks": self.dp, "ranks_per_node": replicas_per_node,
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
        the consecutive global ``ranks`` on the nodes the mesh puts them."""
        nodes = [self.node(r) for r in ranks]
        for size in range(1, len(ranks) + 1):   # a new node exactly where a block begins
            if len(ranks) % size == 0 and all((nodes[i] != nodes[i - 1]) == (i % size == 0)
                                              for i in range(1, len(ranks))):
                return size
        raise ValueError(f"ranks_per_node={self.per_node} puts ranks {ranks} on nodes {nodes}, "
                         "unevenly: use a multiple or a divisor of tp_size")

    def process_groups(self) -> dict:
        """dist's groups (every process creates every group, in the same order, as torch.distributed
        requires): ``tp``, each stage's TP ranks, indexed ``replica * pp + stage`` (a rank's: ``rank //
        tp``); ``dp``, each TP position's data-parallel ranks, indexed ``stage * tp + tp_rank`` (``rank %
        (tp * pp)``); ``pp``, each pipeline, indexed ``replica * tp + tp_rank`` (none when ``pp == 1``)."""
        import torch.distributed as dist
        return {"tp": [dist.new_group(self.tp_ranks(r, s)) for r in range(self.dp) for s in range(self.pp)],
                "dp": [dist.new_group(self.dp_ranks(t, s)) for s in range(self.pp) for t in range(self.tp)],
                "pp": [dist.new_group(self.pp_ranks(r, t)) for r in range(self.dp) for t in range(self.tp)]
                if self.pp > 1 else []}
