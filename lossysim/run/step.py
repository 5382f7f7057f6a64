"""One optimizer step of the tensor-parallel model, and the Megatron gradient clipping it uses."""
from __future__ import annotations

import functools
import time
from typing import Optional

import torch

from .. import axes, clock, timing
from ..config import ExperimentConfig
from ..models import cost
from ..dp import Replica
from ..pp.stages import Pipeline
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
    time the data-parallel traffic adds; with pipeline stages, every replica's compute and traffic as its
    schedule runs them, and each stage's buckets after its last backward (``_pipeline_clock``). Both end
    on the one clock (``lossysim.clock.step_time``), as the estimate's steps do."""
    dp = parts.dp
    # tokens/s counts real tokens, not padding (counted on the host: no device sync)
    tokens = int(batch["attention_mask"].sum())
    batch = {k: v.to(device) for k, v in batch.items()}
    rows = batch["input_ids"].shape[0] // dp.dp_size
    t0 = time.perf_counter()
    gather_s = dp.gather_weights()                 # FSDP: every replica's working weights; DDP: none
    computes, times, losses, logits, stage_times, context_s = [], [], [], [], [], []

    def replica_step(index: int):                  # sim: every replica; dist: this rank's
        r = dp.first + index
        shard = {k: v[r * rows:(r + 1) * rows] for k, v in batch.items()}
        return _accumulate(parts, config, dp.replicas[index], shard, t0, device, index)
    tasks = [functools.partial(replica_step, index) for index in range(len(dp.replicas))]
    # an expert-parallel group's replicas run side by side (their experts meet); the others one by one
    for compute, forward_s, backward_s, replica_losses, replica_logits, stages, exposed in \
            (parts.ep.run(tasks) if parts.ep is not None else [task() for task in tasks]):
        context_s.append(exposed)
        stage_times.append(stages)
        computes.append(compute)
        times.append(torch.tensor([[forward_s, backward_s]], dtype=torch.float64))
        losses.append(replica_losses)
        logits.append(replica_logits)
    times = dp.gather_replicas(times)              # [dp, 2]: every replica's forward and backward
    bucket_s = dp.average_gradients()
    # experts: averaged over their own groups after the dense buckets (not overlapped with backward)
    experts_s = parts.ep.average_gradients(dp.replicas) if parts.ep is not None else 0.0
    squares = parts.ep.squares(dp.replicas) if parts.ep is not None else [None] * len(dp.replicas)
    if parts.pipeline is not None:
        replicated = dp.grouped
        exchanged = _pipeline_clock(config, state, dp.every_replica(stage_times),
                                    dp.every_stage(dp.ready()) if replicated else [],
                                    dp.every_stage(bucket_s) if replicated else [],
                                    dp.every_stage(gather_s) if replicated and gather_s else [])
        if exchanged is not None:
            _charge(parts, state, parts.context, exchanged)
    finite = True
    for replica, replica_losses, experts_sq in zip(dp.replicas, losses, squares):
        parts.scaler.unscale_(replica.optimizer)
        norm = _clip_grad_norm(replica.model, config.grad_clip, replica.pipeline, experts_sq)
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
    if parts.pipeline is None and parts.context is not None:   # (with stages, charged with the schedule)
        _charge(parts, state, parts.context, context_s[0])   # what replica 0's exchanges add beside its attention
    if parts.pipeline is None:      # (with stages, ``_pipeline_clock`` charged the buckets)
        paths = [clock.Path([[forward]], [[backward]]) for forward, backward in times.tolist()]
        state.dp_s += clock.step_time(paths, _buckets(dp, bucket_s, config, gather_s)).breakdown["dp_s"]
    state.dp_s += experts_s
    if parts.ep is not None:        # replica 0's all-to-alls (its forward and backward wait for them)
        _charge(parts, state, parts.ep, parts.ep.step_seconds())
    if config.dp_sync_every and (state.step + 1) % config.dp_sync_every == 0:
        state.dp_s += dp.synchronise()
    seconds = time.perf_counter() - t0
    state.train_time += seconds
    logits = dp.gather_replicas(logits)
    logits, labels = _next_tokens(logits, batch) if config.task == "lm" else (logits, batch["labels"])
    window.add(dp.gather_replicas(losses), logits, labels, tokens, seconds)
    return True


