"""lossysim: what happens to tensor-parallel training when packets are lost, and what coping costs in time."""
from .loss import Bernoulli, FourState, GilbertElliott, LossModel, NoLoss, Trace, parse_loss_model
from .net import LossyNetwork, NetworkSpec
from .tp import TensorParallelModel, gather_full_model, parallelize

# The old name of the sharded model: GPT-2 was the first (and only) architecture.
TensorParallelGPT2 = TensorParallelModel

__version__ = "0.2.0"
__all__ = ["Bernoulli", "FourState", "GilbertElliott", "LossModel", "NoLoss", "Trace", "parse_loss_model",
           "LossyNetwork", "NetworkSpec", "TensorParallelGPT2", "TensorParallelModel", "gather_full_model", "parallelize"]
