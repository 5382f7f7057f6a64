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
import itertools
import json
import logging
import mmap
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

log = logging.getLogger(__name__)

LABELS = ("entailment", "neutral", "contradiction")
NUM_LABELS = len(LABELS)
SPLITS = ("train", "validation_matched", "validation_mismatched")
EVAL_SPLITS = SPLITS[1:]

SYNTHETIC = "synthetic"
MNLI = "mnli"
HF_MNLI = ("nyu-mll/glue", "mnli")
# models built from a config, with no tokenizer of their own (lossysim.models.NAMED_SHAPES)
BUILTIN_MODELS = ("tiny", "small", "tiny-llama", "llama-1b-shape")

# Local file sets, one per format: split -> file name. A directory must hold one complete set.
FILE_SETS = {
    "jsonl": {"train": "multinli_1.0_train.jsonl",
              "validation_matched": "multinli_1.0_dev_matched.jsonl",
              "validation_mismatched": "multinli_1.0_dev_mismatched.jsonl"},
    "tsv": {"train": "train.tsv",
            "validation_matched": "dev_matched.tsv",
            "validation_mismatched": "dev_mismatched.tsv"},
}
# Accepted column names, first match wins (MNLI jsonl / GLUE tsv names, then HF names).
PREMISE_KEYS = ("sentence1", "premise")
HYPOTHESIS_KEYS = ("sentence2", "hypothesis")
LABEL_KEYS = ("gold_label", "label")
# A single file is split: every HOLDOUT_EVERY-th data row (the 10th, 20th, ...) is held out for
# evaluation (both validation splits), the rest is train. Seed-independent, so runs with different
# seeds are evaluated on the same pool.
HOLDOUT_EVERY = 10

BPE_VOCAB_SIZE = 8192
PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
# Premise and hypothesis are encoded as a pair; the hypothesis starts on a new line. The separator
# sits at the start of the hypothesis so truncating a long premise never removes it.
HYPOTHESIS_PREFIX = "\n"
TOKENIZE_BATCH = 8192
CACHE_FORMAT = 3                       # bump when the cached content changes meaning

_LABEL_IDS = {name: i for i, name in enumerate(LABELS)}
_DROPPED_LABELS = ("-", "-1")          # annotators disagreed (jsonl "-") / unlabelled (GLUE -1)


# --------------------------------------------------------------------------- public types

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


def display_name(dataset: str) -> str:
    """How a dataset is named wherever results are shown: the synthetic task never passes as MNLI."""
    if dataset == SYNTHETIC:
        return "synthetic-nli (synthetic, not MNLI)"
    if dataset == MNLI:
        return "MNLI (nyu-mll/glue)"
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


def _first_key(keys: Sequence[str], available) -> Optional[str]:
    return next((k for k in keys if k in available), None)


class _LineFile:
    """Random access to the lines of a jsonl or tsv file without parsing them all.

    Line boundaries are found with numpy on a memory map (C speed); a line is decoded and
    parsed only when a row is asked for, so capping a 400k-line file parses only the rows kept.
    """

    def __init__(self, path: Path, fmt: str):
        self.path, self.fmt = path, fmt
        if not path.is_file():
            raise ValueError(f"{path}: file not found")
        self._file = open(path, "rb")
        size = os.fstat(self._file.fileno()).st_size
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        starts, ends = _line_bounds(self._map, size)
        keep = ends > starts                      # blank lines are not rows
        self._starts, self._ends = starts[keep], ends[keep]
        self._linenos = np.flatnonzero(keep) + 1  # 1-based line numbers for error messages
        self._columns = None
        if fmt == "tsv":
            self._read_header()

    def _read_header(self) -> None:
        if not len(self._starts):
            raise ValueError(f"{self.path}: empty file (expected a header line)")
        header = self._line(0).rstrip("\r").split("\t")
        found = [_first_key(keys, header) for keys in (PREMISE_KEYS, HYPOTHESIS_KEYS, LABEL_KEYS)]
        if None in found:
            missing = [keys for keys, got in zip((PREMISE_KEYS, HYPOTHESIS_KEYS, LABEL_KEYS), found) if got is None]
            raise ValueError(f"{self.path} line {self._linenos[0]}: header lacks a column named "
                             + " and ".join(" or ".join(k) for k in missing))
        self._columns = [header.index(name) for name in found]
        self._starts, self._ends, self._linenos = self._starts[1:], self._ends[1:], self._linenos[1:]

    def __len__(self) -> int:
        return len(self._starts)

    def _line(self, i: int) -> str:
        raw = self._map[self._starts[i]:self._ends[i]]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{self.path} line {self._linenos[i]}: not UTF-8 ({err.reason})") from None

    def rows(self, indices: Sequence[int]) -> list:
        return [self._row(int(i)) for i in indices]

    def _row(self, i: int):
        """(premise, hypothesis, label) or None for a dropped row; ValueError names file and line."""
        line = self._line(i).rstrip("\r")
        if not line.strip():
            return None
        try:
            return self._parse_tsv(line) if self.fmt == "tsv" else self._parse_jsonl(line)
        except ValueError as err:
            raise ValueError(f"{self.path} line {self._linenos[i]}: {err}") from None

    def _parse_jsonl(self, line: str):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"malformed JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(record, dict):
            raise ValueError(f"expected a JSON object, got {type(record).__name__}")
        keys = [_first_key(k, record) for k in (PREMISE_KEYS, HYPOTHESIS_KEYS, LABEL_KEYS)]
        for key, names in zip(keys, (PREMISE_KEYS, HYPOTHESIS_KEYS, LABEL_KEYS)):
            if key is None:
                raise ValueError(f"missing field {' or '.join(names)}")
        premise, hypothesis, label = (record[k] for k in keys)
        return _checked_row(premise, hypothesis, label)

    def _parse_tsv(self, line: str):
        cells = line.split("\t")
        needed = max(self._columns) + 1
        if len(cells) < needed:
            raise ValueError(f"expected at least {needed} tab-separated columns, found {len(cells)}")
        return _checked_row(*(cells[c] for c in self._columns))

    def close(self) -> None:
        if isinstance(self._map, mmap.mmap):
            self._map.close()
        self._file.close()


