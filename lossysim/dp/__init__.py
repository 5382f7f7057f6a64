"""Data parallelism: replicas of the tensor-parallel group, their gradient buckets averaged over a lossy
network of the data-parallel links (DDP) or their parameters sharded, gathered and their gradients
reduce-scattered over it (FSDP), the drift between replicas, and the time the traffic takes."""
from .apply import apply_dp
from .buckets import Bucket, plan_buckets
from .fsdp import FullyShardedDataParallel
from .replicas import DataParallel, Replica
from .timeline import gathered_forward_seconds, step_seconds

__all__ = ["apply_dp", "Bucket", "plan_buckets", "DataParallel", "FullyShardedDataParallel", "Replica",
           "gathered_forward_seconds", "step_seconds"]