_CLOCKS = ("comm_s", "comm_s_ideal_nic")   # each stage time twice: the run's nic's, the ideal nic's
_SIM_CLOCKS = ("sim_time_s", "sim_time_s_ideal_nic")   # the same two clocks as the run's counters add to them


def _charge(parts: Parts, state: TrainState, part, seconds) -> None:
    """Add a step's seconds of one axis's traffic (with the run's nic, under the ideal nic) to that axis's
    counters on the simulated clock (``Counter.clock``): the axis whose ``Parts`` attribute holds ``part``."""
    axis = next(a for a in axes.AXES if a.part and getattr(parts, a.part, None) is part)
    for counter in axis.counters:
        if counter.clock:
            value = seconds[_SIM_CLOCKS.index(counter.clock[0])]
            setattr(state, counter.name, getattr(state, counter.name) + value)


def _accumulate(parts: Parts, config: ExperimentConfig, replica: Replica, shard: dict, t0: float,
                device: torch.device, index: int = 0):
    """One replica's forward/backwards over its shard, ``microbatches`` of them, the gradients summed
    in place (each micro-batch's loss divided by their number: the gradient of the shard's mean loss
    when micro-batches hold equal tokens). Returns the compute seconds, the forward's and backward's
    seconds (compute, TP traffic and what context exchanges add), every TP rank's loss of every
    micro-batch, the logits, with pipeline stages their times per micro-batch (``_stage_times``), else
    None, and the context exchanges' added seconds ([with the run's nic, the ideal nic])."""
    k, model, pipeline = config.n_microbatches, replica.model, replica.pipeline
    # dist: a process runs one stage; the others' networks are mirrors, still within a step
    networks = pipeline.networks if pipeline is not None else [group.network for group in model.groups]
    if parts.ep is not None:   # this replica's (``index`` in this process) expert all-to-alls, by stage if any
        networks = parts.ep.beside(networks, index, staged=pipeline is not None)
    rows = shard["input_ids"].shape[0] // k
    compute = forward_s = backward_s = 0.0
    exposed = [0.0, 0.0]
    context = getattr(model, "context", None)
    losses, logits = [], []
    stages = {"forward": [], "backward": []} if pipeline is not None else None
    model.train()
    for m in range(k):
        micro = {key: v[m * rows:(m + 1) * rows] for key, v in shard.items()}
        start = [network.clock() for network in networks]
        with parts.autocast:
            out = model(**(_lm_inputs(micro) if config.task == "lm" else micro))
        forward_end = [network.clock() for network in networks]
        parts.scaler.scale(out.loss / k).backward()
        backward_end = [network.clock() for network in networks]
        seconds = _compute_seconds(parts, config, micro, t0, device)
        t0 = time.perf_counter()       # measured compute: each micro-batch's own
        compute += seconds
        # 2N FLOPs per token forward, 4N backward: a third of the compute is forward.
        forward_s += seconds / 3 + sum(e["comm_s"] - s["comm_s"] for s, e in zip(start, forward_end))
        backward_s += seconds * 2 / 3 + sum(e["comm_s"] - s["comm_s"] for s, e in zip(forward_end, backward_end))
        per_stage = context.take_stage_seconds() if context is not None else None
        if context is not None:
            added = {d: [sum(s[k] for s in per_stage[d]) for k in (0, 1)] if pipeline is not None else
                     per_stage[d][0] for d in per_stage}
            forward_s, backward_s = forward_s + added["fwd"][0], backward_s + added["bwd"][0]
            exposed = [exposed[k] + added["fwd"][k] + added["bwd"][k] for k in (0, 1)]
        if pipeline is not None:
            shares = _stage_shares(parts, micro)
            for phase, third, ends in (("forward", 1 / 3, (start, forward_end)), ("backward", 2 / 3,
                                                                                    (forward_end, backward_end))):
                # with context parallelism each stage's exchanges' added seconds follow its two clocks
                stages[phase].append([[seconds * third * share + end[c] - begin[c] for c in _CLOCKS] +
                                      (per_stage["fwd" if phase == "forward" else "bwd"][s] if per_stage else [])
                                      for s, (share, begin, end) in enumerate(zip(shares, *ends))])
        losses.append(model.group.all_gather_reliable(model.rank_losses.detach()))
        logits.append(out.logits.detach())
    if pipeline is not None:
        stages["activation"] = [b.take_seconds("fwd") for b in pipeline.boundaries]
        stages["gradient"] = [b.take_seconds("bwd") for b in pipeline.boundaries]
        stages = pipeline.gathered(stages)
    return compute, forward_s, backward_s, torch.cat(losses), torch.cat(logits), stages, exposed