def _line_bounds(buffer, size: int, chunk: int = 1 << 26) -> tuple[np.ndarray, np.ndarray]:
    """Start and end offsets of every line (without its newline), chunked to bound memory."""
    newlines = [np.flatnonzero(np.frombuffer(buffer, np.uint8, min(chunk, size - at), at) == 10) + at
                for at in range(0, size, chunk)]
    newlines = np.concatenate(newlines) if newlines else np.zeros(0, np.int64)
    starts = np.concatenate([[0], newlines + 1]).astype(np.int64)
    ends = np.concatenate([newlines, [size]]).astype(np.int64)
    return starts, ends


def _checked_row(premise: Any, hypothesis: Any, label: Any):
    if not isinstance(premise, str) or not isinstance(hypothesis, str):
        raise ValueError("sentence1/sentence2 must be strings")
    label = normalize_label(label)
    return None if label is None else (premise, hypothesis, label)


class _ArrowRows:
    """Rows of a Hugging Face ``datasets`` split (premise, hypothesis, label columns)."""

    def __init__(self, dataset, name: str):
        self.dataset, self.name = dataset, name
        columns = dataset.column_names
        self._keys = [_first_key(k, columns) for k in (PREMISE_KEYS, HYPOTHESIS_KEYS, LABEL_KEYS)]
        if None in self._keys:
            raise ValueError(f"{name}: expected columns premise, hypothesis, label; found {columns}")

    def __len__(self) -> int:
        return len(self.dataset)

    def rows(self, indices: Sequence[int]) -> list:
        batch = self.dataset[[int(i) for i in indices]]
        try:
            return [_checked_row(p, h, y) for p, h, y in zip(*(batch[k] for k in self._keys))]
        except ValueError as err:
            raise ValueError(f"{self.name}: {err}") from None

    def close(self) -> None:
        pass


class _Subset:
    """A view of some rows of another source (single-file train / held-out split)."""

    def __init__(self, source, indices: np.ndarray):
        self.source, self.indices = source, indices

    def __len__(self) -> int:
        return len(self.indices)

    def rows(self, indices: Sequence[int]) -> list:
        return self.source.rows(self.indices[np.asarray(indices, dtype=np.int64)])

    def close(self) -> None:
        pass


def select_examples(source, cap: Optional[int], seed: int, stream: int) -> Examples:
    """Drop unlabelled rows, then keep ``cap`` rows of a shuffle seeded by (seed, stream).

    Equivalent to "filter, shuffle, take cap" but reads only the rows it keeps (plus the dropped
    ones met on the way), so the cost follows the cap. ``cap=None`` keeps every row in order.
    The same (seed, stream) always selects the same rows.
    """
    n = len(source)
    order = np.arange(n) if cap is None else np.random.default_rng([_u64(seed), stream]).permutation(n)
    out, pos = Examples(), 0
    while pos < n and (cap is None or len(out) < cap):
        take = n if cap is None else cap - len(out)   # exactly the rows still needed
        for row in source.rows(order[pos:pos + take]):
            if row is not None:
                out.append(*row)
        pos += take
    return out


