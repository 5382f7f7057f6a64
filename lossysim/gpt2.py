"""Megatron-style tensor parallelism for HF transformers GPT-2.

In every block the attention's ``c_attn`` is column-parallel (each rank owns
whole heads of Q, K and V), attention runs on the local heads, ``c_proj`` is
row-parallel with its bias added once after the reduction; the MLP's ``c_fc``
is column-parallel and its ``c_proj`` row-parallel. Embeddings, layer norms and
heads stay replicated. Two lossy all-reduces per block in forward (``reduce``
sites), two in backward (``copy`` sites).
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel, GPT2Model
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt2.modeling_gpt2 import eager_attention_forward

from .collectives import DistGroup, SimGroup
from .layers import ColumnParallelConv1D, ReplicatedDropout, RowParallelConv1D
from .network import LossyNetwork

SUPPORTED = (GPT2Model, GPT2LMHeadModel, GPT2ForSequenceClassification)


class ParallelGPT2Attention(nn.Module):
    """GPT2Attention on this rank's heads (self-attention; a KV cache works per rank)."""

    def __init__(self, attn, group: SimGroup, layer_idx: int):
        super().__init__()
        tp = group.tp_size
        if attn.num_heads % tp:
            raise ValueError(f"tp_size={tp} does not divide n_head={attn.num_heads}")
        self.group = group
        self.config = attn.config
        self.layer_idx = layer_idx
        # Read by HF attention kernels through the module argument.
        self.is_causal = attn.is_causal
        self.scaling = attn.scaling
        self.scale_attn_weights = attn.scale_attn_weights
        self.head_dim = attn.head_dim
        self.num_heads = attn.num_heads // tp
        self.attn_dropout_p = attn.attn_dropout.p
        self.c_attn = ColumnParallelConv1D(attn.c_attn, group, f"h.{layer_idx}.attn.copy", chunks=3)
        self.c_proj = RowParallelConv1D(attn.c_proj, group, f"h.{layer_idx}.attn.reduce")
        self.resid_dropout = ReplicatedDropout(attn.resid_dropout.p, group)

    def forward(self, hidden_states, past_key_values=None, attention_mask=None,
                encoder_hidden_states=None, **kwargs):
        if encoder_hidden_states is not None:
            raise NotImplementedError("cross-attention is not tensor-parallelised")
        kwargs.pop("use_cache", None)
        ranks = self.group.local_size
        batch, seq, width = hidden_states.shape
        qkv = self.c_attn(hidden_states.reshape(ranks, -1, width))
        qkv = qkv.reshape(batch, seq, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        query, key, value = qkv.unbind(0)  # [R * batch, local heads, seq, head_dim]
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                          eager_attention_forward)
        out, weights = attention(self, query, key, value, attention_mask,
                                 dropout=self.attn_dropout_p if self.training else 0.0,
                                 scaling=self.scaling, **kwargs)
        out = self.c_proj(out.reshape(ranks, -1, self.num_heads * self.head_dim))
        return self.resid_dropout(out.reshape(batch, seq, width)), weights


class ParallelGPT2MLP(nn.Module):
    """GPT2MLP with a column-parallel ``c_fc`` and a row-parallel ``c_proj``."""

    def __init__(self, mlp, group: SimGroup, layer_idx: int):
        super().__init__()
        self.group = group
        self.c_fc = ColumnParallelConv1D(mlp.c_fc, group, f"h.{layer_idx}.mlp.copy")
        self.c_proj = RowParallelConv1D(mlp.c_proj, group, f"h.{layer_idx}.mlp.reduce")
        self.act = mlp.act
        self.dropout = ReplicatedDropout(mlp.dropout.p, group)

    def forward(self, hidden_states):
        ranks = self.group.local_size
        batch, seq, width = hidden_states.shape
        x = self.act(self.c_fc(hidden_states.reshape(ranks, -1, width)))
        return self.dropout(self.c_proj(x).reshape(batch, seq, width))


class _RankZeroView(torch.autograd.Function):
    """forward: rank 0's loss; backward: every rank backpropagates its own loss (as each Megatron rank does)."""

    @staticmethod
    def forward(ctx, rank_losses):
        ctx.size = rank_losses.shape
        return rank_losses[0].clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.expand(ctx.size).clone()


_BATCHED_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "inputs_embeds", "labels")


