"""``apply_dp``: a run's replicas made data-parallel over the mesh's DP groups, DDP or FSDP, every
replica in this process (``sim``) or this rank's alone (``dist``): torchtitan's ``apply_ddp`` and
``apply_fsdp`` in one call, so a caller never picks among the four classes."""
from __future__ import annotations

from typing import Optional, Sequence

from ..cp.group import data_parallel_keys
from ..mesh import Mesh
from ..net import LossyNetwork
from .fsdp import DistFullyShardedDataParallel, FullyShardedDataParallel
from .replicas import DataParallel, DistDataParallel, Replica


def apply_dp(replicas: Sequence[Replica], mesh: Mesh, networks: Sequence[Sequence[LossyNetwork]],
             bucket_bytes: float, mode: str = "ddp", rank: int = 0, groups: Optional[dict] = None) -> DataParallel:
    """``replicas`` (the ones this process runs) averaging their gradients over ``networks`` (per stage,
    one per TP position this process holds; none for a group of one). ``groups``: dist's process groups
    (``Mesh.process_groups``), this process being global ``rank``; None: sim. ``mode``: ddp or fsdp
    (a group of one has nothing to shard)."""
    fsdp = mode == "fsdp" and mesh.dp > 1
    # with context parallelism every context rank is a member of its group (Megatron's dp x cp), one
    # replica's too
    contexts = mesh.cp
    if groups is None:
        if fsdp:
            return FullyShardedDataParallel(replicas, networks, bucket_bytes)
        return DataParallel(replicas, networks, bucket_bytes, contexts=contexts)
    at = mesh.coordinates(rank)
    replica, stage, tp_rank = at["dp"], at["pp"], at["tp"]
    kind = DistFullyShardedDataParallel if fsdp else DistDataParallel
    extra = data_parallel_keys(mesh, rank, groups, contexts)
    return kind(replicas[0], networks[0][0], bucket_bytes, replica_index=replica, tp_rank=tp_rank, dp_size=mesh.dp,
                tp_size=mesh.tp, dp_group=groups["dp"][rank], tp_group=groups["tp"][rank], stage=stage,
                pp_group=groups["pp"][rank] if mesh.pp > 1 else None, **extra)