def _u64(seed: int) -> int:
    """numpy seed sequences need non-negative ints; config seeds may be negative."""
    return seed % 2**64


# --------------------------------------------------------------------------- synthetic NLI

SYNTHETIC_VERSION = 2                  # part of the cache key and of the generator seed
SYNTHETIC_SIZES = {"train": 50_000, "validation_matched": 5_000, "validation_mismatched": 5_000}
# The task: quantities. The premise gives a count with a tolerance ("Alice has about five books."),
# the hypothesis a lower bound ("Alice has more than 3 books."). Entailment: every count the
# premise allows satisfies the hypothesis; contradiction: none does; neutral: some do, some not.
# The label depends on both sides (premise-only or hypothesis-only guessing tops out near 60%,
# see synthetic_cue_accuracy) yet is a threshold of an additive score (count - bound -/+
# tolerance), which a 2-layer GPT-2 learns in a few hundred steps. Tasks needing exact token
# matching (is the hypothesis's place the premise's place?) stalled at chance for that long.
# Premise counts are words, hypothesis bounds digits: the roles are told by the tokens.
_SYN_TOLERANCE = {"exactly": 0, "about": 1, "roughly": 2}      # premise: count within +-tolerance
_SYN_BOUNDS = {"more than": 0, "at least": 1}                  # hypothesis: count > bound - shift
_SYN_COUNT_WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                    "eleven", "twelve")
_SYN_COUNTS = range(1, 13)             # premise counts (as words) and hypothesis bounds (as digits)
_SYN_NAMES = ("Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy",
              "Ken", "Laura", "Mike", "Nina", "Oscar", "Peggy", "Quinn", "Rosa", "Sam", "Tina")
_SYN_THINGS = ("book", "apple", "coin", "cat", "pen", "shirt", "ticket", "stamp", "cup", "key", "map", "lamp")
_SYN_PLACES = ("kitchen", "garden", "library", "office", "museum", "school", "bakery", "garage")
# Like MNLI's genres: train and matched share sentence frames, mismatched premises use other
# frames around the same phrases (same vocabulary, different layout).
# Four training frames (not one) so the model finds the count by its words, not its position.
_SYN_TRAIN_FRAMES = ("{a} has {tol} {n} {t}.", "In the {p}, {a} keeps {tol} {n} {t}.",
                     "{a} stores {tol} {n} {t} at the {p}.", "At home {a} has {tol} {n} {t} in the {p}.")
_SYN_PREMISES = {
    "train": _SYN_TRAIN_FRAMES,
    "validation_matched": _SYN_TRAIN_FRAMES,
    "validation_mismatched": ("{a} keeps {tol} {n} {t} in the {p}.", "{a}'s {p} holds {tol} {n} {t}."),
}
_SYN_HYPOTHESES = ("{a} has {rel} {m} {t}.", "{a} owns {rel} {m} {t}.")


def _nli_label(count: int, tolerance: int, bound: int, shift: int) -> int:
    """Premise allows [count - tol, count + tol]; hypothesis claims > bound - shift."""
    low, high, threshold = count - tolerance, count + tolerance, bound - shift
    return 0 if low > threshold else 2 if high <= threshold else 1


def _synthetic_cases() -> list[list[tuple]]:
    """Every (tolerance word, count, bound phrase, bound), grouped by label (sample label first)."""
    by_label = [[], [], []]
    for tol, tolerance in _SYN_TOLERANCE.items():
        for rel, shift in _SYN_BOUNDS.items():
            for count in _SYN_COUNTS:
                for bound in _SYN_COUNTS:
                    by_label[_nli_label(count, tolerance, bound, shift)].append((tol, count, rel, bound))
    return by_label


def synthetic_cue_accuracy() -> dict[str, float]:
    """Best accuracy from the premise alone / the hypothesis alone (Bayes, exact): the task's floor
    for "did not compare the two"."""
    by_label = _synthetic_cases()
    def best(side) -> float:
        mass: dict = {}
        for label, cases in enumerate(by_label):
            for case in cases:
                key = side(case)
                mass.setdefault(key, [0.0] * NUM_LABELS)[label] += 1 / (NUM_LABELS * len(cases))
        return sum(max(v) for v in mass.values())
    return {"premise_only": best(lambda c: c[:2]), "hypothesis_only": best(lambda c: c[2:])}


