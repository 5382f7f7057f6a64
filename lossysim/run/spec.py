"""A sweep's spec: a base config plus a grid (the format is in ``run/sweep.py``'s docstring), read from YAML
with ``--set`` and ``--grid`` over it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from ..config import load_yaml

SPEC_KEYS = ("base", "grid", "description")


@dataclass
class SweepSpec:
    name: str
    base: dict                          # config keys every run starts from
    grids: list[dict[str, list]]        # union of the products of these
    description: str = ""
    source: Optional[str] = None

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "source": self.source,
                "base": self.base, "grid": self.grids if len(self.grids) != 1 else self.grids[0]}


def load_spec(path: Union[str, Path], overrides: Optional[dict] = None,
              grid_overrides: Optional[dict] = None) -> SweepSpec:
    """Read a spec; ``overrides`` (``--set``) change the base, ``grid_overrides`` an axis."""
    path = Path(path)
    raw = load_yaml(path)
    base: dict = {}
    given = raw.get("base")
    if isinstance(given, dict):
        base.update({str(k): v for k, v in given.items()})
    elif isinstance(given, str) and given.strip():
        base_path = Path(given)
        if not base_path.is_absolute():
            base_path = path.parent / base_path
        try:
            base.update(load_yaml(base_path))
        except ValueError as err:
            raise ValueError(f"{path}: base: {err}") from None
    elif given is not None:
        raise ValueError(f"{path}: base: expected a config file path or a mapping of config keys, "
                         f"got {type(given).__name__} {given!r}")
    base.update({str(k): v for k, v in raw.items() if k not in SPEC_KEYS})
    grids = _parse_grids(raw.get("grid"), path)
    for key, values in (grid_overrides or {}).items():
        if not values:
            raise ValueError(f"--grid {key}=: give at least one value")
        for grid in grids:
            grid[key] = list(values)
    overrides = dict(overrides or {})
    for key in overrides:
        if any(key in grid for grid in grids):
            raise ValueError(f"--set {key}=...: {key} is a grid axis; use --grid {key}=VALUES")
    base.update(overrides)
    name = str(raw.get("name") or path.stem)   # the spec's own name, not its base file's
    return SweepSpec(name=name, base=base, grids=grids,
                     description=str(raw.get("description") or ""), source=str(path))


def _parse_grids(grid: Any, path: Path) -> list[dict[str, list]]:
    if grid is None:
        return [{}]
    items = grid if isinstance(grid, list) else [grid]
    grids = []
    for item in items:
        if not isinstance(item, dict):
            raise ValueError(f"{path}: grid must be a mapping of key: [values] (or a list of them)")
        parsed = {}
        for key, values in item.items():
            values = values if isinstance(values, list) else [values]
            if not values:
                raise ValueError(f"{path}: grid key {key!r} has an empty list")
            parsed[str(key)] = values
        grids.append(parsed)
    return grids


def parse_grid_overrides(pairs: list[str]) -> dict[str, list[str]]:
    """``["seed=0 1 2", "loss=none bernoulli:0.01"]`` -> axes (values split on whitespace)."""
    out = {}
    for pair in pairs:
        key, eq, values = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--grid {pair!r}: expected key=VALUE [VALUE ...]")
        out[key.strip()] = values.split()
    return out
