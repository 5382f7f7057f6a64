"""Megatron-style tensor parallelism for HF models: plans as data, one mechanism applying them."""
from .parallelize import TensorParallelModel, gather_full_model, parallelize

__all__ = ["TensorParallelModel", "gather_full_model", "parallelize"]
