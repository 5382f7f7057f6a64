"""GPT-2 sequence classifiers: named random-weight shapes or pretrained weights by name or path."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from transformers import GPT2Config, GPT2ForSequenceClassification

# Random-weight shapes: `tiny` for CPU tests and demos, `small` = GPT-2 124M.
NAMED_SHAPES = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=128),
    "small": dict(n_layer=12, n_head=12, n_embd=768),
}


# Named shapes size their position table to max_length, up to GPT-2's own 1024 positions.
NAMED_MAX_POSITIONS = 1024


def is_pretrained(name: str) -> bool:
    return name not in NAMED_SHAPES


def max_positions(name: str) -> Optional[int]:
    """How many positions model ``name`` can embed (n_positions / max_position_embeddings), read
    from its config alone; None when the config cannot be read here (build_model checks later)."""
    if not is_pretrained(name):
        return NAMED_MAX_POSITIONS
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(name)
    except Exception:  # offline and not cached, not a model directory: build_model says why
        return None
    value = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    return int(value) if value else None


def check_max_length(name: str, max_length: int) -> None:
    """Refuse, before any data is tokenised, a max_length the model has no positions for."""
    limit = max_positions(name)
    if limit is not None and max_length > limit:
        raise ValueError(f"max_length={max_length} exceeds model {name!r}'s {limit} positions "
                         f"(n_positions); use max_length <= {limit}")


def build_model(name: str, *, vocab_size: int, pad_token_id: int, num_labels: int, max_length: int,
                attn_implementation: str = "sdpa", dropout: Optional[float] = None,
                seed: int = 0) -> GPT2ForSequenceClassification:
    """A GPT2ForSequenceClassification: random weights for a named shape, else from_pretrained."""
    torch.manual_seed(seed)
    overrides = {} if dropout is None else dict(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    if not is_pretrained(name):
        config = GPT2Config(**NAMED_SHAPES[name], vocab_size=vocab_size, n_positions=max(max_length, 64),
                            num_labels=num_labels, pad_token_id=pad_token_id, bos_token_id=pad_token_id,
                            eos_token_id=pad_token_id, **overrides)
        config._attn_implementation = attn_implementation
        return GPT2ForSequenceClassification(config)
    try:
        model = GPT2ForSequenceClassification.from_pretrained(
            name, num_labels=num_labels, attn_implementation=attn_implementation, **overrides)
    except (OSError, ValueError) as err:
        where = "local directory" if Path(name).exists() else "model name"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"cannot load model {name!r} ({where}): {first}. Use a named shape "
                         f"({', '.join(NAMED_SHAPES)}), a local directory, or go online "
                         "(unset HF_HUB_OFFLINE)") from None
    if model.config.n_positions < max_length:
        raise ValueError(f"max_length={max_length} exceeds model {name!r}'s {model.config.n_positions} positions "
                         f"(n_positions); use max_length <= {model.config.n_positions}")
    if vocab_size > model.config.vocab_size:
        model.resize_token_embeddings(vocab_size)
    model.config.pad_token_id = pad_token_id
    return model
