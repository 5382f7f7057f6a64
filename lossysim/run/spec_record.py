"""``sweep.yaml``: the record of the spec a results folder was swept with, and the runs it expects.

``sweep.yaml`` holds the newest spec and the names of all its runs (every shard's), which ``lossysim
report`` reads to name the runs that never started. A sweep of another spec into the same folder keeps
the earlier record as ``sweep.<n>.yaml`` (1 the oldest) before writing its own; the same spec resumed
(from any folder, by any shard) leaves ``sweep.yaml`` as it is.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import yaml

from ..io import EXPECTED_RUNS_KEY as RUNS_KEY, SWEEP_FILE as SPEC_FILE, atomic_write_text
from ..io import parse_yaml_mapping as _parse

# Where the spec's file was read from says nothing about what it sweeps.
NOT_COMPARED = ("source", RUNS_KEY)


def record_spec(out: Path, spec: dict, runs: list[str]) -> Optional[str]:
    """Write ``out/sweep.yaml`` for ``spec`` (``SweepSpec.to_dict()``) and its ``runs``; return the line
    to print when it held another spec, which is kept beside it, else None."""
    path = out / SPEC_FILE
    text = yaml.safe_dump({**spec, RUNS_KEY: list(runs)}, sort_keys=False)
    record = _parse(text)   # as it reads back, to compare with what the folder holds
    old_text = path.read_text() if path.is_file() else None
    old = _parse(old_text)
    if old is not None and _what(old) == _what(record):
        if old.get(RUNS_KEY) != record[RUNS_KEY]:   # a record from before the runs were listed
            atomic_write_text(path, text)
        return None
    kept = _keep(out, old_text) if old_text is not None else None
    atomic_write_text(path, text)
    if kept is None:
        return None
    name = old.get("name") if old is not None else None
    return (f"{path} held another spec{f' ({name})' if name else ''}: kept as {out / kept}; "
            f"{SPEC_FILE} is now {spec.get('name')}'s")


def _what(record: dict) -> dict:
    return {key: value for key, value in record.items() if key not in NOT_COMPARED}


def _keep(out: Path, text: str) -> str:
    """The earlier record's file name: the one already holding ``text``, else the next ``sweep.<n>.yaml``."""
    numbers = []
    for path in out.glob("sweep.*.yaml"):
        match = re.fullmatch(r"sweep\.(\d+)\.yaml", path.name)
        if match:
            if path.read_text() == text:
                return path.name
            numbers.append(int(match.group(1)))
    name = f"sweep.{max(numbers, default=0) + 1}.yaml"
    atomic_write_text(out / name, text)
    return name
