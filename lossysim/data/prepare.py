"""Data for the experiment runner: MNLI (hub or local files) or an embedded synthetic NLI task.

Pipeline, the same for every source: load rows -> drop unlabelled rows -> cap (seeded shuffle,
then select) -> tokenise in batches -> cache on disk with the tokenizer. Capping happens on
raw rows, before any tokenisation, so a small cap costs little even on a 400k-line file.

Only the main process (rank 0) loads and tokenises; other ranks wait at a barrier and read the
cache, so every rank gets bit-identical tensors and nobody loads the whole dataset twice.

Labels follow GLUE MNLI: 0 entailment, 1 neutral, 2 contradiction.
"""
from __future__ import annotations
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

from .examples import EVAL_SPLITS, LABELS, NUM_LABELS, SPLITS, display_name
from .sources import split_caps, dataset_identity, load_examples
from .tokenizers import HYPOTHESIS_PREFIX, build_tokenizer, tokenize_examples, tokenizer_identity, tokenizer_spec

log = logging.getLogger(__name__)

CACHE_FORMAT = 3                       # bump when the cached content changes meaning


@dataclass
class PreparedData:
    """Tokenised splits, each ``{"input_ids", "attention_mask", "labels"}`` of long tensors.

    ``input_ids`` and ``attention_mask`` are [N, W], W the split's longest row (at most
    max_length), right-padded with ``pad_token_id`` (never used inside a text, so
    GPT2ForSequenceClassification finds the last real token). Batches are cut narrower still,
    to their own longest row (``pad_to_longest``).
    ``info`` records what was built (sizes, label counts, dataset and tokenizer identity).
    """
    name: str
    tokenizer: Any
    splits: dict[str, dict[str, torch.Tensor]]
    pad_token_id: int
    vocab_size: int
    num_labels: int = NUM_LABELS
    cache_path: Optional[Path] = None
    info: dict = field(default_factory=dict)

    @property
    def eval_splits(self) -> tuple[str, ...]:
        """The evaluation splits worth evaluating: one held-out set serving both (a single local file,
        ``pydoc``) is evaluated once, under the first split's name."""
        out = []
        for split in EVAL_SPLITS:
            ids = self.splits[split]["input_ids"]
            if not any(ids.shape == self.splits[seen]["input_ids"].shape
                       and torch.equal(ids, self.splits[seen]["input_ids"]) for seen in out):
                out.append(split)
        return tuple(out)


def cache_key(config) -> str:
    """Hash of everything the tensors depend on: data identity, caps, seed, tokenizer, length."""
    parts = {"format": CACHE_FORMAT, "dataset": dataset_identity(config.dataset),
             "caps": split_caps(config), "seed": config.seed,
             "tokenizer": tokenizer_identity(tokenizer_spec(config)), "max_length": config.max_length,
             "hypothesis_prefix": HYPOTHESIS_PREFIX}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def cache_path(config, cache_dir: Union[str, Path]) -> Path:
    return Path(cache_dir) / f"data-{cache_key(config)}"


def _write_cache(path: Path, tokenizer, splits: dict, info: dict) -> None:
    """Write into a temporary directory, then rename: readers see all of it or nothing."""
    from safetensors.torch import save_file
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        # compact on disk (ids fit int32, mask fits uint8); widened to long on load
        flat = {}
        for split, tensors in splits.items():
            flat[f"{split}.input_ids"] = tensors["input_ids"].to(torch.int32).contiguous()
            flat[f"{split}.attention_mask"] = tensors["attention_mask"].to(torch.uint8).contiguous()
            flat[f"{split}.labels"] = tensors["labels"].contiguous()
        save_file(flat, str(tmp / "tensors.safetensors"))
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        (tmp / "info.json").write_text(json.dumps(info, indent=2) + "\n")
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "info.json").exists():
                raise
            log.info("data cache %s was written meanwhile by another process", path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_cached(path: Union[str, Path]) -> PreparedData:
    """Read a prepared cache directory (tensors, tokenizer, info)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer
    path = Path(path)
    if not (path / "info.json").is_file():
        raise ValueError(f"no prepared data at {path}")
    info = json.loads((path / "info.json").read_text())
    flat = load_file(str(path / "tensors.safetensors"))
    splits = {split: {key: flat[f"{split}.{key}"].long() for key in ("input_ids", "attention_mask", "labels")}
              for split in SPLITS}
    tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"))
    if tokenizer.pad_token_id != info["pad_token_id"] or len(tokenizer) != info["vocab_size"]:
        raise ValueError(f"data cache {path} is inconsistent (tokenizer differs from info.json); delete it")
    return PreparedData(name=info["name"], tokenizer=tokenizer, splits=splits, pad_token_id=info["pad_token_id"],
                        vocab_size=info["vocab_size"], cache_path=path, info=info)


def build(config) -> tuple[Any, dict, dict]:
    """Load, cap and tokenise (no cache): (tokenizer, splits, info)."""
    examples = load_examples(config)
    spec = tokenizer_spec(config)
    train = examples["train"]
    tokenizer = build_tokenizer(spec, [text for pair in zip(train.premise, train.hypothesis) for text in pair])
    splits = {split: tokenize_examples(tokenizer, examples[split], config.max_length) for split in SPLITS}
    info = {"name": display_name(config.dataset), "dataset": config.dataset, "tokenizer": spec,
            "pad_token_id": tokenizer.pad_token_id, "vocab_size": len(tokenizer),
            "max_length": config.max_length, "seed": config.seed, "caps": split_caps(config),
            "sizes": {s: len(examples[s]) for s in SPLITS},
            "label_counts": {s: np.bincount(examples[s].label, minlength=NUM_LABELS).tolist() for s in SPLITS},
            # rows that fill max_length (truncated, or exactly fitting): many -> raise max_length
            "at_max_length": {s: int((splits[s]["attention_mask"].sum(1) >= config.max_length).sum())
                              for s in SPLITS},
            "mean_tokens": {s: float(splits[s]["attention_mask"].sum(1).float().mean()) if len(examples[s])
                            else 0.0 for s in SPLITS},
            "labels": list(LABELS)}
    return tokenizer, splits, info


def prepare_data(config, cache_dir: Union[str, Path], *, is_main: bool = True,
                 barrier: Optional[Callable[[], None]] = None) -> PreparedData:
    """Tokenised, capped splits for ``config``, built once and cached under ``cache_dir``.

    The main process builds the cache if it is missing; every process (main included) then
    calls ``barrier`` (if given) and reads the same cache, so all ranks hold identical tensors.
    If the main process fails it still enters the barrier, so the others fail fast too.
    """
    path = cache_path(config, cache_dir)
    if is_main and not (path / "info.json").is_file():
        try:
            log.info("preparing %s -> %s", display_name(config.dataset), path)
            tokenizer, splits, info = build(config)
            info["cache_key"] = path.name
            _write_cache(path, tokenizer, splits, info)
        except BaseException:
            if barrier is not None:
                barrier()
            raise
    if barrier is not None:
        barrier()
    if not (path / "info.json").is_file():
        raise ValueError(f"no prepared data at {path}: the main process (rank 0) must prepare it first "
                         f"(did it fail? see its log; is cache_dir shared by all ranks?)")
    return load_cached(path)
