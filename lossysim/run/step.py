"""One optimizer step of the tensor-parallel model, and the Megatron gradient clipping it uses."""
from __future__ import annotations

import time

import torch

from .. import timing
from ..config import ExperimentConfig
from ..dp import gathered_forward_seconds, step_seconds
from ..models import cost
from ..tp import TensorParallelModel
from .build import Parts
from .state import TrainState, Window


def train_step(parts: Parts, config: ExperimentConfig, state: TrainState, window: Window, batch: dict,
               device: torch.device) -> bool:
    """Train on one host batch; False (and no update) if the loss or gradients are non-finite."""
    if parts.dp is not None:
        return _train_step_data_parallel(parts, config, state, window, batch, device)
    # tokens/s counts real tokens, not padding (counted on the host: no device sync)
    tokens = int(batch["attention_mask"].sum())
    batch = {k: v.to(device) for k, v in batch.items()}
    model = parts.model
    t0 = time.perf_counter()
    model.train()
    with parts.autocast:
        out = model(**(_lm_inputs(batch) if config.task == "lm" else batch))
    parts.scaler.scale(out.loss).backward()
    parts.scaler.unscale_(parts.optimizer)
    norm = _clip_grad_norm(model, config.grad_clip)
    finite = torch.isfinite(norm) & torch.isfinite(model.rank_losses.detach()).all()
    # Every rank must agree, or dist ranks would part ways at the next collective.
    if not bool(model.group.all_gather_reliable(finite.reshape(1)).all()):
        return False
    parts.scaler.step(parts.optimizer)
    parts.scaler.update()
    parts.scheduler.step()
    parts.optimizer.zero_grad(set_to_none=True)
    state.tokens += tokens
    state.compute_s += _compute_seconds(parts, config, batch, t0, device)
    seconds = time.perf_counter() - t0
    state.train_time += seconds
    logits, labels = _next_tokens(out.logits.detach(), batch) if config.task == "lm" \
        else (out.logits.detach(), batch["labels"])
    window.add(model.rank_losses.detach(), logits, labels, tokens, seconds)
    return True


def _train_step_data_parallel(parts: Parts, config: ExperimentConfig, state: TrainState, window: Window,
                              batch: dict, device: torch.device) -> bool:
    """One DDP or FSDP step: every replica trains on its own equal shard of the global batch (the same
    shard on all its TP ranks), the gradient buckets are averaged over the data-parallel networks (FSDP:
    the units' weights are gathered before, their gradients reduce-scattered after), then every replica
    clips and steps on what it received. The clock charges replica 0's compute and TP traffic, as
    without data parallelism, plus the time the data-parallel traffic adds (``lossysim.dp.timeline``)."""
    dp = parts.dp
    tokens = int(batch["attention_mask"].sum())
    batch = {k: v.to(device) for k, v in batch.items()}
    rows = batch["input_ids"].shape[0] // dp.dp_size
    t0 = time.perf_counter()
    gather_s = dp.gather_weights()                 # FSDP: every replica's working weights; DDP: none
    outs, computes, times = [], [], []
    for index, replica in enumerate(dp.replicas):   # sim: every replica; dist: this rank's
        r = dp.first + index
        shard = {k: v[r * rows:(r + 1) * rows] for k, v in batch.items()}
        model, network = replica.model, replica.model.network
        start = network.clock()["comm_s"]
        model.train()
        with parts.autocast:
            out = model(**(_lm_inputs(shard) if config.task == "lm" else shard))
        forward_end = network.clock()["comm_s"]
        parts.scaler.scale(out.loss).backward()
        backward_end = network.clock()["comm_s"]
        compute = _compute_seconds(parts, config, shard, t0, device)
        computes.append(compute)
        # 2N FLOPs per token forward, 4N backward: a third of the compute is forward.
        times.append(torch.tensor([[compute / 3 + forward_end - start,
                                    compute * 2 / 3 + backward_end - forward_end]], dtype=torch.float64))
        outs.append(out)
    times = dp.gather_replicas(times)              # [dp, 2]: every replica's forward and backward
    bucket_s = dp.average_gradients()
    finite = True
    for replica in dp.replicas:
        parts.scaler.unscale_(replica.optimizer)
        norm = _clip_grad_norm(replica.model, config.grad_clip)
        finite &= bool(torch.isfinite(norm) & torch.isfinite(replica.model.rank_losses.detach()).all())
    if not dp.all_true(finite):
        return False
    for replica in dp.replicas:
        parts.scaler.step(replica.optimizer)
    parts.scaler.update()
    for replica in dp.replicas:
        replica.scheduler.step()
        replica.optimizer.zero_grad(set_to_none=True)
    state.tokens += tokens
    # Replica 0's compute (every shard has the same padded shape, so every replica's is the same) and
    # its TP traffic (on train_net's clock) are charged as without data parallelism. Replicas step
    # side by side: the slowest replica's path, then the buckets it waits for, add dp_s.
    first = times[0]
    state.compute_s += computes[0]
    slowest = times.max(0).values
    ready = [b.ready for b in dp.buckets]
    forward_end = gathered_forward_seconds(float(slowest[0]), ready, gather_s, config.dp_overlap)
    end = step_seconds(forward_end, float(slowest[1]), ready, bucket_s, config.dp_overlap)
    state.dp_s += end - float(first[0]) - float(first[1])
    if config.dp_sync_every and (state.step + 1) % config.dp_sync_every == 0:
        state.dp_s += dp.synchronise()
    seconds = time.perf_counter() - t0
    state.train_time += seconds
    losses = dp.gather_replicas([r.model.group.all_gather_reliable(r.model.rank_losses.detach())
                                 for r in dp.replicas])
    logits = dp.gather_replicas([out.logits.detach() for out in outs])
    logits, labels = _next_tokens(logits, batch) if config.task == "lm" else (logits, batch["labels"])
    window.add(losses, logits, labels, tokens, seconds)
    return True


