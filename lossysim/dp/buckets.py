"""DDP's gradient buckets: which parameters' gradients travel together in one all-reduce.

PyTorch DDP fills buckets in reverse parameter order (the order backward produces gradients), closing
a bucket once it holds at least ``bucket_cap_mb`` MiB; a parameter is never split. Here every TP rank
buckets its own local tensors: its shard of a sharded parameter, its copy of a replicated one. The
shapes are the same on every TP rank, so one plan serves every data-parallel group. (DDP's smaller
first bucket, 1 MiB, and its re-bucketing by observed gradient order after the first step are not
modelled.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

MiB = 1 << 20


@dataclass(frozen=True)
class Bucket:
    """One bucket: parameter indices (in ``model.parameters()`` order), whether each is sharded (a
    leading TP rank dimension), each one's local element count, and where backward finishes it."""
    params: tuple[int, ...]
    sharded: tuple[bool, ...]
    numels: tuple[int, ...]
    ready: float            # share of the model's local bytes whose gradients exist once this bucket is full

    @property
    def numel(self) -> int:
        return sum(self.numels)


def plan_buckets(params: list[torch.Tensor], sharded_ids: set[int], cap_bytes: float,
                 chosen: Optional[Sequence[bool]] = None) -> list[Bucket]:
    """Buckets of a TP rank's local gradients, in the order backward fills them; ``chosen``: which of
    ``params`` (a pipeline stage's) they hold, indices still into ``params`` (None: all of them)."""
    local = [(i, id(p) in sharded_ids, (p[0] if id(p) in sharded_ids else p).numel(), p.element_size())
             for i, p in enumerate(params) if p.requires_grad and (chosen is None or chosen[i])]
    total = sum(n * size for _, _, n, size in local) or 1
    buckets, current, filled, done = [], [], 0, 0
    for entry in reversed(local):
        current.append(entry)
        filled += entry[2] * entry[3]
        if filled >= cap_bytes:
            done += filled
            buckets.append(_bucket(current, done / total))
            current, filled = [], 0
    if current:
        buckets.append(_bucket(current, 1.0))
    return buckets


def _bucket(entries: list, ready: float) -> Bucket:
    return Bucket(tuple(e[0] for e in entries), tuple(e[1] for e in entries), tuple(e[2] for e in entries),
                  min(ready, 1.0))


def flatten(grads: list, bucket: Bucket, tp_rank: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TP rank ``tp_rank``'s local gradients of the bucket's parameters, as one flat message (written
    into ``out`` when given)."""
    parts = [(grads[i][tp_rank] if sharded else grads[i]).reshape(-1)
             for i, sharded in zip(bucket.params, bucket.sharded)]
    return torch.cat(parts) if out is None else torch.cat(parts, out=out)


def pieces(flat: torch.Tensor, bucket: Bucket) -> list[torch.Tensor]:
    """The bucket's message (its last dimension) cut back into its parameters' local (flat) gradients."""
    return list(flat.split(list(bucket.numels), dim=-1))
