"""Data parallelism: replicas of the tensor-parallel group, their gradient buckets averaged over a lossy
network of the data-parallel links (DDP) or their parameters sharded, gathered and their gradients
reduce-scattered over it (FSDP), and the drift between replicas (what the traffic adds to a step:
``lossysim.clock``)."""
from .apply import apply_dp
from .buckets import Bucket, plan_buckets
from .fsdp import FullyShardedDataParallel
from .replicas import DataParallel, Replica

__all__ = ["apply_dp", "Bucket", "plan_buckets", "DataParallel", "FullyShardedDataParallel", "Replica"]