def _stage_shares(parts: Parts, batch: dict) -> list[float]:
    """Each pipeline stage's share of a micro-batch's modelled compute: its share of the step's FLOPs
    (``cost.step_flops`` over the stage's parameters and layers; they sum to the whole model's)."""
    rows, seq_len = batch["input_ids"].shape
    flops = [cost.step_flops(n, rows * seq_len, layers, parts.hidden, seq_len)
             for n, layers in zip(parts.pipeline.parameters, parts.pipeline.layout)]
    return [f / sum(flops) for f in flops]


def _pipeline_clock(config: ExperimentConfig, state: TrainState, replicas: list[dict], ready: list[list[float]],
                    bucket_s: list[list[float]], gather_s: list[list[float]] = ()) -> Optional[tuple[float, float]]:
    """Charge a step's schedule (``pipeline_time``) over every replica's stages' forward and backward per
    micro-batch (compute and TP traffic) and its boundaries' sends: ``pipeline_s`` (the slowest replica's
    schedule, and under the ideal nic), ``pp_s`` (what the sends add: the step less the same schedules
    with free sends), replica 0's stages' busy seconds (the bubble is the rest) and ``dp_s``, what each
    stage's buckets (``ready``, ``bucket_s`` per stage; none without replicas) add after its last
    backward, all on the one clock (``lossysim.clock.step_time``), as the estimate ends a step. With context
    parallelism each stage's exchanges lengthen its forward and backward: what they add to the schedule
    (with the run's nic, under the ideal nic) is returned for the caller to charge (None without them; the
    same schedules without them give ``pipeline_s`` and ``pp_s``). FSDP's gathers
    (``gather_s``, per stage) come before each stage's first forward, prefetched as without stages: what
    they add joins ``dp_s``."""
    p, m = config.pp_size, config.n_microbatches
    schedule = clock.Schedule(config.pp_schedule, p, m)

    context = len(replicas[0]["forward"][0][0]) > len(_CLOCKS)   # each stage's exchanges' seconds beside

    def arrays(stages: dict, phase: str, k: int, exchanges: bool = False) -> list[list[float]]:
        values = stages[phase]
        if phase in ("forward", "backward"):   # [micro-batch][stage] -> [stage][micro-batch]
            return [[values[i][s][k] + (values[i][s][len(_CLOCKS) + k] if exchanges else 0.0)
                     for i in range(m)] for s in range(p)]
        return [[send[k] for send in boundary] for boundary in values]

    def paths(k: int, exchanges: bool = False) -> list[clock.Path]:
        return [clock.Path(arrays(stages, "forward", k, exchanges), arrays(stages, "backward", k, exchanges),
                           clock.Sends(arrays(stages, "activation", k), arrays(stages, "gradient", k)))
                for stages in replicas]

    buckets = clock.Buckets(ready, bucket_s, gather_s, config.dp_overlap)
    # without exchanges the buckets end this step; with them, the step the exchanges lengthen (below)
    step = clock.step_time(paths(0), clock.Buckets() if context else buckets, schedule, pp_added=True).breakdown
    state.pipeline_s += step["pipeline_s"]
    ideal_s = clock.step_time(paths(1), schedule=schedule).breakdown["pipeline_s"]
    state.pipeline_s_ideal_nic += ideal_s
    state.pp_s += step["pp_s"]
    state.pp_busy_s += sum(map(sum, arrays(replicas[0], "forward", 0))) + \
        sum(map(sum, arrays(replicas[0], "backward", 0)))
    added = None
    if context:   # what the exchanges add to the schedule (the stages' ops they lengthen)
        exchanged = clock.step_time(paths(0, exchanges=True), buckets, schedule).breakdown
        added = (exchanged["pipeline_s"] - step["pipeline_s"],
                 clock.step_time(paths(1, exchanges=True), schedule=schedule).breakdown["pipeline_s"] - ideal_s)
        step = exchanged
    if bucket_s:
        state.dp_s += step["dp_s"]
    return added


