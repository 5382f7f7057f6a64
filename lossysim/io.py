"""File writes: atomic (a reader never sees a half-written file, a crash leaves the old one), and
output folders checked before any work, their errors named by the option that chose them; JSONL, and
a run directory's summary.json read safely."""
from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Optional, Union


def _umask() -> int:
    mask = os.umask(0)   # the only way to read it is to set it; put it straight back
    os.umask(mask)
    return mask


def atomic_write_text(path: Union[str, Path], text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp's file is 0600; the file replaced into place gets what open() would have given it.
        os.fchmod(fd, 0o666 & ~_umask())
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


def nearest_existing(path: Union[str, Path]) -> Path:
    """``path`` or the closest of its parents that exists: what creating ``path`` writes into."""
    path = Path(path)
    return next(p for p in (path, *path.absolute().parents) if p.exists())


def check_writable(folder: Union[str, Path], option: str = "--out") -> None:
    """Make sure ``folder`` is, or can be made, a folder this process can write, without creating it:
    a ValueError naming ``option`` and the folder otherwise, before any work is done."""
    folder = Path(folder)
    existing = nearest_existing(folder)
    if not existing.is_dir():
        what = "is not a folder" if existing == folder else f"cannot be created: {existing} is not a folder"
        raise ValueError(f"{option} {folder} {what}")
    try:   # permissions, read-only mounts and ACLs all answer one real write
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".write-test.")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(f"{option} {folder} is not writable: {err.strerror or err}") from None


@contextlib.contextmanager
def output_errors(folder: Union[str, Path], option: str = "--out"):
    """Turn an OSError on a file under ``folder`` (disk full, permissions changed mid-run) into a
    one-line ValueError naming ``option``; other OSErrors pass unchanged."""
    try:
        yield
    except OSError as err:
        if err.filename is None or not _under(Path(str(err.filename)), Path(folder)):
            raise
        raise ValueError(f"{option} {folder} is not writable: {err.strerror or err}") from None


def _under(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


# A run directory's summary.json, read without pandas: the trainer checks it before every run.
def read_summary(run_dir: Union[str, Path]) -> Optional[dict]:
    """The run's summary, or None when it has none (killed) or it cannot be read."""
    return load_summary(run_dir)[0]


def load_summary(run_dir: Union[str, Path]) -> tuple[Optional[dict], Optional[str]]:
    """(the run's summary, None), or (None, why it cannot be read)."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except OSError as err:
        return None, f"summary.json cannot be read: {err.strerror or err}"
    except json.JSONDecodeError as err:
        return None, f"summary.json is not valid JSON (line {err.lineno}: {err.msg}; truncated?)"
    except ValueError:   # not UTF-8
        return None, "summary.json is not text"
    if not isinstance(summary, dict):
        return None, "summary.json holds no JSON object"
    return summary, None


def run_status(run_dir: Union[str, Path]) -> Optional[str]:
    summary = read_summary(run_dir)
    return None if summary is None else summary.get("status")


# A sweep folder's record (``run/spec_record.py`` writes it): its spec and the run folders it expects.
SWEEP_FILE = "sweep.yaml"
EXPECTED_RUNS_KEY = "runs"


def parse_yaml_mapping(text: Optional[str]) -> Optional[dict]:
    """``text`` as a YAML mapping, or None when there is none (no text, not YAML, another type)."""
    import yaml
    try:
        value = yaml.safe_load(text) if text is not None else None
    except yaml.YAMLError:
        return None
    return value if isinstance(value, dict) else None


def expected_runs(results: Union[str, Path]) -> list[str]:
    """The run folders ``results/sweep.yaml`` lists (none for a record written before they were listed)."""
    path = Path(results) / SWEEP_FILE
    try:
        record = parse_yaml_mapping(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        record = None
    runs = (record or {}).get(EXPECTED_RUNS_KEY)
    return [str(name) for name in runs] if isinstance(runs, list) else []
