"""The runner's models: named random-weight shapes, or pretrained weights by name or directory.

The names below load ``build`` (and transformers' modeling code) when first asked for, so ``models.shapes`` and
``models.cost`` cost an estimate of a named shape nothing more."""
import importlib

__all__ = ["NAMED_MAX_POSITIONS", "NAMED_SHAPES", "build_model", "check_max_length", "is_pretrained",
           "max_positions"]


def __getattr__(name):
    if name in ("NAMED_MAX_POSITIONS", "NAMED_SHAPES"):
        return getattr(importlib.import_module(".shapes", __name__), name)
    if name in __all__:
        return getattr(importlib.import_module(".build", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
