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
from ..cp import ContextParallel, apply_cp
from ..data import PreparedData, prepare_data
from ..dp import DataParallel, Replica, apply_dp
from ..ep import ExpertParallelism, apply_ep, check as check_experts, shard_experts
from ..models import build_model, check_max_length, cost
from ..net import LossyNetwork
from ..pp.dist import apply_dist_pp, attach
from ..pp.stages import Pipeline, apply_pp
from ..util import cache_dir, swapped
from ..tp import TensorParallelModel, apply_tp


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
    # pipeline stages (their networks and the boundaries between them); None with one stage
    pipeline: Optional[Pipeline] = None
    # a mixture of experts' expert parallelism (its groups, their networks; sim: its lockstep); None without
    ep: Optional[ExpertParallelism] = None
    # replica 0's context parallelism (its context groups' and context ranks' networks); None without
    context: Optional[ContextParallel] = None

    @contextlib.contextmanager
    def evaluating(self):
        """The model on its evaluation networks (each stage's and boundary's), their counters zeroed."""
        if self.pipeline is None:
            self.eval_net.reset_stats()
            with swapped(self.model.group, "network", self.eval_net), \
                    (self.context.evaluating() if self.context is not None else contextlib.nullcontext()):
                yield
            return
        for network in [*self.pipeline.eval_networks, *(n for b in self.pipeline.eval_boundaries
                                                         for n in (b.network, *b.contexts))]:
            network.reset_stats()
        with self.pipeline.evaluating(self.model.groups), \
                (self.context.evaluating() if self.context is not None else contextlib.nullcontext()):
            yield


def build(config: ExperimentConfig, device: torch.device, rank: int, is_main: bool,
          barrier: Optional[Callable[[], None]]) -> Parts:
    """Everything this rank trains with. ``barrier``: dist's, so other ranks wait for rank 0's data."""
    check_max_length(config.model, config.max_length)
    check_experts(config, device)
    data = prepare_data(config, cache_dir() / "data", is_main=is_main, barrier=barrier)
    model = build_model(config.model, vocab_size=data.vocab_size, pad_token_id=data.pad_token_id,
                        num_labels=data.num_labels, max_length=config.max_length,
                        attn_implementation=config.attn_implementation, dropout=config.dropout,
                        seed=config.seed, task=config.task).to(device)
    mesh, settings = config.mesh(), config.network_settings()
    distributed = config.backend == "dist"
    # dist runs this rank's replica, stage, context rank and TP position; sim runs every rank, replica 0's
    # (its context rank 0's TP group) being the run's own.
    here = rank if distributed else 0
    at = mesh.coordinates(here)
    replica, stage, tp_rank = at["dp"], at["pp"], at["tp"]
    # its TP group's network placed as stage 0's (the pipeline places each stage's), evaluation's replica 0's
    train_net = LossyNetwork(mesh.network_spec("tp", mesh.moved(here, tp=0, pp=0), settings))
    eval_net = LossyNetwork(mesh.network_spec("tp", mesh.moved(here, tp=0, pp=0, dp=0),
                                              config.network_settings(evaluation=True)))
    parameters = cost.active_parameters(model, config.tp_size)   # a token's step multiplies its experts' alone
    layers, hidden = cost.dims(model.config)
    train_net.spec.selection.check_depth(layers)
    # Each rank launches the whole model's kernels on its shards, and its collectives'.
    kernels = cost.kernels_per_step(model, config.task) + cost.collective_kernels(layers, config.tp_size)
    compute = _compute(config, device)
    # The parallelisms apply in torchtitan's order: pipeline stages cut the model, then tensor
    # parallelism shards each stage over its own TP group, context parallelism cuts its sequences, then
    # data parallelism joins the replicas.
    groups = None
    if distributed:
        # this process's stage alone runs, its sends to the neighbouring stages' processes real
        pipeline = apply_dist_pp(model, config, mesh, train_net, eval_net, rank)
        groups = mesh.process_groups() if mesh.world > mesh.tp else None
        network = train_net if pipeline is None else pipeline.networks[stage]
        tp_model = apply_tp(model, config, mesh, network, rank, groups["tp"][rank] if groups else None)
        if pipeline is not None:
            tp_model = attach(pipeline, tp_model, groups["pp"][rank], config.seed)
        shard_experts(tp_model, mesh, rank, pipeline)
        apply_cp(tp_model, config, mesh, rank, replica, groups, compute)
        replicas = [_replica(config, tp_model, pipeline)]
    else:
        # Every replica starts from the same weights (DDP broadcasts rank 0's), copied before any stage's
        # hooks so each has its own; replica 0 is built last so the global generator ends seeded exactly
        # as without data parallelism.
        copies = [copy.deepcopy(model) for _ in range(mesh.dp - 1)]
        others = [_sim_replica(config, copies[r - 1], mesh,
                               LossyNetwork(mesh.network_spec("tp", mesh.rank(dp=r), settings)), None, rank, r, compute)
                  for r in range(1, mesh.dp)]
        replicas = [_sim_replica(config, model, mesh, train_net, eval_net, rank, 0, compute), *others]
        pipeline, tp_model = replicas[0].pipeline, replicas[0].model
    grouped = mesh.size("dp_cp") > 1   # the gradients' group: dp x cp (Megatron's)
    dp_groups = groups if grouped else None   # (dist pipelines: a group of one replica)
    positions = [[tp_rank]] if dp_groups is not None else \
        [list(range(mesh.tp)) for _ in range(mesh.pp)] if grouped else []
    networks = [[LossyNetwork(mesh.network_spec("dp_cp", mesh.rank(tp=t, pp=s if dp_groups is None else stage),
                                                settings, config.dp_lossy())) for t in ranks]
                for s, ranks in enumerate(positions)]
    dp = apply_dp(replicas, mesh, networks, config.dp_bucket_mb * (1 << 20), config.dp_mode, rank, dp_groups)
    ep = apply_ep(replicas, config, mesh, rank, groups)
    first = replicas[0]
    return Parts(data, tp_model, train_net, eval_net, first.optimizer, first.scheduler,
                 autocast=_autocast(config.amp, device),
                 scaler=torch.amp.GradScaler(device.type, enabled=config.amp == "fp16"),
                 compute=compute, parameters=parameters, layers=layers, hidden=hidden, kernels=kernels, dp=dp,
                 pipeline=pipeline, ep=ep, context=getattr(tp_model, "context", None))