def _plural(thing: str, count: int) -> str:
    return thing if count == 1 else thing + "s"


def synthetic_examples(split: str, n: int, seed: int) -> Examples:
    """``n`` examples of the synthetic NLI task, a pure function of (split, n, seed).

    Labels cycle 0, 1, 2 so any prefix is balanced; a larger ``n`` extends a smaller one.
    """
    rng = random.Random(f"lossysim-synthetic-nli/v{SYNTHETIC_VERSION}/{seed}/{split}")
    by_label = _synthetic_cases()
    out = Examples()
    for i in range(n):
        label = i % NUM_LABELS
        tol, count, rel, bound = rng.choice(by_label[label])
        slots = dict(a=rng.choice(_SYN_NAMES), t=rng.choice(_SYN_THINGS), p=rng.choice(_SYN_PLACES))
        thing = slots.pop("t")
        premise = rng.choice(_SYN_PREMISES[split]).format(tol=tol, n=_SYN_COUNT_WORDS[count - 1],
                                                          t=_plural(thing, count), **slots)
        hypothesis = rng.choice(_SYN_HYPOTHESES).format(rel=rel, m=bound, t=_plural(thing, bound), **slots)
        out.append(premise, hypothesis, label)
    return out


# --------------------------------------------------------------------------- loading

def _caps(config) -> dict[str, Optional[int]]:
    return {"train": config.max_train_samples, "validation_matched": config.max_eval_samples,
            "validation_mismatched": config.max_eval_samples}


def _local_files(dataset: str) -> Optional[tuple[str, dict[str, Path]]]:
    """(format, split -> file) for a local path, None if ``dataset`` names no existing path.

    A single file is marked by mapping every split to it (see HOLDOUT_EVERY for the split rule).
    """
    path = Path(dataset).expanduser()
    if path.is_file():
        fmt = {".jsonl": "jsonl", ".json": "jsonl", ".tsv": "tsv"}.get(path.suffix.lower())
        if fmt is None:
            raise ValueError(f"dataset file {path}: expected a .jsonl or .tsv file")
        return fmt, {split: path for split in SPLITS}
    if path.is_dir():
        for fmt, names in FILE_SETS.items():
            if (path / names["train"]).exists():
                missing = [path / name for name in names.values() if not (path / name).is_file()]
                if missing:
                    raise ValueError(f"dataset directory {path}: missing file {missing[0]}")
                return fmt, {split: path / name for split, name in names.items()}
        expected = "; ".join(", ".join(names.values()) for names in FILE_SETS.values())
        raise ValueError(f"dataset directory {path} holds neither MNLI file set (expected: {expected})")
    return None


def _unknown_dataset(dataset: str) -> ValueError:
    return ValueError(f"dataset={dataset!r} is not accepted: use 'synthetic' (embedded, no download), "
                      f"'mnli' (nyu-mll/glue from the Hugging Face hub), or an existing directory with "
                      f"{', '.join(FILE_SETS['jsonl'].values())} or {', '.join(FILE_SETS['tsv'].values())}, "
                      f"or a single .jsonl/.tsv file")


def dataset_identity(dataset: str) -> dict:
    """What the cache key needs to know about the data, without loading it (cheap on every rank)."""
    if dataset == SYNTHETIC:
        return {"kind": SYNTHETIC, "version": SYNTHETIC_VERSION}
    if dataset == MNLI:
        return {"kind": "hub", "path": HF_MNLI[0], "name": HF_MNLI[1]}
    found = _local_files(dataset)
    if found is None:
        raise _unknown_dataset(dataset)
    fmt, files = found
    stats = {split: _file_stamp(path) for split, path in files.items()}
    return {"kind": "local", "format": fmt, "files": stats,
            "single_file": len(set(files.values())) == 1, "holdout_every": HOLDOUT_EVERY}


def _file_stamp(path: Path) -> list:
    """Path, size and mtime: changes when the file does, without hashing gigabytes."""
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def load_examples(config) -> dict[str, Examples]:
    """Raw, capped text examples for every split (no tokenisation)."""
    caps, seed = _caps(config), config.seed
    if config.dataset == SYNTHETIC:
        return {split: synthetic_examples(split, _capped(SYNTHETIC_SIZES[split], caps[split]), seed)
                for split in SPLITS}
    if config.dataset == MNLI:
        sources = _hub_sources()
    else:
        found = _local_files(config.dataset)
        if found is None:
            raise _unknown_dataset(config.dataset)
        sources = _file_sources(*found)
    try:
        out, by_source = {}, {}
        for stream, split in enumerate(SPLITS):
            source = sources[split]
            if id(source) not in by_source:  # a single file's held-out rows serve both eval splits
                by_source[id(source)] = _nonempty(select_examples(source, caps[split], seed, stream), split, config)
            out[split] = by_source[id(source)]
        return out
    finally:
        for source in set(sources.values()):
            source.close()


