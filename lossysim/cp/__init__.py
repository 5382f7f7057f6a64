"""Context parallelism: long sequences split across ranks, keys and values over the lossy network.

Its names are imported on first use (PEP 562): ``config`` reads the package's declaration
(``axis.py``) before the modules below can be imported.
"""
import importlib

_EXPORTS = {"ContextParallel": ".context", "apply_cp": ".context"}
__all__ = ["ContextParallel", "apply_cp"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
