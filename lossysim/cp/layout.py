"""Where a context-parallel rank's tokens sit: the sequence cut into 2 x cp chunks, rank i holding chunks
i and 2cp-1-i (Megatron's and Llama 3's causal load balance: every rank holds an early and a late chunk,
so each has the same attention work).

A rank's local sequence is its two chunks one after the other; its tokens keep their global positions
(RoPE's angles, GPT-2's learned positions), so loss-free context parallelism computes what the whole
sequence does. In ``sim`` the ranks' local sequences are stacked in the batch dimension: a TP rank's
rows ``[tp, cp, batch]`` (context inside TP, as the mesh lays the axes out), each ``cp * batch`` block
one rank's; ``gather`` puts them back in sequence order.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch


def chunks(cp: int) -> int:
    """Chunks a sequence is cut into."""
    return 2 * cp


def check_length(seq: int, cp: int, name: str = "seq") -> None:
    """A one-line ValueError unless ``seq`` splits into 2 x cp equal chunks."""
    if seq % chunks(cp):
        raise ValueError(f"{name}={seq} is not a multiple of 2 x cp_size = {chunks(cp)}: context parallelism "
                         "cuts every sequence into 2 x cp_size equal chunks")


def padded(seq: int, cp: int) -> int:
    """The shortest length >= ``seq`` that splits into 2 x cp chunks (a batch cut to its longest row is
    padded on the right up to it: padding is never read by a causal model's real tokens)."""
    return -(-seq // chunks(cp)) * chunks(cp)


@functools.lru_cache(maxsize=64)
def _positions(seq: int, cp: int) -> torch.Tensor:
    size = seq // chunks(cp)
    rows = [torch.cat([torch.arange(i * size, (i + 1) * size),
                       torch.arange((chunks(cp) - 1 - i) * size, (chunks(cp) - i) * size)]) for i in range(cp)]
    return torch.stack(rows)


def positions(seq: int, cp: int, device=None) -> torch.Tensor:
    """[cp, seq / cp]: the global positions of each rank's local tokens, in local order."""
    return _positions(seq, cp).to(device)


def split(x: torch.Tensor, cp: int, ranks: list[int], groups: int) -> torch.Tensor:
    """``x`` ([groups * batch, seq, ...], every TP rank's rows of whole sequences) as context ranks
    ``ranks`` hold it: ``[groups * len(ranks) * batch, seq / cp, ...]`` (a TP rank's rows, then each
    context rank's local sequences)."""
    seq = x.shape[1]
    local = positions(seq, cp, x.device)[ranks]                     # [ranks, L]
    per = x.reshape(groups, -1, *x.shape[1:])                      # [groups, batch, seq, ...]
    held = per[:, :, local]                                         # [groups, batch, ranks, L, ...]
    return held.transpose(1, 2).reshape(-1, local.shape[1], *x.shape[2:])


def gather(local: torch.Tensor, cp: int, groups: int, seq: Optional[int] = None) -> torch.Tensor:
    """Every context rank's local rows (``[groups * cp * batch, L, ...]``, as ``split`` leaves them for all
    ranks) back in sequence order, its first ``seq`` positions (default: all ``cp * L``): ``[groups * batch,
    seq, ...]``. A permutation: its gradient goes back to each element's one owner, nothing summed."""
    L = local.shape[1]
    seq = L * cp if seq is None else seq
    per = local.reshape(groups, cp, -1, L, *local.shape[2:])           # [groups, cp, batch, L, ...]
    flat = per.transpose(1, 2).reshape(groups, -1, cp * L, *local.shape[2:])   # [groups, batch, cp*L, ...]
    order = torch.argsort(positions(L * cp, cp, local.device).reshape(-1))[:seq]  # position -> (rank, local) slot
    return flat[:, :, order].reshape(-1, seq, *local.shape[2:])
