"""Data parallelism: replicas of the tensor-parallel group, their gradient buckets averaged over a lossy
network of the data-parallel links, the drift between replicas, and the time the buckets take."""
from .buckets import Bucket, plan_buckets
from .replicas import DataParallel, Replica
from .timeline import step_seconds

__all__ = ["Bucket", "plan_buckets", "DataParallel", "Replica", "step_seconds"]
