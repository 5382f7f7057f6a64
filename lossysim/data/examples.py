"""What the task is: MNLI's labels and splits, raw text examples, and how a dataset is named."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .pydoc_text import PYDOC

LABELS = ("entailment", "neutral", "contradiction")
NUM_LABELS = len(LABELS)
SPLITS = ("train", "validation_matched", "validation_mismatched")
EVAL_SPLITS = SPLITS[1:]

SYNTHETIC = "synthetic"
MNLI = "mnli"

_LABEL_IDS = {name: i for i, name in enumerate(LABELS)}
_DROPPED_LABELS = ("-", "-1")          # annotators disagreed (jsonl "-") / unlabelled (GLUE -1)


@dataclass
class Examples:
    """Raw text examples of one split (before tokenisation)."""
    premise: list[str] = field(default_factory=list)
    hypothesis: list[str] = field(default_factory=list)
    label: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.label)

    def append(self, premise: str, hypothesis: str, label: int) -> None:
        self.premise.append(premise)
        self.hypothesis.append(hypothesis)
        self.label.append(label)



def display_name(dataset: str) -> str:
    """How a dataset is named wherever results are shown: the synthetic task never passes as MNLI."""
    if dataset == SYNTHETIC:
        return "synthetic-nli (synthetic, not MNLI)"
    if dataset == MNLI:
        return "MNLI (nyu-mll/glue)"
    if dataset == PYDOC:
        return "pydoc (CPython documentation topics, causal LM)"
    return f"{dataset} (local MNLI-format files)"


# --------------------------------------------------------------------------- labels and rows

def normalize_label(value: Any) -> Optional[int]:
    """MNLI label (name, 0/1/2, "-" or -1) -> 0/1/2, or None for rows to drop.

    Raises ValueError for anything else, so a wrong column never silently becomes a label.
    """
    if isinstance(value, bool):
        raise ValueError(f"label {value!r} is not an NLI label")
    if isinstance(value, (int, np.integer)):
        if value == -1:
            return None
        if 0 <= value < NUM_LABELS:
            return int(value)
        raise ValueError(f"label {value!r} is not one of -1, 0, 1, 2")
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _DROPPED_LABELS:
            return None
        if text in _LABEL_IDS:
            return _LABEL_IDS[text]
        if text in ("0", "1", "2"):
            return int(text)
    raise ValueError(f"label {value!r} is not one of {', '.join(LABELS)}, '-' (dropped), 0, 1, 2, -1 (dropped)")



def u64(seed: int) -> int:
    """numpy seed sequences need non-negative ints; config seeds may be negative."""
    return seed % 2**64
