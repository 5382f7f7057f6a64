"""Where examples come from: local MNLI files (jsonl or GLUE tsv, one file or a set), the hub, or
Python's own documentation text (``pydoc``, causal LM only), capped by a seeded selection on raw rows
before any tokenisation."""
from __future__ import annotations

import json
import logging
import mmap
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ..hub import hub_reachable, why_unavailable
from . import pydoc_text
from .examples import MNLI, SPLITS, SYNTHETIC, Examples, normalize_label, u64
from .synthetic import SYNTHETIC_SIZES, SYNTHETIC_VERSION, synthetic_examples

log = logging.getLogger(__name__)

HF_MNLI = ("nyu-mll/glue", "mnli")

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
    order = np.arange(n) if cap is None else np.random.default_rng([u64(seed), stream]).permutation(n)
    out, pos = Examples(), 0
    while pos < n and (cap is None or len(out) < cap):
        take = n if cap is None else cap - len(out)   # exactly the rows still needed
        for row in source.rows(order[pos:pos + take]):
            if row is not None:
                out.append(*row)
        pos += take
    return out


def split_caps(config) -> dict[str, Optional[int]]:
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
                      f"'mnli' (nyu-mll/glue from the Hugging Face hub), 'pydoc' (Python's documentation "
                      f"text, task lm), or an existing directory with "
                      f"{', '.join(FILE_SETS['jsonl'].values())} or {', '.join(FILE_SETS['tsv'].values())}, "
                      f"or a single .jsonl/.tsv file")


def dataset_identity(dataset: str) -> dict:
    """What the cache key needs to know about the data, without loading it (cheap on every rank)."""
    if dataset == SYNTHETIC:
        return {"kind": SYNTHETIC, "version": SYNTHETIC_VERSION}
    if dataset == MNLI:
        return {"kind": "hub", "path": HF_MNLI[0], "name": HF_MNLI[1]}
    if dataset == pydoc_text.PYDOC:
        return pydoc_text.identity()
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
    caps, seed = split_caps(config), config.seed
    if config.dataset == SYNTHETIC:
        return {split: synthetic_examples(split, _capped(SYNTHETIC_SIZES[split], caps[split]), seed)
                for split in SPLITS}
    if config.dataset == MNLI:
        sources = _hub_sources()
    elif config.dataset == pydoc_text.PYDOC:
        held_out = pydoc_text.TextRows(pydoc_text.texts("eval"))  # both evaluation splits, as one file's
        sources = {"train": pydoc_text.TextRows(pydoc_text.texts("train")),
                   "validation_matched": held_out, "validation_mismatched": held_out}
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
    hub_reachable()   # once per process: offline mode if not, so the load fails at once
    import datasets
    try:
        loaded = datasets.load_dataset(*HF_MNLI)
    except Exception as err:  # the hub raises many types (ConnectionError, OSError, HTTP errors)
        why = f"{why_unavailable() or 'the hub could not be reached'} and it is not in the local cache"
        raise ValueError(
            f"dataset=mnli: cannot load {'/'.join(HF_MNLI)}: {why} ({type(err).__name__}: {err}). "
            f"Go online once so datasets caches it, or set dataset to a local directory with "
            f"{', '.join(FILE_SETS['jsonl'].values())} (or GLUE's {', '.join(FILE_SETS['tsv'].values())}), "
            f"or use dataset: synthetic.") from None
    return {split: _ArrowRows(loaded[split], f"{'/'.join(HF_MNLI)}[{split}]") for split in SPLITS}
