"""Batches: seeded epochs that resume at any step, each batch cut to its longest row."""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from .examples import u64
from .prepare import PreparedData


def _split_of(data) -> dict[str, torch.Tensor]:
    return data.splits["train"] if isinstance(data, PreparedData) else data


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation of epoch ``epoch``: a function of (seed, epoch) only, so any step can be resumed."""
    return torch.from_numpy(np.random.default_rng([u64(seed), epoch, 0x7B]).permutation(n))


def train_batches(data, batch_size: int, seed: int, start_step: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Training batches forever, always ``batch_size`` rows, reshuffled every epoch, each as wide
    as its longest row (``pad_to_longest``).

    Step s takes positions [s*B, (s+1)*B) of the endless sequence epoch_order(0), epoch_order(1),
    ... (a batch may straddle two epochs), so starting at ``start_step`` yields exactly what an
    uninterrupted run yields from that step on. ``data``: PreparedData or a split dict.
    """
    split = _split_of(data)
    n = len(split["labels"])
    if n == 0 or batch_size < 1:
        raise ValueError(f"train_batches needs examples and batch_size >= 1 (got {n}, {batch_size})")
    epoch, offset = divmod(start_step * batch_size, n)
    order = epoch_order(n, seed, epoch)
    while True:
        parts, need = [], batch_size
        while need:
            if offset == n:
                epoch, offset = epoch + 1, 0
                order = epoch_order(n, seed, epoch)
            take = min(need, n - offset)
            parts.append(order[offset:offset + take])
            offset, need = offset + take, need - take
        index = torch.cat(parts)
        yield pad_to_longest({key: tensor[index] for key, tensor in split.items()})


def eval_batches(split_tensors: dict[str, torch.Tensor], batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive batches over a whole split, in order (the last may be smaller), each as wide as
    its longest row."""
    n = len(split_tensors["labels"])
    for start in range(0, n, batch_size):
        yield pad_to_longest({key: tensor[start:start + batch_size] for key, tensor in split_tensors.items()})


def pad_to_longest(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Cut a right-padded batch to its longest row (HF DataCollatorWithPadding's convention):
    a step costs what its texts hold, not max_length.

    Causal attention and the last-token classifier never look at right padding, so without
    loss the cut changes no prediction (up to float rounding); under loss, packets carry only
    real tokens' values, none are spent on padding.
    """
    width = max(int(batch["attention_mask"].sum(1).max()) if len(batch["labels"]) else 1, 1)
    return {key: tensor[:, :width].contiguous() if tensor.dim() == 2 else tensor for key, tensor in batch.items()}
