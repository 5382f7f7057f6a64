"""What an estimate adds to a training run's config (the sequence length, the gradients' dtype, how many
identical groups are simulated), and a step's tensor-parallel collectives, read off the sharding plan
as a training run makes them.

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

from dataclasses import dataclass, field, make_dataclass
from typing import NamedTuple, Optional, Sequence

import torch

from .. import axes
from ..config import ExperimentConfig, from_dict
from ..tp.plans import Row
from ..util import one_of
from .shapes import Shape

FULL_UP_TO = 64    # GPUs up to which every lossy group is simulated unless sampled_groups says otherwise
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
AMP_DTYPE = {"none": "fp32", "bf16": "bf16", "fp16": "fp16"}   # a run's ``amp`` -> the dtype its activations travel in


@dataclass(frozen=True)
class _Workload:
    """What an estimate adds to a training run's config (``ExperimentConfig``, which holds the layout, the
    batch, the micro-batches and the network): every micro-batch's sequences are ``seq`` tokens long (a
    training run pads each batch to its longest row), gradients are reduced in ``grad_dtype`` (DDP's
    buckets, FSDP's reduce-scatters; fp32 as training's and AMP's), and ``sampled_groups``: of a stage's
    (or boundary's) identical lossy groups, how many are simulated, the slowest of the rest drawn from their
    times (docs/estimate.md, "The slowest of identical groups"); 0: every group, exactly; None: every group up
    to ``FULL_UP_TO`` GPUs, else 2. After these, every axis's estimate-only settings (``Axis.workload``, in the
    axes' order: experts' routing as assumed, where training routes with the model's router), each checked
    as its axis declares."""
    seq: int = 4096
    grad_dtype: str = "fp32"
    sampled_groups: Optional[int] = None  # lossy groups simulated per stage or boundary (0: all; None: auto)

    def __post_init__(self):
        if isinstance(self.seq, bool) or int(self.seq) != self.seq or self.seq < 1:
            raise ValueError(f"seq={self.seq!r} must be an integer >= 1")
        if self.grad_dtype not in DTYPES:
            raise ValueError(f"grad_dtype={self.grad_dtype!r} must be {one_of(DTYPES)}")
        if self.sampled_groups is not None and (isinstance(self.sampled_groups, bool) or
                                                int(self.sampled_groups) != self.sampled_groups or
                                                self.sampled_groups < 0):
            raise ValueError(f"sampled_groups={self.sampled_groups!r} must be an integer >= 0 (0: every group)")
        for flag in _AXES_FLAGS:
            if flag.check is not None:
                flag.check(getattr(self, flag.field))

    def sampled(self, world: int) -> int:
        """Lossy groups simulated per stage or boundary: 0 for every one."""
        if self.sampled_groups is not None:
            return int(self.sampled_groups)
        return 0 if world <= FULL_UP_TO else 2

    @property
    def grad_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.grad_dtype]


# the fields above, then the axes' own (their declarations', read once here: a later ``axes.declared`` axis's
# estimate-only settings are not a ``Workload``'s)
_AXES_FLAGS = axes.workload_flags()
Workload = make_dataclass("Workload", [(f.field, f.type, field(default=f.default)) for f in _AXES_FLAGS],
                          bases=(_Workload,), frozen=True)
Workload.__module__, Workload.__doc__ = __name__, _Workload.__doc__   # (pickled and documented as one class)


def job_config(model: str = "tiny", micro_batch: int = 1, dtype: str = "bf16", global_batch: Optional[int] = None,
               **keys) -> ExperimentConfig:
    """The training config of the job an estimate describes: ``micro_batch`` sequences per micro-batch per
    replica, activations in ``dtype`` (a run's ``amp``), the micro-batches given (``microbatches``) or
    derived from ``global_batch`` as Megatron derives them; every other key is a config key (``tp_size``,
    ``pp_size``, ``dp_size``, ``loss``, ``transport``, ...). Validated as ``lossysim train`` validates it:
    the same layout, micro-batch and network rules, the same one-line errors."""
    dp, m = keys.get("dp_size", 1), keys.get("microbatches")
    for name, value in (("micro_batch", micro_batch), ("global_batch", global_batch)):
        if value is not None and (isinstance(value, bool) or int(value) != value or value < 1):
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be {one_of(DTYPES)}")
    if global_batch is not None:
        per_step = micro_batch * dp
        if global_batch % per_step:
            raise ValueError(f"global_batch={global_batch} does not split into micro_batch={micro_batch} x "
                             f"dp_size={dp} x micro-batches")
        if m is not None and m * per_step != global_batch:
            raise ValueError(f"global_batch={global_batch} is not micro_batch={micro_batch} x microbatches={m} x "
                             f"dp_size={dp}")
        m = global_batch // per_step
    batch = micro_batch * (keys.get("pp_size", 1) if m is None else m) * dp
    amp = next(amp for amp, name in AMP_DTYPE.items() if name == dtype)
    return from_dict({**keys, "model": model, "microbatches": m, "batch_size": batch, "amp": amp})


class Call(NamedTuple):
    site: str
    direction: str
    replay: bool     # a recomputed forward: the first forward's masks again


def step_calls(shape: Shape, checkpointing: bool, blocks: Optional[Sequence[int]] = None) -> list[Call]:
    """The all-reduces of one micro-batch's forward and backward over ``blocks`` (default: every block;
    a pipeline stage's: its own), in the order a training run makes them."""
    plan = shape.plan
    # (a site two of a plan's layers name, DeepSeek-V3's dense MLP's and shared expert's, is one call: a block
    # has one of them)
    reduces = list(dict.fromkeys(spec.site for spec in plan.layers.values() if isinstance(spec, Row)))
    copies = list(dict.fromkeys(plan.inputs.values()))[::-1]
    blocks = [f"{plan.blocks}.{i}" for i in (range(shape.layers) if blocks is None else blocks)]
    calls = [Call(f"{block}.{site}", "fwd", False) for block in blocks for site in reduces]
    module = reduces[-1].split(".")[0]
    masked = any(path.startswith(f"{module}.") and getattr(shape.config, p, 0) > 0 for path, p in plan.dropouts.items())
    replayed = reduces if masked else reduces[:-1]
    for block in reversed(blocks):
        if checkpointing:
            calls += [Call(f"{block}.{site}", "fwd", True) for site in replayed]
        calls += [Call(f"{block}.{site}", "bwd", False) for site in copies]
    return calls
