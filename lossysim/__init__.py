"""lossysim: what happens to tensor-parallel training when packets are lost."""
from .loss_models import Bernoulli, GilbertElliott, LossModel, NoLoss, parse_loss_model
from .network import LossyNetwork

__version__ = "0.1.0"
__all__ = ["Bernoulli", "GilbertElliott", "LossModel", "NoLoss", "parse_loss_model", "LossyNetwork"]
from .tensor_parallel import TensorParallelGPT2, TensorParallelModel, gather_full_model, parallelize  # noqa: E402

__all__ += ["TensorParallelGPT2", "TensorParallelModel", "gather_full_model", "parallelize"]
