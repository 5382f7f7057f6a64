"""What packet loss costs a real model's training step: its collectives through the lossy network, no model.

``estimate(model, config, workload, steps)`` simulates one setting (a training run's config); ``lossysim estimate`` runs a grid
(docs/estimate.md).
"""
from .shapes import NAMES, Shape, load
from .simulate import estimate
from .workload import Workload, job_config

__all__ = ["NAMES", "Shape", "Workload", "estimate", "job_config", "load"]
