"""Context parallelism: long sequences split across ranks, keys and values over the lossy network.

Its names are imported on first use (PEP 562): ``config`` reads the package's declaration
(``axis.py``) before the modules below can be imported.
"""
from ..util import lazy_exports

_EXPORTS = {"ContextParallel": ".context", "apply_cp": ".context"}
__all__ = ["ContextParallel", "apply_cp"]

__getattr__ = lazy_exports(__name__, _EXPORTS)
