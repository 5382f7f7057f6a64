"""Megatron-style tensor parallelism for HF models: plans as data, one mechanism applying them.

Its names are imported on first use (PEP 562): ``config`` reads the package's declaration
(``axis.py``) before the modules below can be imported.
"""
import sys
import types

from ..util import lazy_exports

_EXPORTS = {"TensorParallelModel": ".parallelize", "apply_tp": ".parallelize",
            "gather_full_model": ".parallelize", "parallelize": ".parallelize"}
__all__ = ["TensorParallelModel", "apply_tp", "gather_full_model", "parallelize"]

__getattr__ = lazy_exports(__name__, _EXPORTS)


class _Package(types.ModuleType):
    """Importing the submodule ``parallelize`` binds it to the package's name ``parallelize``: the
    function of that name keeps it, as when this file imported it up front."""

    def __setattr__(self, name, value):
        if name in _EXPORTS and isinstance(value, types.ModuleType) and \
                value.__name__ == f"{__name__}.{name}" and hasattr(value, name):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
