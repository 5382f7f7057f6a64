"""Tokenizers (a BPE trained here, bytes, or a pretrained one by name or directory) and pair encoding."""
from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..hub import hub_reachable, why_unavailable
from ..models.pretrained import resolve
from ..models.upcycle import base
from ..models.shapes import NAMED_SHAPES
from .examples import Examples


BPE_VOCAB_SIZE = 8192
PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
# Premise and hypothesis are encoded as a pair; the hypothesis starts on a new line. The separator
# sits at the start of the hypothesis so truncating a long premise never removes it.
HYPOTHESIS_PREFIX = "\n"
TOKENIZE_BATCH = 8192


def tokenizer_spec(config) -> str:
    """Resolve ``tokenizer: auto``: the model's own tokenizer for a HF model, else a trained BPE."""
    if config.tokenizer == "auto":
        return "bpe" if base(config.model) in NAMED_SHAPES else base(config.model)
    return config.tokenizer


def tokenizer_identity(spec: str) -> dict:
    """What the cache key needs to know about the tokenizer, without building it."""
    import tokenizers
    if spec == "bpe":
        return {"kind": "bpe", "vocab_size": BPE_VOCAB_SIZE, "tokenizers": tokenizers.__version__}
    if spec == "bytes":
        return {"kind": "bytes"}
    path = Path(resolve(spec)).expanduser()
    if path.is_dir():
        digest = hashlib.sha256()
        for file in sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".txt", ".model", ".tiktoken", ".vocab")):
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
        return {"kind": "dir", "path": str(path.resolve()), "sha256": digest.hexdigest()}
    return {"kind": "hub", "name": spec}


def _wrap(backend, **specials):
    """A tokenizers.Tokenizer as a transformers fast tokenizer; special tokens never parsed from text."""
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="right",
                                   split_special_tokens=True, model_max_length=int(1e9), **specials)


def train_bpe(texts: Sequence[str], vocab_size: int = BPE_VOCAB_SIZE):
    """Byte-level BPE trained on ``texts`` (well under a second for a few MB), pad token included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[PAD_TOKEN, EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer=trainer)
    return _wrap(backend, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN)


def byte_tokenizer():
    """One token per UTF-8 byte (id = byte value), pad = 256: no training, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([PAD_TOKEN])
    return _wrap(backend, pad_token=PAD_TOKEN)


def load_pretrained_tokenizer(spec: str):
    """A HF tokenizer by name, local dir or packaged model, with a pad token that no text uses."""
    spec = resolve(spec)
    if not Path(spec).expanduser().is_dir():
        hub_reachable()   # once per process: offline mode if not, so the load fails at once
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec)
    except Exception as err:  # OSError offline, EnvironmentError/ValueError for bad dirs
        why = "" if Path(spec).expanduser().is_dir() or not why_unavailable() else f"{why_unavailable()}; "
        raise ValueError(f"tokenizer {spec!r} could not be loaded ({why}{type(err).__name__}: {_first_line(err)}). "
                         f"{_TOKENIZER_ADVICE}") from None
    check_vocabulary(tokenizer, spec)
    tokenizer.padding_side = "right"
    tokenizer.split_special_tokens = True
    if tokenizer.pad_token_id is None:
        _set_pad(tokenizer)
    return tokenizer


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


_TOKENIZER_ADVICE = ("Use tokenizer: bpe (trained here on the training texts, no download), a local directory "
                     "holding the tokenizer files, or go online once so the tokenizer is cached.")


def check_vocabulary(tokenizer, spec: str) -> None:
    """Reject an empty vocabulary: transformers returns one WITHOUT raising when, for example,
    GPT2Tokenizer.from_pretrained('gpt2') cannot reach the hub; it would make every text empty."""
    specials = set(tokenizer.all_special_tokens)
    if not [token for token in tokenizer.get_vocab() if token not in specials]:
        raise ValueError(f"tokenizer {spec!r} has an empty vocabulary (what transformers returns when the hub "
                         f"is unreachable or the files are missing). {_TOKENIZER_ADVICE}")


def _set_pad(tokenizer) -> None:
    """Pad with EOS when the tokenizer never puts EOS into an encoded text, else add a new token.

    Reusing EOS keeps the vocabulary (and a pretrained model's embedding) unchanged.
    """
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in tokenizer("a", "b")["input_ids"]:
        tokenizer.pad_token = tokenizer.eos_token
    else:
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})


def build_tokenizer(spec: str, train_texts: Sequence[str]):
    if spec == "bpe":
        return train_bpe(train_texts)
    if spec == "bytes":
        return byte_tokenizer()
    return load_pretrained_tokenizer(spec)


# --------------------------------------------------------------------------- tokenisation

def tokenize_examples(tokenizer, examples: Examples, max_length: int) -> dict[str, torch.Tensor]:
    """Batched pair encoding, long premises cut first, right-padded to the longest row.

    Rows are padded to the split's longest encoded row, not to ``max_length``: storage (and,
    through ``pad_to_longest``, every batch) follows the real lengths, so a generous
    ``max_length`` costs nothing on short texts.
    """
    rows: list[list[int]] = []
    for start in range(0, len(examples), TOKENIZE_BATCH):
        stop = start + TOKENIZE_BATCH
        encoded = tokenizer(examples.premise[start:stop],
                            [HYPOTHESIS_PREFIX + h for h in examples.hypothesis[start:stop]],
                            truncation="longest_first", max_length=max_length, padding=False,
                            return_attention_mask=False)
        rows.extend(encoded["input_ids"])
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    width = max(int(lengths.max()) if len(rows) else 0, 1)
    mask = np.arange(width) < lengths[:, None]
    ids = np.full((len(rows), width), tokenizer.pad_token_id, dtype=np.int64)
    # numpy fills the ragged rows in one go (row-major order matches the concatenated rows)
    ids[mask] = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    tensors = {"input_ids": torch.from_numpy(ids),
               "attention_mask": torch.from_numpy(mask.astype(np.int64)),
               "labels": torch.tensor(examples.label, dtype=torch.long)}
    _check_padding(tensors, tokenizer.pad_token_id)
    return tensors


def _check_padding(tensors: dict[str, torch.Tensor], pad_id: int) -> None:
    """The classifier reads the last non-pad token: pad inside a text or left padding would break it."""
    ids, mask = tensors["input_ids"], tensors["attention_mask"].bool()
    if (ids[mask] == pad_id).any():
        raise ValueError(f"pad token id {pad_id} occurs inside encoded texts; choose a tokenizer whose pad token is unused")
    if (ids[~mask] != pad_id).any() or (mask[:, 1:] & ~mask[:, :-1]).any():
        raise ValueError("expected right padding with the pad token")
    if not mask.any(dim=1).all():
        raise ValueError("some examples encode to no tokens (is the tokenizer vocabulary empty?)")
