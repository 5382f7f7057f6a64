"""A training step's tensor-parallel collectives, read off the sharding plan as a training run makes them.

Per block, in forward, every row-parallel layer all-reduces its partial output at its ``reduce``
site (``fwd``); in backward, every ``copy`` site all-reduces the gradient of its module's input
(``bwd``), blocks in reverse and modules in reverse inside a block. With activation checkpointing
each block's forward runs again when the backward reaches it, and its all-reduces replay the masks
drawn the first time (their time counts again, nothing is drawn). PyTorch's non-reentrant
checkpoint stops that recompute as soon as every tensor saved for backward is back: a block's last
all-reduce feeds only the residual sum, so it runs again only when a dropout after it draws a mask
(GPT-2's residual dropout). Every message is one rank's micro-batch x sequence x hidden activations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..tp.plans import Row
from .shapes import Shape

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Workload:
    """What one rank trains on per step."""
    seq: int = 4096
    micro_batch: int = 1
    dtype: str = "bf16"
    activation_checkpointing: bool = False

    def __post_init__(self):
        if int(self.seq) < 1 or int(self.micro_batch) < 1:
            raise ValueError(f"seq={self.seq} and micro_batch={self.micro_batch} must be >= 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {', '.join(DTYPES)}")

    @property
    def tokens(self) -> int:
        return int(self.seq) * int(self.micro_batch)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


class Call(NamedTuple):
    site: str
    direction: str
    replay: bool     # a recomputed forward: the first forward's masks again


def step_calls(shape: Shape, checkpointing: bool) -> list[Call]:
    """The all-reduces of one training step, in the order a training run makes them."""
    plan = shape.plan
    reduces = [spec.site for spec in plan.layers.values() if isinstance(spec, Row)]
    copies = list(plan.inputs.values())[::-1]
    blocks = [f"{plan.blocks}.{i}" for i in range(shape.layers)]
    calls = [Call(f"{block}.{site}", "fwd", False) for block in blocks for site in reduces]
    module = reduces[-1].split(".")[0]
    masked = any(path.startswith(f"{module}.") and getattr(shape.config, p, 0) > 0 for path, p in plan.dropouts.items())
    replayed = reduces if masked else reduces[:-1]
    for block in reversed(blocks):
        if checkpointing:
            calls += [Call(f"{block}.{site}", "fwd", True) for site in replayed]
        calls += [Call(f"{block}.{site}", "bwd", False) for site in copies]
    return calls
