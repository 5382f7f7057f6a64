"""Data parallelism: replicas of the tensor-parallel group, their gradient buckets averaged over a lossy
network of the data-parallel links (DDP) or their parameters sharded, gathered and their gradients
reduce-scattered over it (FSDP), and the drift between replicas (what the traffic adds to a step:
``lossysim.clock``).

Its names are imported on first use (PEP 562): ``config`` reads the package's declaration
(``axis.py``) before the modules below can be imported.
"""
from ..util import lazy_exports

_EXPORTS = {"apply_dp": ".apply", "Bucket": ".buckets", "plan_buckets": ".buckets",
            "FullyShardedDataParallel": ".fsdp", "DataParallel": ".replicas", "Replica": ".replica"}
__all__ = ["apply_dp", "Bucket", "plan_buckets", "DataParallel", "FullyShardedDataParallel", "Replica"]

__getattr__ = lazy_exports(__name__, _EXPORTS)
