"""What a run trains with, built from its config: data, the TP model, its networks, the optimiser."""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import transformers

from .. import timing
from ..config import ExperimentConfig
from ..data import PreparedData, prepare_data
from ..dp import DataParallel, FullyShardedDataParallel, Replica
from ..dp.fsdp import DistFullyShardedDataParallel
from ..dp.replicas import DistDataParallel
from ..models import build_model, check_max_length, cost
from ..net import LossyNetwork
from ..util import cache_dir, stream_seed
from ..tp import TensorParallelModel, parallelize


@dataclass
class Parts:
    """What one rank trains with; the loop, the evaluator and checkpoints read it."""
    data: PreparedData
    model: TensorParallelModel
    train_net: LossyNetwork
    eval_net: LossyNetwork  # evaluation draws from its own streams and keeps its own statistics
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    autocast: Any  # the context every forward runs in (mixed precision or none)
    compute: Union[timing.Compute, timing.Measured]  # how a step's compute time is modelled
    parameters: int  # the whole model's, before sharding: a step's FLOPs are 6 * N * tokens / tp
    layers: int      # with hidden: attention's FLOPs
    hidden: int
    kernels: int     # kernel launches of one rank's training step, the TP collectives included
    # every replica (replica 0 is model, train_net, optimizer, scheduler above) and the data-parallel
    # networks between them; without data parallelism a group of one (dp.dp_size == 1)
    dp: DataParallel


def build(config: ExperimentConfig, device: torch.device, rank: int, is_main: bool,
          barrier: Optional[Callable[[], None]]) -> Parts:
    """Everything this rank trains with. ``barrier``: dist's, so other ranks wait for rank 0's data."""
    check_max_length(config.model, config.max_length)
    data = prepare_data(config, cache_dir() / "data", is_main=is_main, barrier=barrier)
    model = build_model(config.model, vocab_size=data.vocab_size, pad_token_id=data.pad_token_id,
                        num_labels=data.num_labels, max_length=config.max_length,
                        attn_implementation=config.attn_implementation, dropout=config.dropout,
                        seed=config.seed, task=config.task).to(device)
    distributed = config.backend == "dist"
    # Ranks are tp-major: this rank is TP rank tp_rank of replica `replica` (dist; sim runs them all).
    replica, tp_rank = divmod(rank, config.tp_size) if distributed else (0, 0)
    train_net = LossyNetwork(config.replica_network_spec(replica))
    eval_net = LossyNetwork(config.network_spec(evaluation=True))
    parameters = sum(p.numel() for p in model.parameters())
    layers, hidden = cost.dims(model.config)
    train_net.spec.selection.check_depth(layers)
    # Each rank launches the whole model's kernels on its shards, and its collectives'.
    kernels = cost.kernels_per_step(model, config.task) + cost.collective_kernels(layers, config.tp_size)
    compute = _compute(config, device)
    bucket_bytes = config.dp_bucket_mb * (1 << 20)
    if distributed and config.dp_size > 1:
        groups = _process_groups(config.tp_size, config.dp_size)
        tp_model = _parallel_model(config, model, train_net, rank, groups["tp"][replica])
        first = _replica(config, tp_model, train_net, rank, parallel=False)
        kind = DistFullyShardedDataParallel if config.dp_mode == "fsdp" else DistDataParallel
        dp = kind(first, LossyNetwork(config.dp_network_spec(tp_rank)), bucket_bytes,
                  replica_index=replica, tp_rank=tp_rank, dp_size=config.dp_size,
                  tp_size=config.tp_size, dp_group=groups["dp"][tp_rank], tp_group=groups["tp"][replica])
    else:
        # Every replica starts from the same weights (DDP broadcasts rank 0's); replica 0 is built last
        # so the global generator ends seeded exactly as without data parallelism.
        copies = [copy.deepcopy(model) for _ in range(config.dp_size - 1)]
        others = [_replica(config, copies[r - 1], LossyNetwork(config.replica_network_spec(r)), rank)
                  for r in range(1, config.dp_size)]
        tp_model = _parallel_model(config, model, train_net, rank)
        first = _replica(config, tp_model, train_net, rank, parallel=False)
        # No data parallelism is a group of one: the same step, no traffic, no networks.
        networks = [LossyNetwork(config.dp_network_spec(t)) for t in range(config.tp_size)] \
            if config.dp_size > 1 else []
        kind = FullyShardedDataParallel if config.dp_mode == "fsdp" and config.dp_size > 1 else DataParallel
        dp = kind([first, *others], networks, bucket_bytes)
    return Parts(data, tp_model, train_net, eval_net, first.optimizer, first.scheduler,
                 autocast=_autocast(config.amp, device),
                 scaler=torch.amp.GradScaler(device.type, enabled=config.amp == "fp16"),
                 compute=compute, parameters=parameters, layers=layers, hidden=hidden, kernels=kernels, dp=dp)


def _replica(config: ExperimentConfig, model: torch.nn.Module, network: LossyNetwork, rank: int,
             parallel: bool = True) -> Replica:
    """A replica's TP model (on its own network), optimiser and learning-rate schedule."""
    tp_model = _parallel_model(config, model, network, rank) if parallel else model
    optimizer = _optimizer(config, tp_model)
    scheduler = transformers.get_linear_schedule_with_warmup(
        optimizer, min(config.warmup_steps, config.steps), config.steps)
    return Replica(tp_model, optimizer, scheduler)


def _compute(config: ExperimentConfig, device: torch.device):
    compute = timing.parse_compute(config.compute)
    if isinstance(compute, timing.Measured) and not (config.backend == "dist" and device.type == "cuda"):
        raise ValueError("compute=measured needs backend=dist on CUDA GPUs: a simulation's own wall "
                         "clock is not a cluster's time; name a GPU model instead (e.g. compute=h100)")
    return compute


def _process_groups(tp: int, dp: int) -> dict:
    """dist's 2-D mesh: each replica's TP ranks, and each TP position's data-parallel ranks (every
    process creates every group, in the same order, as torch.distributed requires)."""
    import torch.distributed as dist
    return {"tp": [dist.new_group(list(range(r * tp, (r + 1) * tp))) for r in range(dp)],
            "dp": [dist.new_group([r * tp + t for r in range(dp)]) for t in range(tp)]}


def _parallel_model(config: ExperimentConfig, model: torch.nn.Module, network: LossyNetwork,
                    rank: int, process_group=None) -> TensorParallelModel:
    tp_model = parallelize(model, config.tp_size, network, backend=config.backend, seed=config.seed,
                           process_group=process_group, sync_replicated=config.sync_replicated)
    # Dropout outside the replicated regions draws from the global generator: one stream per rank,
    # as Megatron seeds its model-parallel stream with the TP rank.
    torch.manual_seed(stream_seed(config.seed, "sharded-dropout", str(rank)))
    if config.activation_checkpointing:
        tp_model.model.activation_checkpointing_enable(
            {"use_reentrant": False, "context_fn": tp_model.group.checkpoint_contexts})
    return tp_model


def _optimizer(config: ExperimentConfig, model: TensorParallelModel) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if name.endswith("bias") or ".ln_" in name or "norm" in name else decay).append(param)
    return torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=config.lr)


def _autocast(amp: str, device: torch.device):
    if amp == "none":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    if device.type == "cpu" and amp == "fp16":
        raise ValueError("amp=fp16 needs a GPU; use amp=bf16 on CPU")
    if device.type == "cuda" and amp == "bf16" and not torch.cuda.is_bf16_supported():
        raise ValueError("this GPU does not support bf16; use amp=fp16")
    return torch.autocast(device.type, dtype=dtype)
