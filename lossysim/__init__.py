"""lossysim: what happens to tensor-parallel training when packets are lost, and what coping costs in time.

Its public names are imported on first use (PEP 562), so ``lossysim --help`` and a command that needs
none of them do not pay for torch's and transformers' imports up front.
"""
import importlib

_EXPORTS = {"Bernoulli": ".loss", "FourState": ".loss", "GilbertElliott": ".loss", "LossModel": ".loss",
            "NoLoss": ".loss", "Trace": ".loss", "parse_loss_model": ".loss",
            "LossyNetwork": ".net", "NetworkSpec": ".net",
            "TensorParallelModel": ".tp", "gather_full_model": ".tp", "parallelize": ".tp"}
# The old name of the sharded model: GPT-2 was the first (and only) architecture.
_ALIASES = {"TensorParallelGPT2": "TensorParallelModel"}

__version__ = "0.2.0"
__all__ = [*_EXPORTS, *_ALIASES]


def __getattr__(name: str):
    target = _ALIASES.get(name, name)
    if target not in _EXPORTS:
        raise AttributeError(f"module 'lossysim' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[target], __name__), target)
    globals()[name] = value
    return value
