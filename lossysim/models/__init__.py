"""The runner's models: named random-weight shapes, or pretrained weights by name or directory.

The names below load ``build`` (and transformers' modeling code) when first asked for, so ``models.shapes`` and
``models.cost`` cost an estimate of a named shape nothing more."""
from ..util import lazy_exports

_EXPORTS = {"NAMED_MAX_POSITIONS": ".shapes", "NAMED_SHAPES": ".shapes", "build_model": ".build",
            "check_max_length": ".build", "is_pretrained": ".build", "max_positions": ".build"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