def _compute_seconds(parts: Parts, config: ExperimentConfig, batch: dict, t0: float, device: torch.device) -> float:
    """The step's compute on the simulated cluster: measured on this GPU, or modelled from FLOPs."""
    if isinstance(parts.compute, timing.Measured):
        torch.cuda.synchronize(device)
        return time.perf_counter() - t0
    # The GPU computes every position of the padded batch.
    rows, seq_len = batch["input_ids"].shape
    attention = cost.step_flops(0, rows * seq_len, parts.layers, parts.hidden, seq_len)
    return parts.compute.step_time(parts.parameters, rows * seq_len, config.tp_size, attention_flops=attention,
                                   kernels=parts.kernels)


def _clip_grad_norm(model: TensorParallelModel, max_norm: float) -> torch.Tensor:
    """Global gradient norm as Megatron computes it: replicated grads once, every rank's shards."""
    def sq(grads):
        # Grouped-query kv heads held by several ranks count once.
        squares = [g.float().pow(2).sum() / copies for g, copies in grads]
        return torch.stack(squares).sum() if squares else torch.zeros((), device=next(model.parameters()).device)
    sharded = [p for p in model.sharded_parameters() if p.grad is not None]
    # Each rank's own shards summed apart, then the ranks' sums: dist's order, so sim's norm has its bits.
    local = torch.stack([sq((p.grad[r], getattr(p, "tp_copies", 1)) for p in sharded)
                         for r in range(model.group.local_size)])
    sharded = model.group.all_gather_reliable(local).sum()
    norm = (sq((p.grad, 1) for p in model.replicated_parameters() if p.grad is not None) + sharded).sqrt()
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale.to(p.grad.dtype))
    return norm


def _lm_inputs(batch: dict) -> dict:
    """Causal-LM fine-tuning: the labels are the texts' own tokens (padding ignored)."""
    return dict(batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100))


def _next_tokens(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, targets) of every real next token: [tokens, vocab], [tokens]."""
    valid = batch["attention_mask"][:, 1:].bool()
    return logits[:, :-1][valid], batch["input_ids"][:, 1:][valid]
