"""FSDP (ZeRO-3): parameters sharded over the data-parallel ranks, all-gathered through the lossy network
before the forward, gradients reduce-scattered to the shards' owners.

Units are DDP's bucket plan (``buckets``): runs of whole parameters, in reverse parameter order, of
``dp_bucket_mb`` MiB of a TP rank's local tensors (FSDP wraps runs of modules; a bucket is that run).
A unit's flat message (a TP rank's local tensors, as a bucket's) is padded with zeros to dp_size equal
shards of whole packets; replica r owns shard r, which is also the ring's chunk r, so the
reduce-scatter leaves exactly the owner's shard at its owner.

A step (``sim``; ``dist`` is the same, rank by rank: ``DistFullyShardedDataParallel``):

1. ``gather_weights``: every data-parallel group all-gathers every unit's shards (site
   ``fsdp.gather{i}``, direction ``fwd``); what receiver r holds, a lost packet a hole of zeros, is
   replica r's working copy. Forward and backward both use it (``reshard_after_forward=False``: no
   second gather before backward).
2. ``average_gradients``: every group reduce-scatters every unit's gradients (site ``fsdp.reduce{i}``,
   direction ``bwd``, ``zero`` or ``rescale``); owner r keeps its shard's sum divided by dp_size.

The master copy is exact: every replica's parameters go back to the master values and every replica
gets the owners' shards, assembled, as its gradient. AdamW is elementwise and the clipping norm is one
global norm over all shards, so each replica's step on the assembled gradient is exactly what the owners'
steps on their shards do; every replica ends the step equal to the master (drift 0 by construction).
With experts under loss each replica's clipping norm holds its own ep group's experts, so the replicas'
masters may part: each replica keeps its own, as each ``dist`` rank does.
The sim keeps dp copies of the optimiser state where FSDP keeps one shard of it per rank: memory is
not modelled.

A replicated parameter (embeddings, norms, head) sits in every TP position's units, so every group
gathers and reduce-scatters it (its traffic is counted and timed); the sim's TP model holds one copy of
it per replica, whose working copy is the one group 0 gathered, and whose gradient is the mean of what
the groups' owners received (as DDP's).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..net import LossyNetwork
from . import buckets as bucketing
from .replicas import DataParallel, DistDataParallel, _grad


def shard_numel(network: LossyNetwork, numel: int, dtype: torch.dtype) -> int:
    """Elements of each rank's shard of a unit of ``numel`` elements: whole packets, equal shards."""
    per_packet, n_packets = network.packets(numel, dtype)
    return -(-n_packets // network.ranks) * per_packet


def _padded(flat: torch.Tensor, ranks: int, shard: int) -> torch.Tensor:
    """``flat`` ([..., n]) padded with zeros to ``ranks * shard`` elements, as FSDP pads a flat parameter."""
    out = flat.new_zeros(*flat.shape[:-1], ranks * shard)
    out[..., :flat.shape[-1]] = flat
    return out


def gather(network: LossyNetwork, site: str, flat: torch.Tensor) -> torch.Tensor:
    """Every rank's view of the unit ``flat`` ([n], the master values) after its shards are
    all-gathered: ``[ranks, n]``, each lost packet of a shard a hole of zeros where that rank uses it."""
    R, n = network.ranks, flat.numel()
    shard = shard_numel(network, n, flat.dtype)
    shards = _padded(flat, R, shard).view(R, shard)
    return network.all_gather(site, "fwd", shards, range(R)).reshape(R, R * shard)[:, :n]


def _gather_owned(network: LossyNetwork, site: str, flats: list[torch.Tensor]) -> torch.Tensor:
    """``gather`` with shard r taken from owner r's copy of the unit (``flats[r]``, [n]): the same as
    ``gather(network, site, flats[0])`` while the copies are equal (without experts they always are)."""
    R, n = network.ranks, flats[0].numel()
    shard = shard_numel(network, n, flats[0].dtype)
    shards = torch.stack([_padded(flat, R, shard).view(R, shard)[r] for r, flat in enumerate(flats)])
    return network.all_gather(site, "fwd", shards, range(R)).reshape(R, R * shard)[:, :n]


def reduce_scatter(network: LossyNetwork, site: str, contributions: torch.Tensor) -> torch.Tensor:
    """The unit's summed gradient ([n]) as its owners hold it after a reduce-scatter of
    ``contributions`` ([ranks, n]): shard r is what arrived at owner r."""
    R, n = contributions.shape
    shard = shard_numel(network, n, contributions.dtype)
    delivered = network.reduce_scatter(site, "bwd", _padded(contributions, R, shard), range(R))
    owned = torch.cat([delivered[r, r * shard:(r + 1) * shard] for r in range(R)])
    return owned[:n]


class FullyShardedDataParallel(DataParallel):
    """``sim``'s FSDP: the units (``buckets``) sharded over the replicas, gathered and reduce-scattered
    through each data-parallel group's network."""

    fsdp = True

    def __init__(self, replicas, networks, bucket_bytes: float):
        super().__init__(replicas, networks, bucket_bytes)
        self._master: Optional[list[torch.Tensor]] = None

    @torch.no_grad()
    def gather_weights(self) -> list[list[float]]:
        """Every replica's working weights, gathered unit by unit from the master (shard r from replica r's
        copy, as ``dist`` gathers it from its owner), each stage's units over its own groups; returns each
        stage's units' seconds on the clock (the slowest group's: groups run side by side)."""
        self._master = [[p.detach().clone() for p in r.model.parameters()] for r in self.replicas]
        params = [list(r.model.parameters()) for r in self.replicas]
        seconds = []
        for buckets, networks in zip(self.stage_buckets, self.stage_networks):
            seconds.append([])
            for b, bucket in enumerate(buckets):
                slowest = 0.0
                for t, network in enumerate(networks):
                    before = network.clock()["comm_s"]
                    working = _gather_owned(network, f"fsdp.gather{b}",
                                            [bucketing.flatten(master, bucket, t) for master in self._master])
                    slowest = max(slowest, network.clock()["comm_s"] - before)
                    for k, piece in enumerate(bucketing.pieces(working, bucket)):
                        i = bucket.params[k]
                        for r, own in enumerate(params):
                            if bucket.sharded[k]:
                                own[i][t].copy_(piece[r].view_as(own[i][t]))
                            elif t == 0:      # one copy per replica: TP rank 0's
                                own[i].copy_(piece[r].view_as(own[i]))
                seconds[-1].append(slowest)
        return seconds

    def average_gradients(self) -> list[list[float]]:
        """Reduce-scatter every unit in every group (each stage's over its own); every replica's parameters
        back to the master and its gradient the owners' shards, divided by dp_size. Returns each stage's
        units' seconds."""
        grads = [[_grad(p) for p in r.model.parameters()] for r in self.replicas]
        assembled = [g.clone() for g in grads[0]]
        seconds = []
        for buckets, networks in zip(self.stage_buckets, self.stage_networks):
            seconds.append([])
            for b, bucket in enumerate(buckets):
                slowest = 0.0
                replicated: dict[int, torch.Tensor] = {}
                for t, network in enumerate(networks):
                    before = network.clock()["comm_s"]
                    contributions = torch.stack([bucketing.flatten(g, bucket, t) for g in grads])
                    owned = reduce_scatter(network, f"fsdp.reduce{b}", contributions) / self.dp_size
                    slowest = max(slowest, network.clock()["comm_s"] - before)
                    for k, piece in enumerate(bucketing.pieces(owned, bucket)):
                        i = bucket.params[k]
                        if bucket.sharded[k]:
                            assembled[i][t].copy_(piece.view_as(assembled[i][t]))
                        else:
                            replicated[i] = piece.clone() if t == 0 else replicated[i] + piece
                for i, summed in replicated.items():
                    assembled[i].copy_((summed / self.tp_size).view_as(assembled[i]))
                seconds[-1].append(slowest)
        with torch.no_grad():
            for r, replica in enumerate(self.replicas):
                for k, p in enumerate(replica.model.parameters()):
                    if not self._mine[k]:   # an expert's, replica's own: its own groups average it (lossysim.ep)
                        continue
                    if self._master is not None:
                        p.copy_(self._master[r][k])
                    p.grad = assembled[k].clone()
        self._master = None
        return seconds


class DistFullyShardedDataParallel(DistDataParallel):
    """``dist``'s FSDP: this process is TP rank ``tp_rank`` of replica ``replica`` (``DistDataParallel``).

    Before the forward, every rank all-gathers its group's shards of each unit (shard r from rank r's
    master, over a reliable channel: the data FSDP moves) and draws every link's packets from the same
    streams as ``sim``, keeping its own receiver's row: its working copy has exactly ``sim``'s holes.
    A replicated parameter's working copy is TP rank 0's group's (``sim``'s one copy per replica),
    broadcast inside the replica. After the backward, every rank reduce-scatters its group's gradients
    the same way and keeps its own shard as it arrived; the owners' shards are then gathered reliably
    so every rank's master copy steps on the assembled gradient, as in ``sim`` (the exact master copy:
    every rank holds all of it, where FSDP would hold one shard and its optimiser state)."""

    fsdp = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._master: Optional[list[torch.Tensor]] = None

    @torch.no_grad()
    def gather_weights(self) -> list[list[float]]:
        network, r, R = self.networks[0], self.first, self.dp_size
        params = list(self.replicas[0].model.parameters())
        self._master = [p.detach().clone() for p in params]
        tp_root = dist.get_global_rank(self.tp_group, 0)
        seconds = []
        for b, bucket in enumerate(self.buckets):
            before = network.clock()["comm_s"]
            flat = bucketing.flatten(self._master, bucket, 0)
            n = flat.numel()
            shard = shard_numel(network, n, flat.dtype)
            mine = _padded(flat, R, shard).view(R, shard)[r]
            shards = self._gather(mine, self.dp_group, R)            # [R, shard]: every owner's shard
            working = network.all_gather(f"fsdp.gather{b}", "fwd", shards, [r]).reshape(R * shard)[:n]
            for k, piece in enumerate(bucketing.pieces(working, bucket)):
                i = bucket.params[k]
                if bucket.sharded[k]:
                    params[i][0].copy_(piece.view_as(params[i][0]))
                else:             # one copy per replica: TP rank 0's group's
                    piece = piece.contiguous().clone()
                    dist.broadcast(piece, src=tp_root, group=self.tp_group)
                    params[i].copy_(piece.view_as(params[i]))
            seconds.append(self._slowest(network.clock()["comm_s"] - before))
        return [seconds]

    def average_gradients(self) -> list[list[float]]:
        network, r, R = self.networks[0], self.first, self.dp_size
        params = list(self.replicas[0].model.parameters())
        grads = [_grad(p) for p in params]
        assembled = [g.clone() for g in grads]
        seconds = []
        for b, bucket in enumerate(self.buckets):
            before = network.clock()["comm_s"]
            mine = bucketing.flatten(grads, bucket, 0)
            n = mine.numel()
            shard = shard_numel(network, n, mine.dtype)
            contributions = self._gather(_padded(mine, R, shard), self.dp_group, R)   # [R, R * shard]
            delivered = network.reduce_scatter(f"fsdp.reduce{b}", "bwd", contributions, [r])
            owned = self._gather(delivered[0, r * shard:(r + 1) * shard], self.dp_group, R)  # the owners' shards
            owned = owned.reshape(R * shard)[:n] / self.dp_size
            self._write_back(assembled, bucket, owned)
            seconds.append(self._slowest(network.clock()["comm_s"] - before))
        with torch.no_grad():
            for k, p in enumerate(params):
                if self._master is not None:
                    p.copy_(self._master[k])
                if self._stage_of[k] == self.stage:    # another stage's parameters are not this process's
                    p.grad = assembled[k]
        self._master = None
        return [seconds]
