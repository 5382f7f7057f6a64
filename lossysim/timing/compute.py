"""Compute: what a training step costs a modelled GPU, or what it measured on a real one.

A step takes the longer of its FLOPs at a share of the GPU's peak (the MFU) and its kernel launches
at a few microseconds each: a large model is bound by its FLOPs, a small one (a few hundred kernels
of tiny matmuls) by its launches. ``lossysim.models.cost`` counts a model's FLOPs and kernels.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Union

from .specs import NAME_PATTERN, format_time, parse_time, shortest, split_spec


# Dense (no 2:4 sparsity) bf16 tensor-core peaks, FLOP/s, from the vendors' datasheets.
GPU_PRESETS = {
    "h100": 989.4e12,       # H100 SXM5
    "h100-pcie": 756e12,
    "h200": 989.4e12,       # H200 SXM
    "a100": 312e12,
    "b200": 2.25e15,        # HGX B200
    "l4": 121e12,
    "mi300x": 1307.4e12,
}
DEFAULT_MFU = 0.4           # large-scale bf16 training reports sit at 0.38-0.46
# A kernel launch from an eager framework (no CUDA graphs): "several microseconds" (CUDA's own
# launch plus the framework's dispatch); docs/time_model.md compares the result with published steps.
DEFAULT_LAUNCH_S = 5e-6


@dataclass(frozen=True)
class Compute:
    """Modelled compute: a GPU's dense bf16 peak FLOP/s times a model FLOPs utilisation, and what
    launching one kernel costs."""
    gpu: str
    peak_flops: float
    mfu: float = DEFAULT_MFU
    launch_s: float = DEFAULT_LAUNCH_S

    def __post_init__(self):
        if not NAME_PATTERN.match(str(self.gpu)):
            raise ValueError(f"name={self.gpu!r} must be letters, digits, '_', '.' or '-'")
        if not (math.isfinite(self.peak_flops) and self.peak_flops > 0):
            raise ValueError(f"flops={self.peak_flops!r} must be a finite FLOP/s > 0")
        if not 0.0 < self.mfu <= 1.0:
            raise ValueError(f"mfu={self.mfu!r} must be in (0, 1]")
        if not (math.isfinite(self.launch_s) and self.launch_s >= 0):
            raise ValueError(f"launch={self.launch_s!r} must be a finite time >= 0 s")
        object.__setattr__(self, "peak_flops", float(self.peak_flops))
        object.__setattr__(self, "mfu", float(self.mfu))
        object.__setattr__(self, "launch_s", float(self.launch_s))

    def step_time(self, parameters: float, tokens: float, tp_size: int = 1, *, attention_flops: float = 0.0,
                  kernels: int = 0) -> float:
        """t = max((6 N T + attention) / tp / (peak * mfu), kernels * launch): forward 2NT plus backward
        4NT split over tp ranks, or the step's kernel launches if they take longer."""
        if parameters < 0 or tokens < 0 or tp_size < 1 or kernels < 0:
            raise ValueError(f"parameters={parameters}, tokens={tokens}, tp_size={tp_size}, kernels={kernels}: "
                             "need >= 0, >= 0, >= 1, >= 0")
        flops = (6.0 * parameters * tokens + attention_flops) / tp_size
        return max(flops / (self.peak_flops * self.mfu), kernels * self.launch_s)

    def seconds(self, flops: float) -> float:
        """t = flops / (peak * mfu): extra work (a recovery policy's) at the model's rate."""
        if flops < 0:
            raise ValueError(f"flops={flops} must be >= 0")
        return flops / (self.peak_flops * self.mfu)

    @property
    def spec(self) -> str:
        """A string ``parse_compute`` turns back into this exact model."""
        extra = ([] if self.mfu == DEFAULT_MFU else [f"mfu={shortest(self.mfu)}"]) + \
            ([] if self.launch_s == DEFAULT_LAUNCH_S else [f"launch={format_time(self.launch_s)}"])
        if GPU_PRESETS.get(self.gpu) == self.peak_flops:
            return ",".join([self.gpu] + extra)
        named = [] if self.gpu == "custom" else [f"name={self.gpu}"]
        return ",".join(named + [f"flops={shortest(self.peak_flops)}"] + extra)


@dataclass(frozen=True)
class Measured:
    """Compute time measured on the GPU that runs the simulation (refused on a CPU)."""
    spec = "measured"

    def seconds(self, flops: float) -> float:
        """Nothing: the measured step time already holds whatever the GPU computed."""
        return 0.0


MEASURED = Measured()
_FLOPS_PREFIX = {"": 1.0, "g": 1e9, "t": 1e12, "p": 1e15}


def _parse_flops(text: str) -> float:
    match = re.match(r"^\s*([0-9.e+-]+)\s*(?:([gtp]?)flop(?:s|/s))?\s*$", text, re.IGNORECASE)
    try:
        if match:
            return float(match.group(1)) * _FLOPS_PREFIX[(match.group(2) or "").lower()]
    except ValueError:
        pass
    raise ValueError(f"flops={text!r} is not a FLOP/s figure (e.g. 989e12 or 989TFLOPS)")


def _parse_fraction(field: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{field}={text!r} is not a number") from None


def parse_compute(spec: Union[str, Compute, Measured]) -> Union[Compute, Measured]:
    """``measured``, ``h100``, ``h100,mfu=0.35,launch=8us`` or ``flops=1e15,mfu=0.5``."""
    if isinstance(spec, (Compute, Measured)):
        return spec
    text = str(spec).strip()
    if text == "measured":
        return MEASURED
    try:
        preset, values = split_spec(text, ("flops", "mfu", "launch", "name"), GPU_PRESETS)
        if preset is None and "flops" not in values:
            raise ValueError("flops is missing (measured, a GPU name or flops=..[,mfu=..])")
        compute = Compute(preset, GPU_PRESETS[preset]) if preset else Compute("custom", 1.0)
        changes = {}
        if "name" in values:
            changes["gpu"] = values["name"]
        if "flops" in values:
            changes["peak_flops"] = _parse_flops(values["flops"])
        if "mfu" in values:
            changes["mfu"] = _parse_fraction("mfu", values["mfu"])
        if "launch" in values:
            changes["launch_s"] = parse_time("launch", values["launch"])
        return replace(compute, **changes)
    except ValueError as err:
        raise ValueError(f"bad compute spec {text!r}: {err}") from None

