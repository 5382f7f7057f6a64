"""Context parallelism: long sequences split across ranks, keys and values over the lossy network."""
from .context import ContextParallel, apply_cp

__all__ = ["ContextParallel", "apply_cp"]
