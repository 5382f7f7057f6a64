"""Megatron-style tensor parallelism for HF models: plans as data, one mechanism applying them.

Its names are imported on first use (PEP 562): ``config`` reads the package's declaration
(``axis.py``) before the modules below can be imported.
"""
import importlib

_EXPORTS = {"TensorParallelModel": ".parallelize", "apply_tp": ".parallelize",
            "gather_full_model": ".parallelize", "parallelize": ".parallelize"}
__all__ = ["TensorParallelModel", "apply_tp", "gather_full_model", "parallelize"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
