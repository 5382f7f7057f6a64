"""The collectives the transport gave up on in a whole job: every training network's, not replica 0's alone.

Any failed collective aborts the job, whichever group ran it, so a run counts the failures of every
network it trains over: every replica's TP groups (each stage's and boundary's), the data-parallel groups'
(DDP's buckets, FSDP's gathers and reduce-scatters), the expert groups' all-to-alls and their averaging, the
context groups' exchanges. The estimate counts the same (``estimate.accounting.Tally.count``: every class,
every group it stands for), so ``failures`` and ``failures_per_1000_steps`` are one count.

A network is known by its streams' seed (``Mesh.network_spec``: each group's own): ``dist`` holds some
networks on several processes (a group's members draw the same packets) and others as mirrors of their
owners', so the processes' counts are gathered and each seed counted once, at the largest count any
process holds for it (a mirror never runs ahead of its owner). ``sim`` holds every network once.
"""
from __future__ import annotations

from ..net import LossyNetwork


def _replica_networks(replica) -> list[LossyNetwork]:
    """One replica's TP groups (each stage's, each boundary's, every context rank's) and context groups."""
    pipeline, model = replica.pipeline, replica.model
    if pipeline is None:
        out = [model.network]
    else:
        out = [*pipeline.networks, *(n for b in pipeline.boundaries for n in (b.network, *b.contexts))]
    context = getattr(model, "context", None)
    return out + (context.train_networks.all() if context is not None else [])


def networks(parts) -> list[LossyNetwork]:
    """Every training network this process holds, each once (eval networks are not the job's steps)."""
    found = [n for replica in parts.dp.replicas for n in _replica_networks(replica)]
    found += parts.dp.networks
    if parts.ep is not None:
        found += parts.ep.networks() + [n for edp in parts.ep.edp for n in edp.networks]
    return list({id(n): n for n in found}.values())


def by_seed(parts) -> dict:
    """This process's networks' failures, by their streams' seed."""
    out: dict = {}
    for network in networks(parts):
        key = network.spec.seed
        out[key] = max(out.get(key, 0), int(network.totals()["failures"]))
    return out


def count(parts, config) -> int:
    """The job's failed collectives so far (every rank calls it at the same points on ``dist``)."""
    counts = by_seed(parts)
    if config.backend == "dist":
        import torch.distributed as dist
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, counts)
        counts = {}
        for part in every:
            for key, value in part.items():
                counts[key] = max(counts.get(key, 0), value)
    return sum(counts.values())
