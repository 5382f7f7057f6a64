"""Megatron-style tensor parallelism for HF transformers models, one mechanism for every plan.

``parallelize`` reads the model's plan (``lossysim/tp/plans.py``) and, in every
block, puts a copy-to-TP on the input of the attention and of the MLP, replaces
the planned linear layers by column- and row-parallel ones, sets the attention
module's head counts to this rank's, and makes the replicated-region dropouts
draw one mask for all ranks. HF's own forward then runs unchanged on each
rank's heads (rotary tables, masks, caches and attention kernels included).
Per block: two lossy all-reduces in forward (``reduce`` sites), two in backward
(``copy`` sites).
"""
from __future__ import annotations

import copy
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .groups import DistGroup, SimGroup, checkpoint_contexts
from .layers import ColumnParallel, ReplicatedDropout, RowParallel, run_per_rank
from ..net import LossyNetwork
from .mappings import copy_to_tp
from .plans import Column, ShardingPlan, plan_for
from ..util import stream_seed


class _RankZeroView(torch.autograd.Function):
    """forward: rank 0's loss; backward: every rank backpropagates its own loss (as each Megatron rank does)."""

    @staticmethod
    def forward(ctx, rank_losses):
        ctx.size = rank_losses.shape
        return rank_losses[0].clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.expand(ctx.size).clone()


_BATCHED_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "inputs_embeds", "position_ids")


class TensorParallelModel(nn.Module):
    """An HF model whose blocks run tensor-parallel over a lossy network.

    Called like the HF model; the output is rank 0's view (``logits``, ``loss``).
    ``rank_logits``, ``rank_hidden`` and ``rank_losses`` hold every local rank's
    (all ranks in ``sim``). Backward follows Megatron: each rank backpropagates
    its own loss; replicated parameters receive the mean of the ranks' gradients.
    """

    def __init__(self, model: nn.Module, group: SimGroup, plan: ShardingPlan, kind: str,
                 stage_groups: Sequence[SimGroup] = ()):
        super().__init__()
        self.model = model
        self.group = group
        self.groups = [group, *stage_groups]  # a pipeline's stages' TP groups, the first stage's first
        self.plan, self.kind = plan, kind
        self.rank_logits: Optional[torch.Tensor] = None
        self.rank_hidden: Optional[torch.Tensor] = None
        self.rank_losses: Optional[torch.Tensor] = None
        self._mask: Optional[torch.Tensor] = None  # the last batch's attention mask
        model.base_model.get_submodule(plan.final_norm).register_forward_hook(self._keep_hidden)

    @property
    def network(self) -> LossyNetwork:
        return self.group.network

    @property
    def config(self):
        return self.model.config

    def _keep_hidden(self, module, args, output):
        self.rank_hidden = output.reshape(self.group.local_size, -1, *output.shape[1:])

    def forward(self, **inputs):
        ranks = self.group.local_size
        labels = inputs.pop("labels", None)
        self._mask = inputs.get("attention_mask")
        if ranks > 1:
            first = inputs.get("input_ids", inputs.get("inputs_embeds"))
            batch = first.shape[0] if first is not None else None
            for name in _BATCHED_INPUTS:
                value = inputs.get(name)
                # Shared position ids ([1, seq]) broadcast over the stacked ranks as they are.
                if value is not None and value.shape[0] == batch:
                    inputs[name] = value.repeat(ranks, *([1] * (value.dim() - 1)))
        first = inputs.get("input_ids", inputs.get("inputs_embeds"))
        for group in self.groups:
            group.rows = first.shape[0] if first is not None else 1
        out = self.model(**inputs)
        key = "last_hidden_state" if self.kind == "model" else "logits"
        output = getattr(out, key)
        self.rank_logits = output.reshape(ranks, -1, *output.shape[1:])
        setattr(out, key, self.rank_logits[0])
        self.rank_losses = None
        if labels is not None:
            self.rank_losses = torch.stack([self._loss(logits, labels) for logits in self.rank_logits])
            out.loss = _RankZeroView.apply(self.rank_losses)
        return out

    def _loss(self, logits, labels):
        if self.kind == "cls":
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        if self.kind == "lm":
            return self.model.loss_function(logits, labels, vocab_size=self.config.vocab_size)
        raise ValueError(f"{type(self.model).__name__} has no loss; call it without labels")

    @torch.no_grad()
    def disagreement(self) -> dict:
        """Rank divergence in the last forward, measured outside the lossy network.

        ``prediction``: fraction of examples whose argmax prediction (any of its
        tokens' for a causal LM, padding aside) differs from rank 0's (worst rank);
        ``hidden_rel_diff``: max over ranks of ||h_r - h_0|| / ||h_0|| for the final
        hidden states.
        """
        # Predictions, not logits, cross the reliable channel: a vocabulary's logits are large.
        pred = self.group.all_gather_reliable(self.rank_logits.detach().argmax(-1).contiguous())
        hidden = self.group.all_gather_reliable(self.rank_hidden.detach().float().contiguous())
        differs = pred != pred[:1]
        if self.kind == "lm" and self._mask is not None:
            differs = differs & self._mask.bool()
        differs = differs.reshape(pred.shape[0], pred.shape[1], -1).any(-1).float().mean(-1).max()
        return {"prediction": float(differs), "hidden_rel_diff": float(relative_difference(hidden).max())}

    def parallel_layers(self):
        """(name, layer) of every column- and row-parallel layer, names as in the HF model."""
        return [(name, m) for name, m in self.model.named_modules() if isinstance(m, (ColumnParallel, RowParallel))]

    def sharded_parameters(self):
        """Parameters with a leading rank dimension (each rank holds its own shard)."""
        return [p for _, m in self.parallel_layers()
                for p in ((m.weight, m.bias) if isinstance(m, ColumnParallel) else (m.weight,)) if p is not None]

    def replicated_parameters(self):
        sharded = {id(p) for p in self.sharded_parameters()}
        return [p for p in self.parameters() if id(p) not in sharded]


