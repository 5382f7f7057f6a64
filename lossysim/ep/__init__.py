"""Expert parallelism: a mixture of experts' routed experts sharded over the mesh's ep groups, tokens
dispatched to them and combined back through the lossy network's all-to-all (see docs/experts.md)."""
from .apply import ExpertParallelism, apply_ep, check, expert_parameters, shard_experts
from .experts import ExpertParallel

__all__ = ["ExpertParallel", "ExpertParallelism", "apply_ep", "check", "expert_parameters", "shard_experts"]
