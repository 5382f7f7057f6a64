"""``sim``'s TP group under context parallelism (``ContextGroup``), and the context ranks' own gradients.

With data parallelism the context ranks' gradients are summed in the data-parallel all-reduce over the
dp x cp group (Megatron's), through its lossy network (``lossysim.dp.replicas``): ``sim`` then keeps each
context rank's gradient of every parameter apart (``Gradients``), as a ``dist`` process holds its own.
"""
from __future__ import annotations

import torch

from ..net import LossyNetwork
from ..tp.groups import SimGroup


class Gradients:
    """Each context rank's gradient of every parameter (by ``id``) since the last ``take``: what the
    views' hooks caught, each put through the parameter's own gradient hooks (its TP sums and means) as
    ``dist``'s autograd puts a process's, and summed over micro-batches in their order."""

    def __init__(self, contexts: int):
        self.contexts = contexts
        self.held: dict[int, list[torch.Tensor]] = {}

    def catch(self, param: torch.Tensor, fanned: torch.Tensor, dim: int) -> None:
        """Hook ``fanned`` (``param`` repeated along ``dim``, one slice per context rank) to keep each
        context rank's gradient of ``param``."""
        if not (torch.is_grad_enabled() and fanned.requires_grad):
            return

        def hook(grad: torch.Tensor) -> None:
            mine = []
            for g in grad.unbind(dim):
                for transform in (param._backward_hooks or {}).values():   # the parameter's own hooks, in order
                    out = transform(g)
                    g = g if out is None else out
                mine.append(g)
            held = self.held.get(id(param))
            if held is None:
                self.held[id(param)] = [g.clone() for g in mine]
            else:
                for kept, g in zip(held, mine):
                    kept += g
        fanned.register_hook(hook)

    def take(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """[context rank][parameter]: each context rank's gradients of ``params`` (zeros for one that got
        none), and forget them."""
        out = [[] for _ in range(self.contexts)]
        for p in params:
            held = self.held.pop(id(p), None)
            if getattr(p, "expert_parallel", False):   # a context rank's own experts: not its replica's to sum
                held = None
            elif held is None and p.grad is not None:
                raise RuntimeError("a parameter got a gradient no context rank's view caught")
            for c in range(self.contexts):
                out[c].append(torch.zeros_like(p) if held is None else held[c])
        self.held.clear()
        return out


class ContextGroup(SimGroup):
    """``sim``'s TP group when every TP rank's rows hold its context ranks' local sequences (``[tp, cp,
    batch]``): each context rank's TP traffic goes through that rank's own TP network (context rank 0's is
    the group's ``network``), its matmuls multiply its own rows (``per_rank``) and its replicated modules run
    on its rows with its own views of the parameters, shared by every module in one forward
    (``replicated_views``): a parameter's gradient is each context rank's summed over the TP ranks, then the
    context ranks' summed, as ``dist``'s hooks sum them; with data parallelism each context rank's is also
    kept apart (``Gradients``), for the dp x cp all-reduce."""
    context: "ContextParallel"  # (lossysim.cp.context)
    stage: int = 0

    @classmethod
    def attach(cls, group: SimGroup, context, stage: int = 0) -> None:
        group.__class__ = cls
        group.context, group.stage = context, stage

    @property
    def contexts(self) -> int:
        return self.context.cp

    @property
    def stacked(self) -> int:
        return self.local_size * self.contexts

    def _catch(self, param: torch.Tensor, fanned: torch.Tensor, dim: int) -> None:
        if self.context.gradients is not None:
            self.context.gradients.catch(param, fanned, dim)

    def per_rank(self, shards: torch.Tensor) -> torch.Tensor:
        R, C = shards.shape[0], self.contexts
        fanned = shards.unsqueeze(1).expand(R, C, *shards.shape[1:])
        self._catch(shards, fanned, 1)
        return fanned.reshape(R * C, *shards.shape[1:])

    def row_bias(self, bias: torch.Tensor, dtype: torch.dtype, rows: int) -> torch.Tensor:
        if self.context.gradients is None:
            return super().row_bias(bias, dtype, rows)
        fanned = bias.expand(self.contexts, *bias.shape)
        self._catch(bias, fanned, 0)
        return fanned.to(dtype).unsqueeze(0).expand(self.local_size, *fanned.shape).reshape(rows, 1, -1)

    def replicated_views(self, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
        views = self.context.views.get(id(param))
        if views is None:
            fanned = param.expand(self.contexts, *param.shape)
            self._catch(param, fanned, 0)
            per_context = [p.expand(self.local_size, *param.shape).unbind(0) for p in fanned.unbind(0)]
            views = self.context.views[id(param)] = tuple(per_context[c][t] for t in range(self.local_size)
                                                         for c in range(self.contexts))
        return views

    def _networks(self) -> list[LossyNetwork]:
        return [self.network, *self.context.active.of_stage("tp", self.stage)]

    def all_reduce(self, x: torch.Tensor, site: str, direction: str) -> torch.Tensor:
        """``x``: [tp, cp * rows, ...] or [tp * cp, rows, ...]; each context rank's rows on its own network."""
        parts = x.reshape(self.local_size, self.contexts, -1, *x.shape[2:])
        out = [network.all_reduce(site, direction, parts[:, c], self.ranks) for c, network in enumerate(self._networks())]
        return torch.stack(out, 1).reshape(x.shape)

    def all_gather(self, x: torch.Tensor, site: str, direction: str) -> torch.Tensor:
        raise NotImplementedError("context parallelism with a plan that gathers TP outputs is not modelled")


def data_parallel_keys(mesh, rank: int, groups: dict, contexts: int) -> dict:
    """``dist``'s context rank among the data-parallel ranks (``DistDataParallel``'s keywords; none with
    ``contexts`` 1): its context coordinate, the dp x cp group its gradients are summed over (Megatron's,
    ``Mesh.process_groups``'s ``dp_cp``) and its replica's context ranks', whose deliveries it averages."""
    if contexts == 1:
        return {}
    return dict(contexts=contexts, context=mesh.coordinates(rank)["cp"], grad_group=groups["dp_cp"][rank],
                cp_group=groups["cp"][rank])
