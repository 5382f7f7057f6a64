"""Evaluation: rank 0's loss and accuracy on an eval split, and how far the ranks drifted apart.

Every rank evaluates the whole split through the evaluation network (its own loss streams and
statistics). Per example, each rank's numbers and its pooled final hidden state cross the
reliable channel once, in one gather for the whole split, and are compared with rank 0's.
Classification and causal LM differ only in what a batch contributes (``_Task``).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from ..data import eval_batches
from ..tp.parallelize import TensorParallelModel, relative_difference


class _Task(NamedTuple):
    # (model, batch, max_length) -> (per-example stats, columns after the hidden state), each [R, B, k]
    columns: Callable
    stats: int  # how many stats columns precede the pooled hidden state in a gathered row
    # (gathered [tp, N, columns], hidden width, the split's tensors) -> loss, accuracy, disagreement
    scores: Callable


@torch.no_grad()
def evaluate(parts, split: str, config, device: torch.device) -> dict:
    """``loss`` and ``accuracy`` (rank 0's), ``disagreement`` (the worst rank's share of predictions
    that differ from rank 0's) and ``hidden_rel_diff`` (the worst rank's pooled hidden-state drift,
    see ``relative_difference``). ``parts`` is what ``lossysim.run.build`` built."""
    task = _LM if config.task == "lm" else _CLASSIFICATION
    every = _gather_split(parts, split, config, device, task)  # [tp, N, columns]
    width = parts.model.rank_hidden.shape[-1]
    hidden = every[..., task.stats:task.stats + width]
    scores = task.scores(every, width, parts.data.splits[split])
    return {**scores, "hidden_rel_diff": float(relative_difference(hidden).max())}


def _gather_split(parts, split: str, config, device: torch.device, task: _Task) -> torch.Tensor:
    model: TensorParallelModel = parts.model
    model.eval()
    rows = []
    with parts.evaluating():
        for batch in eval_batches(parts.data.splits[split], config.eval_batch_size):
            batch = {k: v.to(device) for k, v in batch.items()}
            with parts.autocast:
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            stats, after = task.columns(model, batch, config.max_length)
            pooled = _pooled_hidden(model, batch["input_ids"], parts.data.pad_token_id)
            rows.append(torch.cat([*stats, pooled, *after], dim=-1))
    every = model.group.all_gather_reliable(torch.cat(rows, 1).contiguous())
    model.train()
    return every


def _pooled_hidden(model: TensorParallelModel, input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """[R, B, hidden]: each rank's final hidden state at the token a classifier reads."""
    last = _last_token(input_ids, pad_token_id)
    hidden = model.rank_hidden.float()
    return hidden[:, torch.arange(hidden.shape[1], device=hidden.device), last]


def _last_token(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Index of the token GPT2ForSequenceClassification classifies from (rightmost non-pad)."""
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    return (positions * (input_ids != pad_token_id)).argmax(-1)


def _classification_columns(model: TensorParallelModel, batch: dict, max_length: int):
    logits = model.rank_logits.float()  # [R, B, labels]
    ranks = logits.shape[0]
    losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].repeat(ranks),
                             reduction="none").view(ranks, -1)
    return [logits.argmax(-1).float().unsqueeze(-1), losses.unsqueeze(-1)], []


def _classification_scores(every: torch.Tensor, width: int, examples: dict) -> dict:
    pred = every[..., 0].long()
    labels = examples["labels"].to(every.device)
    return {"loss": float(every[0, :, 1].mean()), "accuracy": float((pred[0] == labels).float().mean()),
            "disagreement": float((pred != pred[:1]).float().mean(-1).max())}


def _lm_columns(model: TensorParallelModel, batch: dict, max_length: int):
    """Per text: loss sum, correct and real next tokens; then every next-token prediction (-1: no token),
    padded to one width for every batch so the split's rows gather as one tensor."""
    logits = model.rank_logits[:, :, :-1].float()  # [R, B, S - 1, vocab]
    ranks = logits.shape[0]
    target = batch["input_ids"][:, 1:].expand(ranks, -1, -1)
    valid = batch["attention_mask"][:, 1:].bool().expand(ranks, -1, -1)
    losses = F.cross_entropy(logits.flatten(0, 2), target.flatten(), reduction="none").view(target.shape)
    pred = logits.argmax(-1)
    pred = F.pad(pred.masked_fill(~valid, -1).float(), (0, max_length - 1 - pred.shape[-1]), value=-1)
    stats = [(losses * valid).sum(-1, keepdim=True),
             ((pred[..., :target.shape[-1]] == target) & valid).sum(-1, keepdim=True),
             valid.sum(-1, keepdim=True)]
    return stats, [pred]


def _lm_scores(every: torch.Tensor, width: int, examples: dict) -> dict:
    """Over the split's real next tokens; ``disagreement``: the share whose prediction differs from rank 0's."""
    tokens = every[0, :, 2].sum().clamp_min(1)
    pred = every[..., 3 + width:]
    differs = ((pred != pred[:1]) & (pred[:1] >= 0)).flatten(1).sum(1).max()
    return {"loss": float(every[0, :, 0].sum() / tokens), "accuracy": float(every[0, :, 1].sum() / tokens),
            "disagreement": float(differs / tokens)}


_CLASSIFICATION = _Task(_classification_columns, 2, _classification_scores)
_LM = _Task(_lm_columns, 3, _lm_scores)
