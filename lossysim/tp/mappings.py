"""The Megatron-LM mappings: where activations enter and leave the tensor-parallel region.

Each is a tiny autograd function over a group (``lossysim.tp.groups``), which moves the data
through the lossy network. ``copy`` sites carry gradients (direction ``bwd``), ``reduce`` and
``gather`` sites carry activations (``fwd``).
"""
from __future__ import annotations

import torch

from .groups import SimGroup


class _CopyToTP(torch.autograd.Function):
    """forward: identity; backward: all-reduce of the input gradient (lossy ``bwd`` traffic)."""

    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group, ctx.site = group, site
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_reduce(grad, ctx.site, "bwd"), None, None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce of the partial outputs (lossy ``fwd`` traffic); backward: identity."""

    @staticmethod
    def forward(ctx, x, group, site):
        return group.all_reduce(x, site, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromTP(torch.autograd.Function):
    """forward: all-gather along the last dim (lossy ``fwd`` traffic); backward: keep own slice."""

    @staticmethod
    def forward(ctx, x, group, site):
        ctx.group, ctx.width = group, x.shape[-1]
        return group.all_gather(x, site, "fwd")

    @staticmethod
    def backward(ctx, grad):
        slices = [grad[i, ..., r * ctx.width:(r + 1) * ctx.width] for i, r in enumerate(ctx.group.ranks)]
        return torch.stack(slices), None, None


def copy_to_tp(x: torch.Tensor, group: SimGroup, site: str) -> torch.Tensor:
    return _CopyToTP.apply(x, group, site)


def reduce_from_tp(x: torch.Tensor, group: SimGroup, site: str) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group, site)


def gather_from_tp(x: torch.Tensor, group: SimGroup, site: str) -> torch.Tensor:
    return _GatherFromTP.apply(x, group, site)
