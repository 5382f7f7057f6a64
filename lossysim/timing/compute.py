"""Compute: what a training step costs a modelled GPU, or what it measured on a real one."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Union

from .specs import NAME_PATTERN, shortest, split_spec


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


@dataclass(frozen=True)
class Compute:
    """Modelled compute: a GPU's dense bf16 peak FLOP/s times a model FLOPs utilisation."""
    gpu: str
    peak_flops: float
    mfu: float = DEFAULT_MFU

    def __post_init__(self):
        if not NAME_PATTERN.match(str(self.gpu)):
            raise ValueError(f"name={self.gpu!r} must be letters, digits, '_', '.' or '-'")
        if not (math.isfinite(self.peak_flops) and self.peak_flops > 0):
            raise ValueError(f"flops={self.peak_flops!r} must be a finite FLOP/s > 0")
        if not 0.0 < self.mfu <= 1.0:
            raise ValueError(f"mfu={self.mfu!r} must be in (0, 1]")
        object.__setattr__(self, "peak_flops", float(self.peak_flops))
        object.__setattr__(self, "mfu", float(self.mfu))

    def step_time(self, parameters: float, tokens: float, tp_size: int = 1) -> float:
        """t = 6 N T / tp / (peak * mfu): forward 2NT plus backward 4NT, split over tp ranks."""
        if parameters < 0 or tokens < 0 or tp_size < 1:
            raise ValueError(f"parameters={parameters}, tokens={tokens}, tp_size={tp_size}: "
                             "need >= 0, >= 0, >= 1")
        return 6.0 * parameters * tokens / tp_size / (self.peak_flops * self.mfu)

    def seconds(self, flops: float) -> float:
        """t = flops / (peak * mfu): extra work (a recovery policy's) at the model's rate."""
        if flops < 0:
            raise ValueError(f"flops={flops} must be >= 0")
        return flops / (self.peak_flops * self.mfu)

    @property
    def spec(self) -> str:
        """A string ``parse_compute`` turns back into this exact model."""
        mfu = [] if self.mfu == DEFAULT_MFU else [f"mfu={shortest(self.mfu)}"]
        if GPU_PRESETS.get(self.gpu) == self.peak_flops:
            return ",".join([self.gpu] + mfu)
        named = [] if self.gpu == "custom" else [f"name={self.gpu}"]
        return ",".join(named + [f"flops={shortest(self.peak_flops)}"] + mfu)


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
    """``measured``, ``h100``, ``h100,mfu=0.35`` or ``flops=1e15,mfu=0.5``."""
    if isinstance(spec, (Compute, Measured)):
        return spec
    text = str(spec).strip()
    if text == "measured":
        return MEASURED
    try:
        preset, values = split_spec(text, ("flops", "mfu", "name"), GPU_PRESETS)
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
        return replace(compute, **changes)
    except ValueError as err:
        raise ValueError(f"bad compute spec {text!r}: {err}") from None

