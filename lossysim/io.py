"""Atomic file writes: a reader never sees a half-written file, a crash leaves the old one."""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Union


def atomic_write_text(path: Union[str, Path], text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null (strict readers choke otherwise)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def atomic_write_json(path: Union[str, Path], data: Any) -> None:
    atomic_write_text(path, json.dumps(_finite(data), indent=2, sort_keys=False) + "\n")


def append_jsonl(path: Union[str, Path], record: dict) -> None:
    """Append one JSON line and flush it to disk (a crash loses at most the line being written)."""
    with open(path, "a") as f:
        f.write(json.dumps(_finite(record)) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Union[str, Path]) -> list[dict]:
    """Read a JSONL file, ignoring a torn last line left by a crash."""
    rows = []
    lines = Path(path).read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path} line {i + 1}: malformed JSON") from None
    return rows
