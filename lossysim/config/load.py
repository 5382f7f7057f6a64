"""A config's files and flags: YAML in and out, ``--set key=value``, the layers (defaults, file,
overrides), and ``upgrade`` of a config an earlier version wrote."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import yaml

from .experiment import ExperimentConfig, coerce, from_dict


def upgrade(values: dict) -> dict:
    """A config (dict) an earlier version wrote, as this version reads it: keys it lacks take their
    defaults, and 0.2's ``retransmit: selective`` (before ``nic`` existed) is the nic's own repair."""
    values = dict(values)
    if "nic" not in values and values.get("retransmit") == "selective":
        values["retransmit"] = None
    if values.get("microbatches") == values.get("pp_size", 1):  # written before pp: 1, now its default
        values["microbatches"] = None
    return {**{k: v for k, v in ExperimentConfig().to_dict().items() if k not in values}, **values}


def load_yaml(path: Union[str, Path]) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{path}{where}: malformed YAML: {getattr(err, 'problem', err)}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of config keys, got {type(values).__name__}")
    return values


def parse_overrides(pairs: list[str]) -> dict:
    """``["lr=1e-4", "loss=bernoulli:0.01"]`` -> dict (values converted later by field type)."""
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--set {pair!r}: expected key=value")
        out[key.strip()] = value
    return out


def load_config(path: Optional[Union[str, Path]] = None, overrides: Optional[dict] = None) -> ExperimentConfig:
    """Defaults, then the YAML file, then overrides; validated (a file's bad value too where an override
    replaces it)."""
    values = coerce(load_yaml(path)) if path else {}
    values.update(overrides or {})
    return from_dict(values)


def save_yaml(config: ExperimentConfig, path: Union[str, Path]) -> None:
    from ..io import atomic_write_text
    atomic_write_text(path, yaml.safe_dump(config.to_dict(), sort_keys=False))
