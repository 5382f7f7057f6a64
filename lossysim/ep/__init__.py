"""Expert parallelism: a mixture of experts' routed experts sharded over the mesh's ep groups, tokens
dispatched to them and combined back through the lossy network's all-to-all (see docs/experts.md).

Its names are imported on first use (PEP 562): ``config`` reads the package's declaration
(``axis.py``) before the modules below can be imported.
"""
from ..util import lazy_exports

_EXPORTS = {"ExpertParallelism": ".apply", "apply_ep": ".apply", "check": ".apply",
            "expert_parameters": ".apply", "shard_experts": ".apply", "ExpertParallel": ".experts"}
__all__ = ["ExpertParallel", "ExpertParallelism", "apply_ep", "check", "expert_parameters", "shard_experts"]

__getattr__ = lazy_exports(__name__, _EXPORTS)
