"""A sweep's runs: every grid point resolved into a config, equal experiments made equal (``normalise``), each
named by a readable prefix and the hash of what it trains, so the same settings always land in the same
directory whatever sweep or shard asks for them."""
from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

from ..config import IDENTITY_AT_DEFAULT_OMITTED, NON_SEMANTIC, ExperimentConfig, from_dict
from ..loss import parse_loss_model
from ..loss.spec import label
from .spec import SweepSpec


@dataclass(frozen=True)
class Run:
    config: ExperimentConfig          # resolved; ``out`` is the run directory
    key: str                          # 8 hex digits of the config hash
    dir_name: str
    point: dict = field(default_factory=dict, compare=False)   # grid values that made it

    @property
    def run_dir(self) -> Path:
        return Path(self.config.out)


# What a lossless run does not care about: which way is lossy, which links could lose packets, how
# losses would be repaired (its algorithm and links still set its time).
LOSS_ONLY = ("loss", "lossy", "recovery", "eval_lossy", "lossy_links", "transport", "nic", "retransmit",
             "deadline", "rto_s", "channels", "lossy_traffic")


def normalise(config: ExperimentConfig) -> ExperimentConfig:
    """Make equal experiments equal configs: a lossless run's ``LOSS_ONLY`` keys at their defaults (a run
    with a lossy cable, or a cable that goes down, is not lossless)."""
    if parse_loss_model(config.loss).lossless and not config.bad_link and not config.corrupt_share \
            and not config.link_event:
        defaults = ExperimentConfig()
        return config.replace(**{key: getattr(defaults, key) for key in LOSS_ONLY})
    return config


def config_key(config: ExperimentConfig) -> str:
    """Stable 8-hex-digit hash of what a config trains (its semantic keys)."""
    defaults = ExperimentConfig().to_dict()
    values = {k: v for k, v in config.to_dict().items() if k not in NON_SEMANTIC
              and not (k in IDENTITY_AT_DEFAULT_OMITTED and v == defaults[k])}
    # Two spellings of one model ("bernoulli:1%", "bernoulli:0.01") are one experiment.
    values["loss"] = parse_loss_model(config.loss).spec
    blob = json.dumps(values, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


def run_name(config: ExperimentConfig, key: str) -> str:
    """``bernoulli-0.01_tp2_seed0-1a2b3c4d`` (``..._tp1_pp2_seed0-...`` with stages): readable prefix, hash
    for uniqueness."""
    defaults = ExperimentConfig()
    parts = [label(config.loss), *_fabric_parts(config), f"tp{config.tp_size}", *_pipeline_parts(config),
             f"seed{config.seed}"]
    parts += [getattr(config, key) for key in ("lossy", "recovery", "algorithm")
              if getattr(config, key) != getattr(defaults, key)]
    if config.transport != defaults.transport:
        parts.append(config.transport + ("" if config.nic == defaults.nic else f"-{config.nic}")
                     + ("-gbn" if config.retransmit == "go_back_n" else ""))
    if config.dp_mode != defaults.dp_mode:
        parts.append(config.dp_mode)
    prefix = "".join(c if c.isalnum() or c in "._-" else "-" for c in "_".join(parts))
    return f"{prefix}-{key}"


def _fabric_parts(config: ExperimentConfig) -> list[str]:
    """On a fabric, what says where its packets are lost (``loss`` alone names every cable's model, so a
    bad-link run would read ``none``): the fabric, each bad cable and its loss, the CorrOpt share, then the
    routing settings away from their defaults. Nothing without a fabric, so those runs keep their names."""
    text = str(config.fabric).strip()
    if text.lower() in ("none", ""):
        return []
    kind, _, settings = text.partition(":")
    if kind == "leaf-spine":   # nodes, rails, leaves, spines, oversubscription, gbps: their first letters
        settings = "-".join(k.strip()[:1] + v.strip() for k, _, v in (p.partition("=") for p in settings.split(",")))
    parts = [f"{kind}{settings}" if kind == "superpod" else f"{kind}-{settings}" if settings else Path(text).stem]
    bad = [b.strip() for b in str(config.bad_link).split(";") if b.strip()]
    for entry in bad[:2]:
        cable, _, model = entry.partition(":")
        parts.append(f"bad-{cable.strip()}-{label(model)}")
    parts += [f"bad-{len(bad) - 2}-more"] if len(bad) > 2 else []
    parts += [f"corrupt{float(config.corrupt_share):g}"] if config.corrupt_share else []
    defaults = ExperimentConfig()
    parts += [config.routing] if config.routing != defaults.routing else []
    parts += [f"qps{config.qps_per_connection}"] if config.qps_per_connection != defaults.qps_per_connection else []
    parts += ["nopxn"] if config.pxn != defaults.pxn else []
    parts += ["unshared"] if config.shared_cables != defaults.shared_cables else []
    return parts


def _pipeline_parts(config: ExperimentConfig) -> list[str]:
    """``pp2``, then the schedule and micro-batches where they are not the defaults (``gpipe``, ``m4``); nothing
    for one stage, so runs named before pipelines keep their names."""
    if config.pp_size == 1:   # micro-batches without stages (accumulation) were never named: keep it so
        return []
    parts = [f"pp{config.pp_size}"]
    if config.pp_schedule != ExperimentConfig().pp_schedule:
        parts.append(config.pp_schedule)
    if config.microbatches is not None:
        parts.append(f"m{config.microbatches}")
    return parts


def expand(spec: SweepSpec, out: Union[str, Path]) -> list[Run]:
    """Every distinct run of the spec, validated, in grid order."""
    out = Path(out)
    runs: dict[str, Run] = {}
    earlier = _names_on_disk(out)
    for grid in spec.grids:
        keys = list(grid)
        for values in itertools.product(*(grid[k] for k in keys)):
            point = dict(zip(keys, values))
            try:
                config = normalise(from_dict({**spec.base, **point}))
            except ValueError as err:
                where = ", ".join(f"{k}={v}" for k, v in point.items()) or "the base config"
                raise ValueError(f"{spec.source or spec.name}: {where}: {err}") from None
            key = config_key(config)
            if key in runs:
                continue
            name = earlier.get(key) or run_name(config, key)
            config = config.replace(name=name, out=str(out / name))
            runs[key] = Run(config=config, key=key, dir_name=name, point=point)
    return list(runs.values())


def _names_on_disk(out: Path) -> dict[str, str]:
    """hash -> run directory already under ``out``: names gain parts as settings are added (dp_mode), the
    hash does not, so a sweep started by an earlier version resumes into its own folders."""
    found: dict[str, list[str]] = {}
    if out.is_dir():
        for path in out.iterdir():
            key = path.name.rpartition("-")[2]
            if path.is_dir() and len(key) == 8:
                found.setdefault(key, []).append(path.name)
    return {key: names[0] for key, names in found.items() if len(names) == 1}