def _buckets(dp, bucket_s: list, config: ExperimentConfig, gather_s=()) -> clock.Buckets:
    """A step's data-parallel traffic as the clock takes it (``gather_s``: each stage's units' gathers):
    a group of one waits for nothing."""
    if not dp.grouped:
        return clock.Buckets()
    return clock.Buckets(dp.ready(), bucket_s, gather_s, config.dp_overlap)


def _compute_seconds(parts: Parts, config: ExperimentConfig, batch: dict, t0: float, device: torch.device) -> float:
    """The step's compute on the simulated cluster: measured on this GPU, or modelled from FLOPs."""
    if isinstance(parts.compute, timing.Measured):
        torch.cuda.synchronize(device)
        return time.perf_counter() - t0
    # The GPU computes every position of the padded batch.
    rows, seq_len = batch["input_ids"].shape
    attention = cost.step_flops(0, rows * seq_len, parts.layers, parts.hidden, seq_len)
    # Context parallelism splits every sequence's tokens (and its attention) over its context ranks too.
    mesh = config.mesh()
    return parts.compute.step_time(parts.parameters, rows * seq_len, mesh.tp * mesh.cp,
                                   attention_flops=attention, kernels=parts.kernels)


def _clip_grad_norm(model: TensorParallelModel, max_norm: float, pipeline: Optional[Pipeline] = None,
                    experts_sq: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Global gradient norm as Megatron computes it: replicated grads once, every rank's shards, every
    pipeline stage's (dist: each stage's squares gathered, so every stage sums sim's numbers in sim's order);
    ``experts_sq``: an MoE's expert gradients' squares over the whole ep group (``ExpertParallelism.squares``)."""
    device = next(model.parameters()).device
    across = pipeline.across_stages if pipeline is not None else lambda values, device: values

    def sq(grads):
        # Grouped-query kv heads held by several ranks count once.
        squares = across([g.float().pow(2).sum() / copies for g, copies in grads], device)
        return torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    sharded = [p for p in model.sharded_parameters() if p.grad is not None]
    # Each rank's own shards summed apart, then the ranks' sums: dist's order, so sim's norm has its bits.
    local = torch.stack([sq((p.grad[r], getattr(p, "tp_copies", 1)) for p in sharded)
                         for r in range(model.group.local_size)])
    sharded = model.group.all_gather_reliable(local).sum()
    replicated = sq((p.grad, 1) for p in model.replicated_parameters()
                    if p.grad is not None and not getattr(p, "expert_parallel", False))
    norm = (replicated + sharded if experts_sq is None else replicated + sharded + experts_sq).sqrt()
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
