"""lossysim: what happens to tensor-parallel training when packets are lost, and what coping costs in time."""
from .loss import Bernoulli, FourState, GilbertElliott, LossModel, NoLoss, Trace, parse_loss_model
from .net import LossyNetwork
from .tp import TensorParallelGPT2, TensorParallelModel, gather_full_model, parallelize

__version__ = "0.2.0"
__all__ = ["Bernoulli", "FourState", "GilbertElliott", "LossModel", "NoLoss", "Trace", "parse_loss_model",
           "LossyNetwork", "TensorParallelGPT2", "TensorParallelModel", "gather_full_model", "parallelize"]
