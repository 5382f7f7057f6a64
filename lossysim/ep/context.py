"""Experts beside context parallelism, as ``sim`` runs them.

Megatron carves the expert-parallel group out of dp x cp: the (context, replica) index ``cp + cp_size x dp``
cut ep innermost (``Mesh.coordinates``), so with cp dividing ep the cp context ranks of one replica are cp
consecutive members of one ep group (cp 2, dp 1, ep 2: the two context ranks are the two members), and an
ep group spans ep / cp replicas. Each context rank holds its own member's experts: a token of context rank
c is routed, dispatched and combined as member c's, and an expert's gradient is only what its own member's
rows gave it, never summed over the context ranks (the dense parameters' is).

``dist`` runs one context rank a process: its experts module is ``ExpertParallel`` as without context
parallelism. ``sim`` runs a replica's context ranks as one model (``lossysim.cp``), so a block's experts
module is ``ContextExperts``: every local context rank's ``ExpertParallel`` (its ``members``), their
parameters its own (``gate_up_proj_{c}``, ``down_proj_{c}``; saved as HF's one ``gate_up_proj``, the members'
blocks in order), routing each context rank's rows as its member through one ``ContextGroup`` per TP rank:
the replica brings its members' rows to the ep group's all-to-all at once (``Lockstep`` meets the ep / cp
replicas of a group). ``MemberView`` shows data parallelism one context rank's experts, so each member's
experts are averaged over its own expert-data-parallel network, bucketed as that rank's ``dist`` process
buckets them.
"""
from __future__ import annotations

import torch
from torch import nn

from .experts import ExpertParallel, _AllToAll, _assignments, _by_tp_rank, _weighted, transposed
from .groups import SimShared, _messages
from .lockstep import solo

_LEAVES = ("gate_up_proj", "down_proj")


class ContextExperts(nn.Module):
    """A block's routed experts in a ``sim`` replica under context parallelism: ``contexts`` members (one
    per context rank) from ``ep_rank`` on, each an ``ExpertParallel`` of ``ep_size``."""

    def __init__(self, experts: nn.Module, site: str, ep_rank: int, ep_size: int, tp_group, contexts: int):
        super().__init__()
        members = [ExpertParallel(experts, site, ep_rank + c, ep_size, tp_group) for c in range(contexts)]
        object.__setattr__(self, "members", members)   # not submodules: their parameters are this module's
        for c, member in enumerate(members):
            member.routers = contexts
            for leaf in _LEAVES:
                self.register_parameter(f"{leaf}_{c}", getattr(member, leaf))
        self.site, self.tp_group, self.contexts = site, tp_group, contexts
        self.num_experts, self.per_rank = members[0].num_experts, members[0].per_rank
        self.first = members[0].first
        self.groups: list = []          # per local TP rank: its ``ContextGroup``
        self.stage = 0

    @property
    def stage(self) -> int:
        return self._stage

    @stage.setter
    def stage(self, value: int) -> None:
        self._stage = value
        for member in self.members:
            member.stage = value

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return _by_tp_rank(self, hidden_states, top_k_index, top_k_weights)

    def route(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, group) -> torch.Tensor:
        """One TP rank's rows (its context ranks' local tokens, context rank by context rank) each to its
        member's top-k experts and back, as each context rank's ``ExpertParallel.route`` does alone."""
        k = index.shape[1]
        # evaluation: the group's first replica's context ranks route (sim evaluates replica 0)
        routes = self.training or group.slot == 0
        orders, counts = zip(*(_assignments(part, routes, self.num_experts) for part in
                               index.chunk(self.contexts)))
        counts = torch.stack(counts)
        every = group.share(self.site, counts)          # [ep, experts]
        per = every.reshape(len(every), -1, self.per_rank).sum(-1).tolist()
        sent = torch.cat([rows[torch.div(order, k, rounding_mode="floor")]
                          for rows, order in zip(x.chunk(self.contexts), orders)])
        received = _AllToAll.apply(sent, group, "ep_dispatch", f"{self.site}.dispatch", per)
        mine = [group.first + c for c in range(self.contexts)]
        computed = [member.compute(rows, every[:, member.first:member.first + self.per_rank]) for member, rows in
                    zip(self.members, received.split([sum(row[m] for row in per) for m in mine]))]
        back = _AllToAll.apply(torch.cat(computed), group, "ep_combine", f"{self.site}.combine", transposed(per))
        if not routes:
            return torch.zeros_like(x)
        return torch.cat([_weighted(got, order, w, k) for got, order, w in
                          zip(back.split([len(o) for o in orders]), orders, weights.chunk(self.contexts))])

    def gathered(self) -> dict:
        """Every expert of the layer, every member's block in member order (``gather_full_model``)."""
        held = self.groups[0].shared.experts[self.site]
        return {leaf: torch.cat([getattr(m, leaf).detach() for m in held]) for leaf in _LEAVES}

    # HF's names in a checkpoint: the local members' blocks as one tensor, cut back on loading
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for leaf in _LEAVES:
            parts = [getattr(m, leaf) for m in self.members]
            destination[prefix + leaf] = torch.cat([p if keep_vars else p.detach() for p in parts])

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for leaf in _LEAVES:
            key = prefix + leaf
            if key not in state_dict:
                missing_keys.append(key)
                continue
            with torch.no_grad():
                for member, block in zip(self.members, state_dict[key].chunk(self.contexts)):
                    getattr(member, leaf).copy_(block)
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and
                                   k[len(prefix):] not in _LEAVES)

    def extra_repr(self) -> str:
        last = self.first + self.contexts * self.per_rank - 1
        return f"{self.site}, experts {self.first}..{last} of {self.num_experts} over {self.contexts} context ranks"


