"""What packet loss costs a real model's training step: its collectives through the lossy network, no model.

``estimate(model, network, workload, steps)`` simulates one setting; ``lossysim estimate`` runs a grid
(docs/estimate.md).
"""
from .shapes import NAMES, Shape, load
from .simulate import estimate
from .workload import Workload

__all__ = ["NAMES", "Shape", "Workload", "estimate", "load"]