def _capped(size: int, cap: Optional[int]) -> int:
    return size if cap is None else min(size, cap)


def _nonempty(examples: Examples, split: str, config) -> Examples:
    if not len(examples):
        raise ValueError(f"dataset {config.dataset!r}: split {split} has no labelled examples")
    return examples


def _file_sources(fmt: str, files: dict[str, Path]) -> dict:
    if len(set(files.values())) == 1:
        whole = _LineFile(files["train"], fmt)
        index = np.arange(len(whole))
        held_out = (index + 1) % HOLDOUT_EVERY == 0
        log.warning("dataset %s is a single file: every %dth row is held out as both validation splits",
                    files["train"], HOLDOUT_EVERY)
        held = _Subset(whole, index[held_out])
        return {"train": _Subset(whole, index[~held_out]), "validation_matched": held,
                "validation_mismatched": held, "_file": whole}
    return {split: _LineFile(path, fmt) for split, path in files.items()}


def _hub_sources() -> dict:
    """GLUE MNLI from the hub (needs the network or the local HF cache)."""
    import datasets
    try:
        loaded = datasets.load_dataset(*HF_MNLI)
    except Exception as err:  # the hub raises many types (ConnectionError, OSError, HTTP errors)
        offline = [v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if os.environ.get(v, "").lower() in ("1", "true", "yes", "on")]
        why = f"offline mode is on ({', '.join(offline)}=1) and it is not in the local cache" if offline \
            else "the hub could not be reached and it is not in the local cache"
        raise ValueError(
            f"dataset=mnli: cannot load {'/'.join(HF_MNLI)}: {why} ({type(err).__name__}: {err}). "
            f"Go online once so datasets caches it, or set dataset to a local directory with "
            f"{', '.join(FILE_SETS['jsonl'].values())} (or GLUE's {', '.join(FILE_SETS['tsv'].values())}), "
            f"or use dataset: synthetic.") from None
    return {split: _ArrowRows(loaded[split], f"{'/'.join(HF_MNLI)}[{split}]") for split in SPLITS}


# --------------------------------------------------------------------------- tokenizers

def tokenizer_spec(config) -> str:
    """Resolve ``tokenizer: auto``: the model's own tokenizer for a HF model, else a trained BPE."""
    if config.tokenizer == "auto":
        return "bpe" if config.model in BUILTIN_MODELS else config.model
    return config.tokenizer


def tokenizer_identity(spec: str) -> dict:
    """What the cache key needs to know about the tokenizer, without building it."""
    import tokenizers
    if spec == "bpe":
        return {"kind": "bpe", "vocab_size": BPE_VOCAB_SIZE, "tokenizers": tokenizers.__version__}
    if spec == "bytes":
        return {"kind": "bytes"}
    path = Path(spec).expanduser()
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
    """A HF tokenizer by name or local dir, with a pad token that no text uses."""
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec)
    except Exception as err:  # OSError offline, EnvironmentError/ValueError for bad dirs
        raise ValueError(f"tokenizer {spec!r} could not be loaded ({type(err).__name__}: {str(err).splitlines()[0]}). "
                         f"{_TOKENIZER_ADVICE}") from None
    check_vocabulary(tokenizer, spec)
    tokenizer.padding_side = "right"
    tokenizer.split_special_tokens = True
    if tokenizer.pad_token_id is None:
        _set_pad(tokenizer)
    return tokenizer


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


# --------------------------------------------------------------------------- cache

def cache_key(config) -> str:
    """Hash of everything the tensors depend on: data identity, caps, seed, tokenizer, length."""
    parts = {"format": CACHE_FORMAT, "dataset": dataset_identity(config.dataset),
             "caps": _caps(config), "seed": config.seed,
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
            "max_length": config.max_length, "seed": config.seed, "caps": _caps(config),
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


# --------------------------------------------------------------------------- batches

def _split_of(data) -> dict[str, torch.Tensor]:
    return data.splits["train"] if isinstance(data, PreparedData) else data


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation of epoch ``epoch``: a function of (seed, epoch) only, so any step can be resumed."""
    return torch.from_numpy(np.random.default_rng([_u64(seed), epoch, 0x7B]).permutation(n))


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