class TensorParallelGPT2(nn.Module):
    """A GPT-2 whose blocks run tensor-parallel over a lossy network.

    Called like the HF model; the output is rank 0's view (``logits``, ``loss``).
    ``rank_logits``, ``rank_hidden`` and ``rank_losses`` hold every local rank's
    (all ranks in ``sim``). Backward follows Megatron: each rank backpropagates
    its own loss; replicated parameters receive the mean of the ranks' gradients.
    """

    def __init__(self, model: nn.Module, group: SimGroup):
        super().__init__()
        self.model = model
        self.group = group
        self.rank_logits: Optional[torch.Tensor] = None
        self.rank_hidden: Optional[torch.Tensor] = None
        self.rank_losses: Optional[torch.Tensor] = None
        base = model.transformer if hasattr(model, "transformer") else model
        base.ln_f.register_forward_hook(self._keep_hidden)

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
        for name in _BATCHED_INPUTS:
            value = inputs.get(name)
            if value is not None and ranks > 1:
                inputs[name] = value.repeat(ranks, *([1] * (value.dim() - 1)))
        out = self.model(**inputs)
        # GPT2Model has no head: its per-rank output is the last hidden state.
        key = "last_hidden_state" if isinstance(self.model, GPT2Model) else "logits"
        output = getattr(out, key)
        self.rank_logits = output.reshape(ranks, -1, *output.shape[1:])
        setattr(out, key, self.rank_logits[0])
        self.rank_losses = None
        if labels is not None:
            self.rank_losses = torch.stack([self._loss(logits, labels) for logits in self.rank_logits])
            out.loss = _RankZeroView.apply(self.rank_losses)
        return out

    def _loss(self, logits, labels):
        if isinstance(self.model, GPT2ForSequenceClassification):
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        if isinstance(self.model, GPT2LMHeadModel):
            return self.model.loss_function(logits, labels, vocab_size=self.config.vocab_size)
        raise ValueError(f"{type(self.model).__name__} has no loss; call it without labels")

    @torch.no_grad()
    def disagreement(self) -> dict:
        """Rank divergence in the last forward, measured outside the lossy network.

        ``prediction``: fraction of examples whose argmax prediction differs from
        rank 0's (worst rank); ``hidden_rel_diff``: max over ranks of
        ||h_r - h_0|| / ||h_0|| for the final hidden states.
        """
        logits = self.group.all_gather_reliable(self.rank_logits.detach().float().contiguous())
        hidden = self.group.all_gather_reliable(self.rank_hidden.detach().float().contiguous())
        pred = logits.argmax(-1).reshape(logits.shape[0], logits.shape[1], -1)
        differs = (pred != pred[:1]).any(-1).float().mean(-1).max()
        diff = (hidden - hidden[:1]).flatten(1).norm(dim=1) / hidden[0].norm().clamp_min(1e-30)
        return {"prediction": float(differs), "hidden_rel_diff": float(diff.max())}

    def sharded_parameters(self):
        return [p for m in self.modules() if isinstance(m, ColumnParallelConv1D)
                for p in (m.weight, m.bias)] + \
               [m.weight for m in self.modules() if isinstance(m, RowParallelConv1D)]

    def replicated_parameters(self):
        sharded = {id(p) for p in self.sharded_parameters()}
        return [p for p in self.parameters() if id(p) not in sharded]


def parallelize(model: nn.Module, tp_size: int = 2, network: Optional[LossyNetwork] = None,
                backend: str = "sim", seed: int = 0, process_group=None,
                sync_replicated: bool = True) -> TensorParallelGPT2:
    """Shard an HF GPT-2 (GPT2Model, GPT2LMHeadModel, GPT2ForSequenceClassification) in place.

    ``network`` defaults to a loss-free one; ``seed`` seeds the replicated
    dropout stream. In ``dist``, rank 0's weights are broadcast first, so every
    rank starts from the same model. Pass ``copy.deepcopy(model)`` to keep the
    original.
    """
    if not isinstance(model, SUPPORTED):
        raise TypeError(f"parallelize supports {', '.join(c.__name__ for c in SUPPORTED)}, "
                        f"not {type(model).__name__}")
    config = model.config
    if config.n_head % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide n_head={config.n_head}")
    inner = config.n_inner or 4 * config.n_embd
    if inner % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide the MLP width 4*n_embd={inner}")
    if getattr(config, "add_cross_attention", False):
        raise ValueError("cross-attention GPT-2 is not supported")
    if config.reorder_and_upcast_attn and config._attn_implementation == "eager":
        raise ValueError("reorder_and_upcast_attn is not supported; use the default attention")
    network = network or LossyNetwork(tp_size)
    if network.tp_size != tp_size:
        raise ValueError(f"network has tp_size={network.tp_size}, asked for tp_size={tp_size}")
    if backend == "sim":
        group = SimGroup(network, seed)
    elif backend == "dist":
        group = DistGroup(network, seed, process_group, sync_replicated)
        first = torch.distributed.get_global_rank(process_group, 0) if process_group is not None else 0
        for tensor in list(model.parameters()) + list(model.buffers()):
            torch.distributed.broadcast(tensor.data, src=first, group=process_group)
    else:
        raise ValueError(f"backend={backend!r} must be 'sim' or 'dist'")
    base = model.transformer if hasattr(model, "transformer") else model
    base.drop = ReplicatedDropout(base.drop.p, group)
    for i, block in enumerate(base.h):
        block.attn = ParallelGPT2Attention(block.attn, group, i)
        block.mlp = ParallelGPT2MLP(block.mlp, group, i)
    tp_model = TensorParallelGPT2(model, group)
    for param in tp_model.replicated_parameters():
        param.register_hook(group.average_replicated)
    return tp_model


def gather_full_model(tp_model: TensorParallelGPT2) -> nn.Module:
    """Reassemble the shards into an ordinary HF model of the original class.

    In ``dist`` every rank must call it (the shards are gathered over a
    reliable channel); every rank gets the full model.
    """
    model = tp_model.model
    # The parallel layers keep HF's parameter names; only the shards change shape.
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelConv1D, RowParallelConv1D)):
            state[f"{name}.weight"], state[f"{name}.bias"] = module.full()
    full = type(model)(copy.deepcopy(model.config))
    full.load_state_dict(state, strict=True)
    return full.to(next(model.parameters()).device)