def relative_difference(stacked: torch.Tensor) -> torch.Tensor:
    """How far each rank's copy of a tensor has drifted from rank 0's: ``||x_r - x_0|| / ||x_0||``.

    ``stacked`` is [ranks, ...], every rank's copy of what a loss-free network would keep identical
    (final hidden states); the result is [ranks], 0 for rank 0. The norms run over everything but
    the rank dimension, so one number says how much the ranks of a TP model disagree. They sum
    squares along the last dimension first, then those sums (in fp64): one order whatever the number
    of threads (a whole-tensor norm is split among threads, and a sim process with two threads then
    differs from dist's one-thread ranks in the last bits).
    """
    rows = stacked.reshape(stacked.shape[0], -1, stacked.shape[-1] if stacked.dim() > 1 else 1).double()

    def norms(x: torch.Tensor) -> torch.Tensor:
        return x.pow(2).sum(-1).sum(-1).sqrt()
    return (norms(rows - rows[:1]) / norms(rows[:1]).clamp_min(1e-30)).float()


def _enter_tp(group: SimGroup, site: str):
    """A forward pre-hook putting a module's input (hidden states) through copy-to-TP at ``site``."""
    def hook(module, args, kwargs):
        if args:
            x, args = args[0], args[1:]
        elif "hidden_states" in kwargs:
            x = kwargs.pop("hidden_states")
        else:
            raise TypeError(f"{type(module).__name__} got no hidden states to bring into the TP region")
        ranks = group.local_size
        x = copy_to_tp(x.reshape(ranks, -1, x.shape[-1]), group, site).reshape(x.shape)
        return (x, *args), kwargs
    return hook


def head_counts(plan: ShardingPlan, config, tp: int) -> tuple[int, int, int]:
    """(query heads, kv heads, kv parts): kv heads are split when tp divides them, else each rank holds one."""
    heads = getattr(config, plan.heads)
    if heads % tp:
        raise ValueError(f"tp_size={tp} does not divide {plan.heads}={heads}")
    kv = getattr(config, plan.kv_heads) if plan.kv_heads else heads
    kv = kv or heads
    if kv % tp == 0:
        return heads, kv, tp
    if tp % kv == 0:
        return heads, kv, kv
    raise ValueError(f"tp_size={tp} neither divides nor is a multiple of {plan.kv_heads}={kv}")


