"""A job's workload (what a rank trains on and the tp x pp x dp layout around it), and a step's
tensor-parallel collectives, read off the sharding plan as a training run makes them.

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

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch

from ..config import DP_MODES
from ..pp.schedule import SCHEDULES
from ..tp.plans import Row
from ..util import one_of
from .shapes import Shape

FULL_UP_TO = 64    # GPUs up to which every lossy group is simulated unless sampled_groups says otherwise
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Workload:
    """What one rank trains on per step, and the pipeline and data parallelism around its TP group.

    ``micro_batch`` sequences of ``seq`` tokens make a micro-batch; each replica runs ``microbatches``
    of them per step (None: ``pp_size``, as training; or derived from ``global_batch`` = micro_batch x
    microbatches x dp_size, as Megatron derives it). ``grad_dtype`` is the dtype gradients are reduced
    in (DDP's buckets, FSDP's reduce-scatters; fp32 as training's and AMP's); FSDP gathers weights in
    ``dtype``. ``gpus_per_node``: consecutive ranks to a node (None: the network's ``ranks_per_node``).
    ``sampled_groups``: of a stage's (or boundary's) identical lossy groups, how many are simulated, the
    slowest of the rest drawn from their times (docs/estimate.md, "The slowest of identical groups");
    0: every group, exactly; None: every group up to ``FULL_UP_TO`` GPUs, else 2."""
    seq: int = 4096
    micro_batch: int = 1
    dtype: str = "bf16"
    activation_checkpointing: bool = False
    pp_size: int = 1
    dp_size: int = 1
    dp_mode: str = "ddp"
    microbatches: Optional[int] = None
    global_batch: Optional[int] = None
    pp_schedule: str = "1f1b"
    pp_layout: Optional[str] = None
    dp_bucket_mb: float = 25.0
    dp_overlap: bool = True
    grad_dtype: str = "fp32"
    gpus_per_node: Optional[int] = None   # None: the network's ranks_per_node
    sampled_groups: Optional[int] = None  # lossy groups simulated per stage or boundary (0: all; None: auto)

    def __post_init__(self):
        if int(self.seq) < 1 or int(self.micro_batch) < 1:
            raise ValueError(f"seq={self.seq} and micro_batch={self.micro_batch} must be >= 1")
        for key in ("dtype", "grad_dtype"):
            if getattr(self, key) not in DTYPES:
                raise ValueError(f"{key}={getattr(self, key)!r} must be {one_of(DTYPES)}")
        for key in ("pp_size", "dp_size", "microbatches", "global_batch", "gpus_per_node"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or int(value) != value or value < 1):
                raise ValueError(f"{key}={value!r} must be an integer >= 1")
        if self.sampled_groups is not None and (isinstance(self.sampled_groups, bool) or
                                                int(self.sampled_groups) != self.sampled_groups or
                                                self.sampled_groups < 0):
            raise ValueError(f"sampled_groups={self.sampled_groups!r} must be an integer >= 0 (0: every group)")
        if self.dp_mode not in DP_MODES:
            raise ValueError(f"dp_mode={self.dp_mode!r} must be {one_of(DP_MODES)}")
        if self.pp_schedule not in SCHEDULES:
            raise ValueError(f"pp_schedule={self.pp_schedule!r} must be {one_of(SCHEDULES)}")
        if not (math.isfinite(self.dp_bucket_mb) and self.dp_bucket_mb > 0):
            raise ValueError(f"dp_bucket_mb={self.dp_bucket_mb} must be a positive number of MiB")
        if self.dp_mode == "fsdp" and self.pp_size > 1:
            raise ValueError(f"dp_mode=fsdp with pp_size={self.pp_size}: FSDP's gathers around a pipeline "
                             "schedule are not modelled; use dp_mode=ddp or pp_size=1")
        if self.global_batch is not None:
            per_step = int(self.micro_batch) * int(self.dp_size)
            if self.global_batch % per_step:
                raise ValueError(f"global_batch={self.global_batch} does not split into micro_batch="
                                 f"{self.micro_batch} x dp_size={self.dp_size} x micro-batches")
            if self.microbatches is not None and self.microbatches * per_step != self.global_batch:
                raise ValueError(f"global_batch={self.global_batch} is not micro_batch={self.micro_batch} x "
                                 f"microbatches={self.microbatches} x dp_size={self.dp_size}")

    @property
    def n_microbatches(self) -> int:
        """Micro-batches per replica per step: ``microbatches``, else global_batch's, else pp_size."""
        if self.microbatches is not None:
            return int(self.microbatches)
        if self.global_batch is not None:
            return int(self.global_batch) // (int(self.micro_batch) * int(self.dp_size))
        return int(self.pp_size)

    def sampled(self, world: int) -> int:
        """Lossy groups simulated per stage or boundary: 0 for every one."""
        if self.sampled_groups is not None:
            return int(self.sampled_groups)
        return 0 if world <= FULL_UP_TO else 2

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank."""
        return int(self.seq) * int(self.micro_batch)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def grad_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.grad_dtype]


def layout_name(tp: int, pp: int, dp: int, ranks_per_node: Optional[int]) -> str:
    """``tp8 x pp4 x dp8 = 256 GPUs on 32 nodes`` (tp innermost, then pp, then dp; None: one node)."""
    world = tp * pp * dp
    nodes = 1 if ranks_per_node is None else -(-world // ranks_per_node)
    return f"tp{tp} x pp{pp} x dp{dp} = {world} GPUs on {nodes} node{'s' if nodes > 1 else ''}"


class Call(NamedTuple):
    site: str
    direction: str
    replay: bool     # a recomputed forward: the first forward's masks again


def step_calls(shape: Shape, checkpointing: bool, blocks: Optional[Sequence[int]] = None) -> list[Call]:
    """The all-reduces of one micro-batch's forward and backward over ``blocks`` (default: every block;
    a pipeline stage's: its own), in the order a training run makes them."""
    plan = shape.plan
    reduces = [spec.site for spec in plan.layers.values() if isinstance(spec, Row)]
    copies = list(plan.inputs.values())[::-1]
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
