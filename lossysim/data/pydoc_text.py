"""``dataset: pydoc``: CPython's documentation topics (``pydoc_data.topics``, in every Python) as
causal-LM text, offline.

About 465k characters of English prose and code in 79 topics. Train and evaluation are split by
topic, so no topic's text is in both (an evaluation text is never a neighbour of a training one):
topics are ordered by a hash of their name and every ``EVAL_EVERY``-th is held out. The texts are
the topics cut at line ends into pieces of about ``CHUNK_CHARS`` characters (about 150 tokens of
SmolLM2's tokenizer), each a row of the causal-LM task. The text is the running Python's, so its
hash is part of the data's identity.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

PYDOC = "pydoc"
EVAL_EVERY = 5
CHUNK_CHARS = 600


def topics() -> dict[str, str]:
    from pydoc_data.topics import topics as texts
    return dict(texts)


def split_topics() -> dict[str, list[str]]:
    """``{"train": names, "eval": names}``: every topic in exactly one, the same in every process."""
    order = sorted(topics(), key=lambda name: hashlib.blake2b(name.encode(), digest_size=8).digest())
    return {"train": sorted(n for i, n in enumerate(order) if (i + 1) % EVAL_EVERY),
            "eval": sorted(n for i, n in enumerate(order) if (i + 1) % EVAL_EVERY == 0)}


def chunks(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """``text`` cut at line ends into pieces of at least ``size`` characters (the last may be
    shorter); blank-only pieces are dropped. Joined with newlines they give the text back."""
    out, lines, length = [], [], -1  # length: of the lines joined by newlines
    for line in text.split("\n"):
        lines.append(line)
        length += len(line) + 1
        if length >= size:
            out.append("\n".join(lines))
            lines, length = [], -1
    if lines:
        out.append("\n".join(lines))
    return [piece for piece in out if piece.strip()]


def texts(split: str) -> list[str]:
    """The pieces of every topic of ``split`` ("train" or "eval"), topic by topic in name order."""
    every = topics()
    return [piece for name in split_topics()[split] for piece in chunks(every[name])]


def identity() -> dict:
    """What the data cache's key needs: the split rule and the text itself (it changes with Python)."""
    digest = hashlib.sha256()
    for name, text in sorted(topics().items()):
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    return {"kind": PYDOC, "sha256": digest.hexdigest(), "eval_every": EVAL_EVERY, "chunk_chars": CHUNK_CHARS}


class TextRows:
    """Texts as rows of the runner's sources: (text, "", 0). The pipeline encodes rows as pairs, so
    each text is followed by the pair separator (a newline); the label is unused by the causal LM."""

    def __init__(self, pieces: Sequence[str]):
        self.pieces = list(pieces)

    def __len__(self) -> int:
        return len(self.pieces)

    def rows(self, indices: Sequence[int]) -> list:
        return [(self.pieces[int(i)], "", 0) for i in indices]

    def close(self) -> None:
        pass