def parallelize(model: nn.Module, tp_size: int = 2, network: Optional[LossyNetwork] = None,
                backend: str = "sim", seed: int = 0, process_group=None,
                sync_replicated: bool = True, stages: Sequence[tuple[int, LossyNetwork]] = ()) -> TensorParallelModel:
    """Shard an HF model in place by its plan (GPT-2, Llama, Qwen2, Mistral: see ``lossysim.tp.plans``).

    ``network`` defaults to a loss-free one; ``seed`` seeds the replicated
    dropout stream. In ``dist``, rank 0's weights are broadcast first, so every
    rank starts from the same model. Pass ``copy.deepcopy(model)`` to keep the
    original. ``stages``: pipeline stages (``lossysim.pp``) after the first, each
    (its first block, its TP network): their blocks run on a TP group of their own,
    whose replicated dropout draws from a stream of its own (Megatron seeds each
    stage apart); everything else is the first stage's.
    """
    plan, kind = plan_for(model)
    config = model.config
    heads, kv_heads, kv_parts = head_counts(plan, config, tp_size)
    problem = plan.check(config) if plan.check else None
    if problem:
        raise ValueError(problem)
    network = network or LossyNetwork(tp_size)
    if network.ranks != tp_size:
        raise ValueError(f"network has tp_size={network.ranks}, asked for tp_size={tp_size}")
    if backend == "sim":
        group = SimGroup(network, seed)
    elif stages:
        raise ValueError(f"pipeline stages run on backend sim only, not {backend!r}")
    elif backend == "dist":
        group = DistGroup(network, seed, process_group, sync_replicated)
        first = torch.distributed.get_global_rank(process_group, 0) if process_group is not None else 0
        for tensor in list(model.parameters()) + list(model.buffers()):
            torch.distributed.broadcast(tensor.data, src=first, group=process_group)
    else:
        raise ValueError(f"backend={backend!r} must be 'sim' or 'dist'")
    base = model.base_model
    for name, attribute in plan.base_dropouts.items():
        _replace(base, name, ReplicatedDropout(getattr(config, attribute), group))
    local_heads = heads // tp_size
    local_kv = max(kv_heads // tp_size, 1)
    stage_groups = [SimGroup(net, stream_seed(seed, f"pp.stage{s + 1}", "replicated-dropout"))
                    for s, (_, net) in enumerate(stages)]
    groups, starts = [group, *stage_groups], [first for first, _ in stages]
    for i, block in enumerate(base.get_submodule(plan.blocks)):
        prefix = f"{plan.blocks}.{i}"
        stage = sum(i >= first for first in starts)
        own = groups[stage]
        for path, spec in plan.layers.items():
            layer = block.get_submodule(path)
            if isinstance(spec, Column):
                parts = kv_parts if spec.heads == "kv" else tp_size
                new = ColumnParallel(layer, own, f"{prefix}.{path}", chunks=spec.packed, parts=parts)
            else:
                new = RowParallel(layer, own, f"{prefix}.{path}", f"{prefix}.{spec.site}")
            _replace(block, path, new)
        for path, attribute in plan.dropouts.items():
            _replace(block, path, ReplicatedDropout(getattr(config, attribute), own))
        for path, site in plan.inputs.items():
            block.get_submodule(path).register_forward_pre_hook(_enter_tp(own, f"{prefix}.{site}"),
                                                                with_kwargs=True)
        attention = block.get_submodule(plan.attention)
        values = {"heads": local_heads, "kv_heads": local_kv, "groups": local_heads // local_kv,
                  "width": local_heads * (config.hidden_size // heads)}
        for attribute, quantity in plan.local.items():
            setattr(attention, attribute, values[quantity])
    tp_model = TensorParallelModel(model, group, plan, kind, stage_groups)
    replicated = {id(p) for p in tp_model.replicated_parameters()}
    for module in model.modules():  # a RowParallel adds its replicated bias rank by rank itself
        if not isinstance(module, RowParallel) and any(id(p) in replicated for p in module.parameters(recurse=False)):
            run_per_rank(module, group)
    for param in tp_model.replicated_parameters():
        param.register_hook(group.average_replicated)
    return tp_model


def _replace(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


def gather_full_model(tp_model: TensorParallelModel) -> nn.Module:
    """Reassemble the shards into an ordinary HF model of the original class, dtype and device.

    In ``dist`` every rank must call it (the shards are gathered over a
    reliable channel); every rank gets the full model.
    """
    model = tp_model.model
    # The parallel layers keep HF's parameter names; only the shards change shape.
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    for name, layer in tp_model.parallel_layers():
        for leaf, tensor in layer.full().items():
            state[f"{name}.{leaf}"] = tensor
    dtype = next(model.parameters()).dtype
    full = type(model)(copy.deepcopy(model.config)).to(dtype)
    full.load_state_dict(state, strict=True)
    # Buffers left out of the state dict (rotary tables) keep the model's values, not a fresh init's.
    for name, buffer in model.named_buffers():
        full.get_buffer(name).copy_(buffer.detach())
    return full.to(next(model.parameters()).device)


def apply_tp(model: nn.Module, config, mesh, network: LossyNetwork, rank: int,
             process_group=None, pipeline=None) -> TensorParallelModel:
    """A run's tensor parallelism (torchtitan's ``apply_tp``): ``parallelize`` the model over its
    replica's TP group (``mesh``, ``network``; ``process_group`` on dist), each stage of a ``pipeline``
    (``lossysim.pp.Pipeline``) over its own, then seed this rank's own dropout stream and checkpoint
    activations as ``config`` says."""
    stages = [] if pipeline is None else \
        [(sum(pipeline.layout[:s]), pipeline.networks[s]) for s in range(1, pipeline.stages)]
    tp_model = parallelize(model, mesh.tp, network, backend=config.backend, seed=config.seed,
                           process_group=process_group, sync_replicated=config.sync_replicated, stages=stages)
    # Dropout outside the replicated regions draws from the global generator: one stream per rank,
    # as Megatron seeds its model-parallel stream with the TP rank.
    torch.manual_seed(stream_seed(config.seed, "sharded-dropout", str(rank)))
    # What a recomputed block replays: every stage's TP group and (a block's input may be a pipeline
    # boundary's send, dist's receive) the pipeline's; a dist stage adds its link when attached.
    tp_model.replayed = [*tp_model.groups, *(pipeline.boundaries if pipeline is not None else [])]
    if config.activation_checkpointing:
        tp_model.model.activation_checkpointing_enable(
            {"use_reentrant": False, "context_fn": lambda: checkpoint_contexts(*tp_model.replayed)})
    return tp_model
