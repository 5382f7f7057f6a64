"""Megatron-style tensor parallelism for HF models: plans as data, one mechanism applying them."""
from .parallelize import TensorParallelGPT2, TensorParallelModel, gather_full_model, parallelize

__all__ = ["TensorParallelGPT2", "TensorParallelModel", "gather_full_model", "parallelize"]
