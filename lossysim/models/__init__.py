"""The runner's models: named random-weight shapes, or pretrained weights by name or directory."""
from .build import NAMED_MAX_POSITIONS, NAMED_SHAPES, build_model, check_max_length, is_pretrained, max_positions

__all__ = ["NAMED_MAX_POSITIONS", "NAMED_SHAPES", "build_model", "check_max_length", "is_pretrained",
           "max_positions"]
