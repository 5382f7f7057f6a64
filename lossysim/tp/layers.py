"""Tensor-parallel linear layers (nn.Linear [out, in] or transformers' Conv1D [in, out]) and replicated dropout.

Weights carry a leading rank dimension R (all ranks in ``sim``, one in ``dist``):
each rank multiplies its own rows of ``[R * batch, ..., features]`` by its own
shard. The layers keep the HF module's parameter names and orientation, so a
shard is the HF tensor cut, with a rank dimension in front.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .groups import SimGroup
from .mappings import reduce_from_tp


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


def _is_linear(module: nn.Module) -> bool:
    """nn.Linear stores [out, in]; transformers' Conv1D stores [in, out]."""
    return isinstance(module, nn.Linear)


def _per_rank(x: torch.Tensor, ranks: int) -> torch.Tensor:
    """[R * batch, ..., features] -> [R, tokens, features] (a view)."""
    return x.reshape(ranks, -1, x.shape[-1])


class ColumnParallel(nn.Module):
    """A linear layer split along its outputs; its input is already in the TP region.

    The outputs are cut into ``parts`` equal blocks (default tp_size); rank r
    holds block ``owners[r]``. With fewer parts than ranks (grouped-query kv
    heads on more ranks than kv heads) several ranks hold the same block, and
    their gradients are summed over a reliable channel, so the copies stay equal
    and each gets the full gradient. ``chunks`` > 1 splits each of several
    packed output blocks (GPT-2's Q|K|V) alike.
    """

    def __init__(self, layer: nn.Module, group: SimGroup, name: str, chunks: int = 1,
                 parts: Optional[int] = None):
        super().__init__()
        tp = group.tp_size
        self.group, self.name, self.chunks = group, name, chunks
        self.linear = _is_linear(layer)
        self.parts = parts or tp
        self.owners = [r * self.parts // tp for r in range(tp)]
        outputs = layer.weight.shape[0 if self.linear else 1]
        if outputs % (chunks * self.parts):
            raise ValueError(f"tp_size={tp} does not divide the {outputs // chunks} output features of {name}")
        ranks = group.ranks
        self.weight = nn.Parameter(self.shard("weight", layer.weight.data)[ranks].clone())
        has_bias = getattr(layer, "bias", None) is not None
        self.bias = nn.Parameter(self.shard("bias", layer.bias.data)[ranks].clone()) if has_bias else None
        for param in self._own_parameters():
            param.tp_copies = tp // self.parts  # ranks holding each block (a gradient norm counts it once)
            if self.parts < tp:
                param.register_hook(self._sum_copies)

    def _own_parameters(self):
        return [p for p in (self.weight, self.bias) if p is not None]

    def shard(self, leaf: str, full: torch.Tensor) -> torch.Tensor:
        """A full HF tensor (``weight`` or ``bias``) as every rank stores it: [tp_size, ...]."""
        columns = full[None] if leaf == "bias" else (full.t() if self.linear else full)  # [in, out]
        blocks = shard_columns(columns, self.parts, self.chunks)[self.owners]  # [tp, in, out/parts]
        if leaf == "bias":
            return blocks[:, 0]
        return blocks.transpose(1, 2) if self.linear else blocks

    def full(self) -> dict[str, torch.Tensor]:
        """The unsharded ``weight`` (and ``bias``), gathered over a reliable channel in dist."""
        first = [self.owners.index(p) for p in range(self.parts)]  # one holder of every block
        out = {}
        for leaf, param in (("weight", self.weight), ("bias", self.bias)):
            if param is None:
                continue
            shards = self.group.all_gather_reliable(param.detach().contiguous())[first]
            if leaf == "bias":
                out[leaf] = unshard_columns(shards[:, None], self.chunks)[0]
            else:
                columns = unshard_columns(shards.transpose(1, 2) if self.linear else shards, self.chunks)
                out[leaf] = columns.t().contiguous() if self.linear else columns
        return out

    def _sum_copies(self, grad: torch.Tensor) -> torch.Tensor:
        every = self.group.all_gather_reliable(grad.contiguous())  # [tp, ...]
        summed = every.reshape(self.parts, -1, *every.shape[1:]).sum(1)
        return summed[[self.owners[r] for r in self.group.ranks]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _per_rank(x, self.group.stacked)
        weight = self.group.per_rank(self.weight).to(h.dtype)
        weight = weight.transpose(1, 2) if self.linear else weight
        if self.bias is None:
            out = torch.bmm(h, weight)
        else:
            out = torch.baddbmm(self.group.per_rank(self.bias).unsqueeze(1).to(h.dtype), h, weight)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def extra_repr(self) -> str:
        return f"{self.name}, chunks={self.chunks}, parts={self.parts}"


class RowParallel(nn.Module):
    """A linear layer split along its inputs: partial outputs are reduced (lossy), then the full bias is added once."""

    def __init__(self, layer: nn.Module, group: SimGroup, name: str, site: str):
        super().__init__()
        tp = group.tp_size
        self.group, self.name, self.site = group, name, site
        self.linear = _is_linear(layer)
        inputs = layer.weight.shape[1 if self.linear else 0]
        if inputs % tp:
            raise ValueError(f"tp_size={tp} does not divide the {inputs} input features of {name}")
        self.weight = nn.Parameter(self.shard("weight", layer.weight.data)[group.ranks].clone())
        # Replicated: never sent over the lossy link, never summed tp_size times.
        bias = getattr(layer, "bias", None)
        self.bias = nn.Parameter(bias.data.clone()) if bias is not None else None

    def shard(self, leaf: str, full: torch.Tensor) -> Optional[torch.Tensor]:
        """A full HF ``weight`` as every rank stores it ([tp_size, ...]); None for the replicated bias."""
        if leaf == "bias":
            return None
        tp = self.group.tp_size
        if self.linear:  # [out, in] -> [tp, out, in/tp]
            return full.reshape(full.shape[0], tp, -1).transpose(0, 1)
        return full.reshape(tp, -1, full.shape[-1])

    def full(self) -> dict[str, torch.Tensor]:
        shards = self.group.all_gather_reliable(self.weight.detach().contiguous())
        weight = shards.transpose(0, 1).reshape(shards.shape[1], -1) if self.linear \
            else shards.reshape(-1, shards.shape[-1])
        out = {"weight": weight}
        if self.bias is not None:
            out["bias"] = self.bias.detach().clone()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _per_rank(x, self.group.stacked)
        weight = self.group.per_rank(self.weight).to(h.dtype)
        partial = torch.bmm(h, weight.transpose(1, 2) if self.linear else weight)
        out = reduce_from_tp(partial, self.group, self.site)
        if self.bias is not None:  # [R, 1, n]: each rank's bias gradient is its own rows' sum (run_per_rank)
            out = out + self.group.row_bias(self.bias, out.dtype, out.shape[0])
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def extra_repr(self) -> str:
        return f"{self.name}, site={self.site}"


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


def run_per_rank(module: nn.Module, group: SimGroup) -> None:
    """Make ``module`` (which holds replicated parameters: an embedding, a norm, a head) run once per
    rank on that rank's rows of ``[R * batch, ...]``, each rank on its own view of the parameters.

    Why: a replicated parameter's gradient must be each rank's own sum over its rows, added across
    ranks afterwards, as ``dist`` forms it (every rank backpropagates its rows, then the ranks' sums
    are all-reduced); one reduction over every rank's rows at once rounds differently. The values
    it computes are the module's own, row for row. An input shared by every row (GPT-2's ``[1, seq]``
    position ids) is first repeated for every row, so its gradient too is summed rank by rank.
    """
    names = [name for name, _ in module.named_parameters(recurse=False)]
    forward = type(module).forward

    def per_rank(x: torch.Tensor, *args, **kwargs):
        ranks = group.stacked
        if x.shape[0] == 1 and group.rows > 1:
            x = x.expand(group.rows, *x.shape[1:])
        views = {name: group.replicated_views(getattr(module, name)) for name in names}
        outs = []
        for r, rows in enumerate(x.chunk(ranks)):
            state = vars(module)
            state.update({name: view[r] for name, view in views.items()})  # shadows the parameters
            try:
                outs.append(forward(module, rows, *args, **kwargs))
            finally:
                for name in names:
                    del state[name]
        if isinstance(outs[0], tuple):   # (a router's logits, weights and experts)
            return tuple(torch.cat(parts) for parts in zip(*outs))
        return torch.cat(outs)

    module.forward = per_rank
