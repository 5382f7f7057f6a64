"""An MoE block's routed experts sharded over the expert-parallel group, Megatron's all-to-all dispatcher.

``ExpertParallel`` takes the place of HF's experts module (Mixtral's, Qwen3-MoE's, DeepSeek-V3's: 3-D
``gate_up_proj`` [experts, 2 x ffn, hidden] and ``down_proj`` [experts, hidden, ffn], a SwiGLU each) and
is called as it is, with the model's own router's top-k experts and gate weights. Each rank holds
``num_experts / ep`` consecutive experts (rank e the e-th block), whole (expert-tensor parallelism 1:
every TP rank of a replica holds them, replicated as a norm is, and computes them on its own copy of
the tokens). Per TP rank, as Megatron's ``alltoall`` token dispatcher does:

1. the routing's counts per expert are shared with the group (reliably: a few bytes per expert, as
   Megatron's all-to-all of the counts; ``share``);
2. every (token, expert) assignment is one row, the rows sorted by expert, so each peer's rows are one
   block; the blocks go to their experts' ranks (``dispatch``: an all-to-all, lossy traffic class
   ``ep_dispatch``; a rank's rows for its own experts stay home);
3. each local expert runs on its rows (from every source, in source order);
4. the outputs go back the same way (``combine``, class ``ep_combine``), and each token sums its experts'
   outputs times their gate weights.

Backward runs the two all-to-alls the other way (direction ``bwd``). What a lost packet means: a
dispatch loss zeroes some elements of some rows an expert computes on (``zero``), or the whole row
(``drop_token``: the expert's output for that token is zero and nothing flows back through it, exactly
what skipping a token over capacity does for these bias-free SwiGLU experts: silu(0) x 0 = 0); a combine
loss zeroes elements (or the rows) of some expert outputs a token sums.

In evaluation one replica runs (``sim``: replica 0; ``dist``: every process, the group's first member
routing): only the group's first member routes tokens, the others compute their experts for them.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class _AllToAll(torch.autograd.Function):
    """forward: rows ``x`` (``matrix[me]`` to each member, in member order) through the group's all-to-all
    of ``traffic``; backward: their gradients back over the transposed matrix."""

    @staticmethod
    def forward(ctx, x, group, traffic, site, matrix):
        ctx.group, ctx.traffic, ctx.site, ctx.matrix = group, traffic, site, matrix
        return group.exchange(traffic, site, "fwd", x, matrix)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.exchange(ctx.traffic, ctx.site, "bwd", grad.contiguous(), transposed(ctx.matrix)), \
            None, None, None, None


def transposed(matrix: Sequence[Sequence[int]]) -> list[list[int]]:
    return [list(column) for column in zip(*matrix)]


# The steps of a route that ``ExpertParallel`` and ``lossysim.ep.context.ContextExperts`` (a route per
# context rank's member) share.

def _by_tp_rank(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor:
    """``module.route`` on each local TP rank's rows (``hidden_states`` holds them TP rank by TP rank),
    through that rank's group (``module.groups``); the outputs in the same order."""
    ranks = module.tp_group.local_size
    outs = [module.route(x, index, weights, group) for x, index, weights, group in
            zip(hidden_states.chunk(ranks), top_k_index.chunk(ranks), top_k_weights.chunk(ranks), module.groups)]
    return torch.cat(outs)


def _assignments(index: torch.Tensor, routes: bool, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) assignments of top-k ``index`` [T, k] sorted by expert (then token, slot), and
    the counts per expert; none where this rank does not route (``routes`` False: evaluation)."""
    flat = index.reshape(-1) if routes else index.new_zeros(0)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


def _weighted(back: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, k: int) -> torch.Tensor:
    """The expert outputs ``back`` (the assignments in ``order``) back to their tokens, each token's k
    outputs summed times its gate ``weights`` [T, k]."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order), device=order.device)
    outputs = back[inverse].view(len(weights), k, -1)
    return (outputs * weights.unsqueeze(-1).to(outputs.dtype)).sum(1)