def _sim_replica(config: ExperimentConfig, model, mesh, train_net: LossyNetwork,
                 eval_net: Optional[LossyNetwork], rank: int, replica: int, compute) -> Replica:
    """``sim``: replica ``replica`` of ``model`` cut into its stages (its own networks), sharded and its
    sequences split over its context ranks."""
    pipeline = apply_pp(model, config, mesh, train_net, eval_net, replica)
    tp_model = apply_tp(model, config, mesh, train_net, rank, pipeline=pipeline)
    shard_experts(tp_model, mesh, mesh.rank(dp=replica), pipeline, contexts=mesh.cp)   # each context rank its own
    apply_cp(tp_model, config, mesh, rank, replica, compute=compute)
    return _replica(config, tp_model, pipeline)


def _replica(config: ExperimentConfig, tp_model: TensorParallelModel, pipeline: Optional[Pipeline] = None) -> Replica:
    """A replica's TP model (on its own network), optimiser and learning-rate schedule."""
    optimizer = _optimizer(config, tp_model)
    scheduler = transformers.get_linear_schedule_with_warmup(
        optimizer, min(config.warmup_steps, config.steps), config.steps)
    return Replica(tp_model, optimizer, scheduler, pipeline)


def _compute(config: ExperimentConfig, device: torch.device):
    compute = timing.parse_compute(config.compute)
    if isinstance(compute, timing.Measured) and not (config.backend == "dist" and device.type == "cuda"):
        raise ValueError("compute=measured needs backend=dist on CUDA GPUs: a simulation's own wall "
                         "clock is not a cluster's time; name a GPU model instead (e.g. compute=h100)")
    if isinstance(compute, timing.Measured) and config.pp_size > 1:
        raise ValueError(f"compute=measured with pp_size={config.pp_size}: a process times its own stage, the "
                         "clock splits a step's compute over the stages; name a GPU model (e.g. compute=h100)")
    return compute


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
