"""GPT-2's tensor-parallel names, kept for existing imports: the mechanism is ``lossysim.tensor_parallel``
and GPT-2's plan is ``lossysim.plans.GPT2``."""
from .tensor_parallel import TensorParallelGPT2, TensorParallelModel, gather_full_model, parallelize

__all__ = ["TensorParallelGPT2", "TensorParallelModel", "gather_full_model", "parallelize"]