class ExpertParallel(nn.Module):
    """A block's routed experts, this rank's share of them (``ep_rank`` of ``ep_size``), dispatched to and
    combined from over ``groups`` (one per TP rank this process holds: ``lossysim.ep.groups``)."""

    def __init__(self, experts: nn.Module, site: str, ep_rank: int, ep_size: int, tp_group):
        super().__init__()
        total = int(experts.num_experts)
        if total % ep_size:
            raise ValueError(f"ep_size={ep_size} does not divide the {total} experts of {site}")
        if getattr(experts, "has_bias", False) or not getattr(experts, "has_gate", True):
            raise ValueError(f"{site}: experts with biases or without a gate are not supported")
        self.site, self.num_experts, self.per_rank = site, total, total // ep_size
        self.first = ep_rank * self.per_rank
        held = slice(self.first, self.first + self.per_rank)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[held].clone())
        self.down_proj = nn.Parameter(experts.down_proj.detach()[held].clone())
        self.act_fn = experts.act_fn
        self.tp_group = tp_group
        self.groups: list = []          # per local TP rank: its expert-parallel group (``connect``)
        self.routers = 1                # the group's members that route in evaluation (lossysim.ep.context)
        for param in (self.gate_up_proj, self.down_proj):
            # averaged over its own expert-data-parallel group (lossysim.ep); with ep 1, as every replicated one
            param.expert_parallel = ep_size > 1
            param.register_hook(tp_group.average_replicated)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return _by_tp_rank(self, hidden_states, top_k_index, top_k_weights)

    def route(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, group) -> torch.Tensor:
        """One TP rank's tokens ``x`` [T, hidden] to their top-k experts and back, weighted."""
        k = index.shape[1]
        # evaluation: the group's first replica's tokens alone (its ``routers`` context ranks' members)
        routes = self.training or group.member < self.routers
        order, counts = _assignments(index, routes, self.num_experts)
        every = group.share(self.site, counts)         # [members, experts]
        per = every.reshape(len(every), -1, self.per_rank).sum(-1).tolist()    # rows member s sends member d
        sent = x[torch.div(order, k, rounding_mode="floor")]
        received = _AllToAll.apply(sent, group, "ep_dispatch", f"{self.site}.dispatch", per)
        computed = self.compute(received, every[:, self.first:self.first + self.per_rank])
        back = _AllToAll.apply(computed, group, "ep_combine", f"{self.site}.combine", transposed(per))
        if not routes:
            return torch.zeros_like(x)
        return _weighted(back, order, weights, k)

    def compute(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each local expert on its rows: ``rows`` come source by source, each source's sorted by expert
        (``counts`` [sources, local experts]); the outputs in the same order."""
        if not len(rows):   # still on the graph: the combine's backward is a meeting every member must come to
            return rows.clone()
        expert = torch.repeat_interleave(torch.arange(self.per_rank, device=rows.device).repeat(len(counts)),
                                         counts.reshape(-1).to(rows.device))
        grouped = torch.argsort(expert, stable=True)
        sizes = counts.sum(0).tolist()
        outs = []
        for j, chosen in enumerate(grouped.split(sizes)):
            if not len(chosen):
                continue
            gate, up = F.linear(rows[chosen], self.gate_up_proj[j]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[j]))
        inverse = torch.empty_like(grouped)
        inverse[grouped] = torch.arange(len(grouped), device=grouped.device)
        return torch.cat(outs)[inverse]

    def gathered(self) -> dict:
        """Every expert of the layer, gathered over the group reliably (``gather_full_model``)."""
        group = self.groups[0]
        return {leaf: group.gather(self.site, leaf, getattr(self, leaf).detach()) for leaf in ("gate_up_proj", "down_proj")}

    def extra_repr(self) -> str:
        return f"{self.site}, experts {self.first}..{self.first + self.per_rank - 1} of {self.num_experts}"
