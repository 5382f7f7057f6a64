"""One optimizer step of the tensor-parallel model, and the Megatron gradient clipping it uses."""
from __future__ import annotations

import time

import torch

from .. import timing
from ..config import ExperimentConfig
from ..models import cost
from ..tp import TensorParallelModel
from .build import Parts
from .state import TrainState, Window


def train_step(parts: Parts, config: ExperimentConfig, state: TrainState, window: Window, batch: dict,
               device: torch.device) -> bool:
    """Train on one host batch; False (and no update) if the loss or gradients are non-finite.

    Every mesh takes this one step; without data parallelism ``parts.dp`` is a group of one replica,
    whose averaging is the identity and costs no time. Every replica trains on its own equal shard of
    the global batch (the same shard on all its TP ranks), in ``microbatches`` forward/backwards whose
    gradients accumulate; the gradient buckets are then averaged over the data-parallel networks (FSDP:
    the units' weights are gathered before, their gradients reduce-scattered after), and every replica
    clips and steps on what it received. The clock charges replica 0's compute and TP traffic plus the
    time the data-parallel traffic adds (``lossysim.dp.timeline``)."""
    dp = parts.dp
    # tokens/s counts real tokens, not padding (counted on the host: no device sync)
    tokens = int(batch["attention_mask"].sum())
    batch = {k: v.to(device) for k, v in batch.items()}
    rows = batch["input_ids"].shape[0] // dp.dp_size
    t0 = time.perf_counter()
    gather_s = dp.gather_weights()                 # FSDP: every replica's working weights; DDP: none
    computes, times, losses, logits = [], [], [], []
    for index, replica in enumerate(dp.replicas):   # sim: every replica; dist: this rank's
        r = dp.first + index
        shard = {k: v[r * rows:(r + 1) * rows] for k, v in batch.items()}
        compute, forward_s, backward_s, replica_losses, replica_logits = _accumulate(
            parts, config, replica.model, shard, t0, device)
        computes.append(compute)
        times.append(torch.tensor([[forward_s, backward_s]], dtype=torch.float64))
        losses.append(replica_losses)
        logits.append(replica_logits)
    times = dp.gather_replicas(times)              # [dp, 2]: every replica's forward and backward
    bucket_s = dp.average_gradients()
    finite = True
    for replica, replica_losses in zip(dp.replicas, losses):
        parts.scaler.unscale_(replica.optimizer)
        norm = _clip_grad_norm(replica.model, config.grad_clip)
        ok = torch.isfinite(norm) & torch.isfinite(replica_losses).all()
        # Every rank must agree, or dist ranks would part ways at the next collective.
        finite &= bool(replica.model.group.all_gather_reliable(ok.reshape(1)).all())
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
    # its TP traffic (on train_net's clock) are charged; replicas step side by side and dp_s is what the
    # slowest one's path and the buckets it waits for add.
    state.compute_s += computes[0]
    state.dp_s += dp.added_seconds(times, gather_s, bucket_s, config.dp_overlap)
    if config.dp_sync_every and (state.step + 1) % config.dp_sync_every == 0:
        state.dp_s += dp.synchronise()
    seconds = time.perf_counter() - t0
    state.train_time += seconds
    logits = dp.gather_replicas(logits)
    logits, labels = _next_tokens(logits, batch) if config.task == "lm" else (logits, batch["labels"])
    window.add(dp.gather_replicas(losses), logits, labels, tokens, seconds)
    return True


def _accumulate(parts: Parts, config: ExperimentConfig, model: TensorParallelModel, shard: dict, t0: float,
                device: torch.device) -> tuple[float, float, float, torch.Tensor, torch.Tensor]:
    """One replica's forward/backwards over its shard, ``microbatches`` of them, the gradients summed
    in place (each micro-batch's loss divided by their number: the gradient of the shard's mean loss
    when micro-batches hold equal tokens). Returns the compute seconds, the forward's and backward's
    seconds (compute and TP traffic), every TP rank's loss of every micro-batch and the logits."""
    network, k = model.network, config.microbatches
    rows = shard["input_ids"].shape[0] // k
    compute = forward_s = backward_s = 0.0
    losses, logits = [], []
    model.train()
    for m in range(k):
        micro = {key: v[m * rows:(m + 1) * rows] for key, v in shard.items()}
        start = network.clock()["comm_s"]
        with parts.autocast:
            out = model(**(_lm_inputs(micro) if config.task == "lm" else micro))
        forward_end = network.clock()["comm_s"]
        parts.scaler.scale(out.loss / k).backward()
        backward_end = network.clock()["comm_s"]
        seconds = _compute_seconds(parts, config, micro, t0, device)
        t0 = time.perf_counter()       # measured compute: each micro-batch's own
        compute += seconds
        # 2N FLOPs per token forward, 4N backward: a third of the compute is forward.
        forward_s += seconds / 3 + forward_end - start
        backward_s += seconds * 2 / 3 + backward_end - forward_end
        losses.append(model.group.all_gather_reliable(model.rank_losses.detach()))
        logits.append(out.logits.detach())
    return compute, forward_s, backward_s, torch.cat(losses), torch.cat(logits)


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
