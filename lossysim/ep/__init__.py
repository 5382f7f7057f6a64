"""Expert parallelism: a mixture of experts' routed experts sharded over the mesh's ep groups, tokens
dispatched to them and combined back through the lossy network's all-to-all (see docs/experts.md).

Its names are imported on first use (PEP 562): ``config`` reads the package's declaration
(``axis.py``) before the modules below can be imported.
"""
import importlib

_EXPORTS = {"ExpertParallelism": ".apply", "apply_ep": ".apply", "check": ".apply",
            "expert_parameters": ".apply", "shard_experts": ".apply", "ExpertParallel": ".experts"}
__all__ = ["ExpertParallel", "ExpertParallelism", "apply_ep", "check", "expert_parameters", "shard_experts"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
