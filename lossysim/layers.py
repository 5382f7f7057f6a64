"""Tensor-parallel layers for transformers' Conv1D (weight [in, out]) and replicated dropout.

Weights carry a leading rank dimension R (all ranks in ``sim``, one in ``dist``):
inputs are ``[R, tokens, features]`` and each rank multiplies by its own shard.
"""
from __future__ import annotations

import torch
from torch import nn

from .collectives import SimGroup, copy_to_tp, reduce_from_tp


def shard_columns(weight: torch.Tensor, tp_size: int, chunks: int = 1) -> torch.Tensor:
    """[in, out] -> [tp, in, out/tp]; with ``chunks`` packed outputs (Q|K|V) each is split alike."""
    rows, cols = weight.shape[0], weight.shape[-1]
    per = cols // (chunks * tp_size)
    return weight.reshape(rows, chunks, tp_size, per).permute(2, 0, 1, 3).reshape(tp_size, rows, chunks * per)


def unshard_columns(shards: torch.Tensor, chunks: int = 1) -> torch.Tensor:
    """Inverse of ``shard_columns``: [tp, in, out/tp] -> [in, out]."""
    tp, rows, width = shards.shape
    per = width // chunks
    return shards.reshape(tp, rows, chunks, per).permute(1, 2, 0, 3).reshape(rows, chunks * tp * per)


class ColumnParallelConv1D(nn.Module):
    """Conv1D split along its outputs; the input enters the TP region through copy-to-TP.

    ``chunks`` > 1 splits each of several packed output blocks (GPT-2's Q|K|V) head-wise.
    """

    def __init__(self, conv, group: SimGroup, site: str, chunks: int = 1):
        super().__init__()
        tp = group.tp_size
        if conv.weight.shape[1] % (chunks * tp):
            raise ValueError(f"tp_size={tp} does not divide the {conv.weight.shape[1] // chunks} "
                             f"output features of {site}")
        self.group, self.site, self.chunks = group, site, chunks
        ranks = group.ranks
        self.weight = nn.Parameter(shard_columns(conv.weight.data, tp, chunks)[ranks].clone())
        self.bias = nn.Parameter(shard_columns(conv.bias.data[None], tp, chunks)[ranks, 0].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.group, self.site)
        return torch.baddbmm(self.bias.unsqueeze(1).to(x.dtype), x, self.weight.to(x.dtype))

    def full(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight [in, out], bias [out]) of the unsharded Conv1D (a reliable gather in dist)."""
        weight = self.group.all_gather_reliable(self.weight.detach())
        bias = self.group.all_gather_reliable(self.bias.detach())
        return unshard_columns(weight, self.chunks), unshard_columns(bias[:, None], self.chunks)[0]


class RowParallelConv1D(nn.Module):
    """Conv1D split along its inputs: partial outputs are reduced, then the full bias is added once."""

    def __init__(self, conv, group: SimGroup, site: str):
        super().__init__()
        tp = group.tp_size
        rows = conv.weight.shape[0]
        if rows % tp:
            raise ValueError(f"tp_size={tp} does not divide the {rows} input features of {site}")
        self.group, self.site = group, site
        shards = conv.weight.data.reshape(tp, rows // tp, -1)
        self.weight = nn.Parameter(shards[group.ranks].clone())
        # Replicated: never sent over the lossy link, never summed tp_size times.
        self.bias = nn.Parameter(conv.bias.data.clone())
        self.bias._lossysim_replicated = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = torch.bmm(x, self.weight.to(x.dtype))
        return reduce_from_tp(partial, self.group, self.site) + self.bias.to(partial.dtype)

    def full(self) -> tuple[torch.Tensor, torch.Tensor]:
        weight = self.group.all_gather_reliable(self.weight.detach())
        return weight.reshape(-1, weight.shape[-1]), self.bias.detach().clone()


class ReplicatedDropout(nn.Module):
    """Dropout in a replicated region: one mask for all ranks (Megatron's RNG tracker).

    Input is ``[R * batch, ...]``; the mask is drawn for ``[batch, ...]`` from a
    stream every rank shares, so without packet loss all ranks stay identical.
    """

    def __init__(self, p: float, group: SimGroup):
        super().__init__()
        self.p, self.group = float(p), group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        ranks = self.group.local_size
        per_rank = x.reshape(ranks, x.shape[0] // ranks, *x.shape[1:])
        keep = self.group.dropout_mask(per_rank.shape[1:], self.p, x.device, x.dtype)
        return (per_rank * keep).reshape(x.shape)

    def extra_repr(self) -> str:
        return f"p={self.p}"
