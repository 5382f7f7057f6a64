"""Replicas of the tensor-parallel group (of each pipeline stage) and the data-parallel traffic between them.

TP position t of a stage s of every replica forms a data-parallel group (``Mesh.group("dp", rank)``), with
its own ``LossyNetwork`` of dp_size ranks: its own links, chains and statistics, apart from the TP
links'. Each stage buckets its own parameters (the embeddings with the first, the final norm and the
head with the last: ``pp.stages.parameter_stages``); without pipeline stages there is one.

After every replica's backward, each bucket (``buckets``) of every group is all-reduced through the
group's network (site ``dp.bucket{i}``, direction ``bwd``): receiver r's sum is divided by dp_size and
written back as replica r's gradient. ``recovery: zero`` drops what was lost; ``rescale`` divides what
arrives by the probability that it arrives, hop by hop, as for TP traffic (unbiased for any
contributions; see docs/semantics.md). A replicated parameter (embeddings, norms, head) has one copy
per TP rank, each in its own group; a replica keeps the mean of what its groups delivered, as the
reliable channel that keeps replicated parameters equal inside a TP group would average them.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..net import LossyNetwork
from . import buckets as bucketing
from .buckets import Bucket
from .replica import Replica
from .drift import _relative, _square_sums, _summed, broadcast_time


class DataParallel:
    """``sim``: every replica in this process, one data-parallel network per stage and TP position, each
    stage's bucket plan.

    ``replicas`` are the replicas this process runs (numbered from ``first``); the methods below that
    cross replicas (times, logits, finiteness, statistics) are the ones ``DistDataParallel`` moves over
    process groups instead. One replica and no networks is a run without data parallelism: a group
    of one, which sends nothing and whose averaging is the identity (in ``dist`` too: its only peer is
    itself).
    """

    first = 0
    fsdp = False              # DDP: every replica holds whole parameters (``fsdp`` shards them)

    def __init__(self, replicas: Sequence[Replica], networks: Sequence[Sequence[LossyNetwork]], bucket_bytes: float,
                 experts: bool = False, contexts: int = 1):
        """``networks[s][t]``: stage s's TP position t's group (one stage without a pipeline; none at all
        for a group of one). ``experts``: average the experts' parameters (``lossysim.ep``, over a group of
        the replicas holding the same experts) instead of every other one. ``contexts``: each replica's
        context ranks, every one of them a member of the group with its own gradients (Megatron's dp x cp
        group: ``_context_mean``)."""
        self.experts, self.contexts = experts, contexts
        self.replicas = list(replicas)
        self.stage_networks = [list(stage) for stage in networks]
        self.networks = [n for stage in self.stage_networks for n in stage]   # every group's, stage by stage
        self.dp_size = len(self.replicas)
        self.tp_size = len(self.stage_networks[0]) if self.stage_networks else 0
        self._init_buckets(bucket_bytes, range(max(len(self.stage_networks), 1)))

    @property
    def grouped(self) -> bool:
        """Whether its group has more than one member (replicas x context ranks): one sends nothing."""
        return self.dp_size * self.contexts > 1

    def _init_buckets(self, bucket_bytes: float, stages: Sequence[int]) -> None:
        """Each of ``stages``' buckets of its own parameters (``stage_buckets``, in that order) and all of
        them (``buckets``)."""
        model = self.replicas[0].model
        sharded_ids = {id(q) for q in model.sharded_parameters()}
        params = list(model.parameters())
        self._sharded = {i for i, p in enumerate(params) if id(p) in sharded_ids}
        self._stage_of = self.replicas[0].stage_of_parameters()
        # an expert's parameters live on the replicas holding that expert: their own groups average them
        self._mine = [getattr(p, "expert_parallel", False) == self.experts for p in params]
        self.stage_buckets: list[list[Bucket]] = [
            bucketing.plan_buckets(params, sharded_ids, bucket_bytes,
                                   [owner == s and mine for owner, mine in zip(self._stage_of, self._mine)])
            for s in stages]
        self.buckets: list[Bucket] = [b for stage in self.stage_buckets for b in stage]
        self._buffers: dict = {}

    def state_dict(self) -> dict:
        """This process's share of data parallelism for a checkpoint: the replicas after its first (the
        first is the run's own model, saved beside this) and its data-parallel networks. FSDP's master
        copy lives only inside a step, so between steps this is all there is."""
        return {"replicas": [r.state_dict() for r in self.replicas[1:]],
                "networks": [n.state_dict() for n in self.networks]}

    def load_state_dict(self, state: dict) -> None:
        if (len(state["replicas"]), len(state["networks"])) != (len(self.replicas) - 1, len(self.networks)):
            raise ValueError(f"data-parallel state of {len(state['replicas']) + 1} replicas and "
                             f"{len(state['networks'])} networks, this process runs {len(self.replicas)} "
                             f"and {len(self.networks)}")
        for replica, saved in zip(self.replicas[1:], state["replicas"]):
            replica.load_state_dict(saved)
        for network, saved in zip(self.networks, state["networks"]):
            network.load_state_dict(saved)

    def gather_weights(self) -> list[list[float]]:
        """DDP gathers no weights before the forward (FSDP does: ``fsdp``); each stage's units' seconds: none."""
        return []

    def ready(self) -> list[list[float]]:
        """Each stage's buckets' readiness: the share of its backward done when each is full."""
        return [[b.ready for b in stage] for stage in self.stage_buckets]

    def average_gradients(self) -> list[list[float]]:
        """All-reduce every bucket in every group; write each replica's average back as its gradient.
        Returns each stage's buckets' seconds on the clock (the slowest group's: groups run side by side).
        A group of one averages nothing: its gradients stay as backward left them."""
        if not self.grouped:
            return []
        grads = [[_grad(p) for p in r.model.parameters()] for r in self.replicas]
        # each member's contribution: a replica's, or (dp x cp) each of its context ranks'
        rows = grads if self.contexts == 1 else \
            [g for r in self.replicas for g in r.model.context.gradients.take(list(r.model.parameters()))]
        seconds = [self._average_stage(grads, buckets, networks, rows)
                   for buckets, networks in zip(self.stage_buckets, self.stage_networks)]
        for replica, g in zip(self.replicas, grads):
            for p, grad in zip(replica.model.parameters(), g):
                p.grad = grad
        return seconds

    def _average_stage(self, grads: list, buckets: list[Bucket], networks: list[LossyNetwork],
                       rows: list) -> list[float]:
        """One stage's buckets averaged over its groups (``average_gradients``): ``rows``, every member's
        gradients, in, ``grads``, every replica's, out; each bucket's seconds."""
        seconds, members = [], len(rows)
        for b, bucket in enumerate(buckets):
            slowest = 0.0
            replicated: dict[int, torch.Tensor] = {}   # parameter -> [dp, numel]: the groups' deliveries summed
            for t, network in enumerate(networks):
                before = network.clock()["comm_s"]
                contributions = self._scratch("contributions", bucket.numel, grads[0][bucket.params[0]])
                for g, row in zip(rows, contributions):
                    bucketing.flatten(g, bucket, t, out=row)
                delivered = network.all_reduce(f"dp.bucket{b}", "bwd", contributions, range(members),
                                               out=contributions)   # in place, as NCCL runs DDP's buckets
                slowest = max(slowest, network.clock()["comm_s"] - before)
                for k, piece in enumerate(bucketing.pieces(delivered, bucket)):
                    i = bucket.params[k]                 # piece: [members, numel], receiver r's sum at r
                    if self.contexts > 1:                # a replica's context ranks' deliveries, their mean
                        piece = _context_mean((piece / self.dp_size).view(self.dp_size, self.contexts, -1), 1)
                    if bucket.sharded[k] or self.tp_size == 1:
                        # the average straight into the gradient (one group holds all of it)
                        for r, g in enumerate(grads):
                            own = g[i][t] if bucket.sharded[k] else g[i]
                            if self.contexts > 1:
                                own.copy_(piece[r].view_as(own))
                            else:
                                torch.div(piece[r].view_as(own), self.dp_size, out=own)
                    else:
                        averaged = piece if self.contexts > 1 else piece / self.dp_size
                        replicated[i] = averaged if t == 0 else replicated[i].add_(averaged)
            for i, summed in replicated.items():
                summed = summed / self.tp_size
                for r, g in enumerate(grads):
                    g[i].copy_(summed[r].view_as(g[i]))
            seconds.append(slowest)
        return seconds

    def _scratch(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A [dp_size, numel] buffer kept from call to call (the largest bucket's size): a fresh one
        per bucket costs more in page faults than the copies it holds."""
        key, members = (name, like.dtype, like.device), self.dp_size * self.contexts
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < members * numel:
            buffer = self._buffers[key] = torch.empty(members * max(b.numel for b in self.buckets),
                                                      dtype=like.dtype, device=like.device)
        return buffer[:members * numel].view(members, numel)

    # -- what crosses replicas ---------------------------------------------------------
    def gather_replicas(self, local: Sequence[torch.Tensor]) -> torch.Tensor:
        """Every replica's tensor (this process's ``local`` ones), concatenated in replica order."""
        return torch.cat(list(local))

    def every_replica(self, local: list) -> list:
        """Every replica's value (plain data; this process's ``local`` ones), in replica order."""
        return list(local)

    def every_stage(self, local: list) -> list:
        """Every stage's value (plain data; this process's stages' ``local`` ones), in stage order."""
        return list(local)

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        return flag

    def summaries(self, by: Sequence[str] = ("direction",)) -> list[list[dict]]:
        """Every data-parallel group's traffic summary (``LossyNetwork.summary``)."""
        return [network.summary(by=by) for network in self.networks]

    @torch.no_grad()
    def drift(self) -> float:
        """How far the replicas' parameters have drifted from replica 0's: max over r of
        ||p_r - p_0|| / ||p_0||, over every parameter (every TP rank's shard) at once. Summed as
        ``dist`` sums it (each TP rank's squares of each stage's parameters, then those totals TP rank
        by TP rank, stage by stage), so the two backends give the same bits on the same weights."""
        base = list(self.replicas[0].model.parameters())
        worst = torch.zeros((), dtype=torch.float64)
        for replica in self.replicas[1:]:
            params = list(replica.model.parameters())
            worst = torch.maximum(worst, _relative(_summed(
                [[_square_sums(self._local(params, base, t, s)) for s in range(len(self.stage_buckets))]
                 for t in range(max(self.tp_size, 1))])).cpu())
        return float(worst)

    def _local(self, params: list, base: list, t: int, stage: int) -> list:
        """(parameter, replica 0's) pairs of ``stage`` as TP rank t holds them: its shard of each sharded
        one, and the replicated ones on rank 0 only (counted once)."""
        return [(p[t:t + 1], b[t:t + 1]) if i in self._sharded else (p, b)
                for i, (p, b) in enumerate(zip(params, base))
                if self._stage_of[i] == stage and self._mine[i] and (i in self._sharded or t == 0)]

    @torch.no_grad()
    def synchronise(self) -> float:
        """Replica 0's parameters broadcast to every replica over a reliable channel; its seconds (NCCL's
        ring broadcast of a TP rank's local parameters, every group side by side)."""
        params = list(self.replicas[0].model.parameters())
        for replica in self.replicas[1:]:
            for p, source in zip(replica.model.parameters(), params):
                p.copy_(source)
        local = sum((p[0] if i in self._sharded else p).numel() * p.element_size() for i, p in enumerate(params))
        return broadcast_time(self.networks[0], local)


class DistDataParallel(DataParallel):
    """``dist``: this process is TP rank ``tp_rank`` of stage ``stage`` of replica ``replica``;
    ``dp_group`` holds its data-parallel peers, ``tp_group`` its replica's stage's TP ranks, ``pp_group``
    (with stages) its replica's pipeline at its TP position. It buckets its stage's parameters only.
    Every rank gathers its group's bucket messages over a reliable channel and draws every link's packets
    from the same streams as ``sim``, keeping its own receiver's row, so it applies exactly the masks
    ``sim`` applies for it."""

    def __init__(self, replica: Replica, network: LossyNetwork, bucket_bytes: float, *, replica_index: int,
                 tp_rank: int, dp_size: int, tp_size: int, dp_group, tp_group, stage: int = 0, pp_group=None,
                 experts: bool = False, contexts: int = 1, context: int = 0, grad_group=None, cp_group=None):
        """(``contexts`` > 1: this process is context rank ``context``, a member of the dp x cp group
        ``grad_group`` with its own gradients; ``cp_group``: its replica's context ranks.)"""
        self.experts, self.contexts, self.member = experts, contexts, replica_index * contexts + context
        self.grad_group, self.cp_group = (dp_group, None) if contexts == 1 else (grad_group, cp_group)
        self.replicas = [replica]
        self.stage_networks = [[network]]
        self.networks = [network]
        self.first, self.tp_rank, self.stage = replica_index, tp_rank, stage
        self.dp_size, self.tp_size = dp_size, tp_size
        self.dp_group, self.tp_group, self.pp_group = dp_group, tp_group, pp_group
        # nccl moves only tensors on the rank's GPU; gloo takes these on the CPU too
        self.device = next(replica.model.parameters()).device
        self._init_buckets(bucket_bytes, [stage])

    def _write_back(self, grads: list, bucket, averaged: torch.Tensor) -> None:
        """A bucket's averaged message into ``grads``: a sharded parameter's piece as it is, a replicated
        one as the mean of the TP groups' pieces, summed in TP order as sim sums them."""
        for k, piece in enumerate(bucketing.pieces(averaged, bucket)):
            i = bucket.params[k]
            if bucket.sharded[k]:
                grads[i][0].copy_(piece.view_as(grads[i][0]))
            else:
                every = self._gather(piece, self.tp_group, self.tp_size)
                summed = every[0].clone()
                for t in range(1, self.tp_size):
                    summed = summed + every[t]
                grads[i].copy_((summed / self.tp_size).view_as(grads[i]))

    def _slowest(self, seconds: float) -> float:
        """The slowest TP position's time for a collective: the replica waits for its last group."""
        slowest = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.tp_group)
        return float(slowest)

    def _gather(self, x: torch.Tensor, group, size: int) -> torch.Tensor:
        out = torch.empty(size * x.numel(), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous().reshape(-1), group=group)
        return out.view(size, *x.shape)

    def average_gradients(self) -> list[list[float]]:
        network = self.networks[0]
        grads = [_grad(p) for p in self.replicas[0].model.parameters()]
        seconds = []
        for b, bucket in enumerate(self.buckets):
            before = network.clock()["comm_s"]
            contributions = self._gather(bucketing.flatten(grads, bucket, 0), self.grad_group,
                                         self.dp_size * self.contexts)
            delivered = network.all_reduce(f"dp.bucket{b}", "bwd", contributions, [self.member])
            averaged = delivered[0] / self.dp_size
            if self.contexts > 1:   # the replica's context ranks' deliveries, their mean (as sim's)
                averaged = _context_mean(self._gather(averaged, self.cp_group, self.contexts), 0)
            self._write_back(grads, bucket, averaged)
            seconds.append(self._slowest(network.clock()["comm_s"] - before))
        for p, grad, stage in zip(self.replicas[0].model.parameters(), grads, self._stage_of):
            if stage == self.stage:     # another stage's parameters are not this process's to step
                p.grad = grad
        return [seconds]

    def gather_replicas(self, local: Sequence[torch.Tensor]) -> torch.Tensor:
        local = torch.cat(list(local))
        gathered = self._gather(local.to(self.device), self.dp_group, self.dp_size)
        return gathered.flatten(0, 1).to(local.device)

    def every_replica(self, local: list) -> list:
        every: list = [None] * self.dp_size
        dist.all_gather_object(every, local[0], group=self.dp_group)
        return every

    def every_stage(self, local: list) -> list:
        if self.pp_group is None:
            return list(local)
        every: list = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(every, local[0], group=self.pp_group)
        return every

    def all_true(self, flag: bool) -> bool:
        value = torch.tensor([1 if flag else 0], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return bool(value)

    def summaries(self, by: Sequence[str] = ("direction",)) -> list[list[dict]]:
        every: list = [None] * self.tp_size
        dist.all_gather_object(every, self.networks[0].summary(by=by), group=self.tp_group)
        return [summary for stage in self.every_stage([every]) for summary in stage]   # every stage's groups

    @torch.no_grad()
    def drift(self) -> float:
        """As ``sim``'s: each rank sums its local squares of its stage's parameters (a replicated
        parameter counted on TP rank 0 only), the replica's ranks' sums are gathered and added TP rank by
        TP rank, stage by stage; the worst replica wins."""
        params = [(i, p) for i, p in enumerate(self.replicas[0].model.parameters())
                  if self._stage_of[i] == self.stage and self._mine[i]]
        pairs = []
        for i, p in params:
            b = p.detach().float().clone()
            dist.broadcast(b, src=dist.get_global_rank(self.dp_group, 0), group=self.dp_group)
            if i in self._sharded or self.tp_rank == 0:
                pairs.append((p, b))
        mine: list = [None] * self.tp_size
        dist.all_gather_object(mine, _square_sums(pairs).cpu(), group=self.tp_group)   # [t]
        every = self.every_stage([mine])                                                # [s][t]
        rel = _relative(_summed([[every[s][t] for s in range(len(every))] for t in range(self.tp_size)]))
        rel = rel.reshape(1).to(self.device)
        dist.all_reduce(rel, op=dist.ReduceOp.MAX, group=self.dp_group)
        return float(rel)

    @torch.no_grad()
    def synchronise(self) -> float:
        params = list(self.replicas[0].model.parameters())
        for p in params:
            dist.broadcast(p.data, src=dist.get_global_rank(self.dp_group, 0), group=self.dp_group)
        local = sum((p[0] if i in self._sharded else p).numel() * p.element_size() for i, p in enumerate(params))
        return broadcast_time(self.networks[0], local)


def _context_mean(delivered: torch.Tensor, dim: int) -> torch.Tensor:
    """The mean of a replica's context ranks' deliveries (along ``dim``), summed in context order: the
    context ranks share one copy of the weights (``sim``'s), so each keeps what they received on average,
    as a replicated parameter keeps its TP groups' mean."""
    parts = delivered.unbind(dim)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total / len(parts)


def _grad(p: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient (zeros when it got none: DDP sends its bucket slot all the same)."""
    return p.grad if p.grad is not None else torch.zeros_like(p)