class ContextGroup:
    """A ``sim`` replica's context ranks in one ep group (``shared``): members ``first`` .. ``first +
    contexts - 1``, the group's replica ``slot`` of ``shared.members // contexts``. A call brings every local
    member's rows at once (concatenated in member order); the group's replicas meet in the lockstep."""

    def __init__(self, shared: SimShared, slot: int, contexts: int, training=lambda: True):
        self.shared, self.slot, self.contexts, self.training = shared, slot, contexts, training
        self.first = slot * contexts
        self.replicas = shared.members // contexts

    def _meet(self, key, payload, work, other):
        lockstep = self.shared.lockstep
        if self.replicas == 1:
            return work([payload])[0]
        if lockstep.active:
            return lockstep.meet((id(self.shared), *key), self.replicas, self.slot, payload, work)
        return solo(self.replicas, self.slot, payload, work, other)

    def share(self, site: str, counts: torch.Tensor) -> torch.Tensor:
        """``counts`` [contexts, experts]: every member's, [ep, experts] (reliably)."""
        every = self._meet(("share",), counts, lambda parts: [torch.cat(parts)] * self.replicas,
                           lambda j: torch.zeros_like(counts))
        if self._solo:
            self.shared._solo["counts"] = every
        return every

    @property
    def _solo(self) -> bool:
        """Whether this call is a solo one (evaluation: the group's other replicas do not run)."""
        return self.replicas > 1 and not self.shared.lockstep.active

    def gather(self, site: str, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([getattr(m, leaf).detach() for m in self.shared.experts[site]])

    def exchange(self, traffic: str, site: str, direction: str, x: torch.Tensor, matrix) -> torch.Tensor:
        network = self.shared.networks.of(traffic, self.training())
        C = self.contexts

        def move(parts: list) -> list:
            rows = [r for j, part in enumerate(parts)
                    for r in part.split([sum(matrix[j * C + c]) for c in range(C)])]
            held = [torch.cat(row) for row in network.all_to_all(site, direction, _messages(rows, matrix))]
            if traffic == "ep_dispatch" and self._solo:
                self.shared._solo["received"] = held
            return [torch.cat(held[j * C:(j + 1) * C]) for j in range(self.replicas)]

        def other(j: int) -> torch.Tensor:
            """A replica that does not run (evaluation): nothing to dispatch; its members' experts on
            what they received, to combine."""
            if traffic == "ep_dispatch":
                return x.new_zeros(0, *x.shape[1:])
            counts, received = self.shared._solo["counts"], self.shared._solo["received"]
            outs = []
            for m in range(j * C, (j + 1) * C):
                expert = self.shared.experts[site.rsplit(".", 1)[0]][m]
                outs.append(expert.compute(received[m], counts[:, expert.first:expert.first + expert.per_rank]))
            return torch.cat(outs)
        return self._meet((traffic, direction), x, move, other)


class MemberView:
    """What data parallelism sees of a ``sim`` replica's model when it averages context rank ``context``'s
    experts: every parameter but the other context ranks' experts, in the model's order (a ``dist``
    process's own)."""

    def __init__(self, model, context: int):
        self.model, self.context = model, context
        others = {id(getattr(m, leaf)) for w in model.experts for c, m in enumerate(w.members) if c != context
                  for leaf in _LEAVES}
        self._params = [p for p in model.parameters() if id(p) not in others]

    def parameters(self):
        return iter(self._params)

    def sharded_parameters(self):
        return self.model.sharded_parameters()


def members(module) -> list:
    """A block's experts modules as members: a ``ContextExperts``'s, or the ``ExpertParallel`` itself."""
    return module.members if isinstance(module, ContextExperts) else [module]
