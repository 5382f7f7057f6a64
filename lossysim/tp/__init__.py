"""Megatron-style tensor parallelism for HF models: plans as data, one mechanism applying them."""
from .parallelize import TensorParallelModel, apply_tp, gather_full_model, parallelize

__all__ = ["TensorParallelModel", "apply_tp", "gather_full_model", "parallelize"]
