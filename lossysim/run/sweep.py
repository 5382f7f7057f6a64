"""Sweeps: a grid of experiments, resumable after any crash and shardable across machines.

A sweep spec (YAML, under ``experiments/``) is a base config plus a grid::

    base: ../configs/tiny.yaml          # optional; relative to the spec file, or an inline
                                        # mapping of config keys (base: {model: tiny, steps: 50})
    model: tiny                         # ExperimentConfig keys: the base (over `base`)
    steps: 300
    grid:                               # every combination of these lists is one run
      loss: [none, "bernoulli:0.01", "ge:rate=0.01,burst=8"]
      seed: [0, 1]

``grid`` may also be a list of such mappings: the runs are the union of their products.
Quote loss specs with commas inside a YAML flow list (``[a, b]`` splits on commas).

Every grid point is resolved and validated before anything trains, so a typo fails at once, and its
settings are checked against its model's shape as ``train`` checks them (``precheck``). Exit status:
0, or ``FAILED_EXIT`` when some runs failed; bad input is 2 and Ctrl-C 130 (``cli``).
Each run lives in ``<out>/<readable prefix>-<hash8>``, the hash being that of the resolved
config without its non-semantic keys: the same settings always land in the same directory,
whatever sweep or shard asks for them (a folder an earlier version named differently is found
again by its hash). A lossless loss spec (``bernoulli:0``,
``ge:rate=0,burst=8``) is the same experiment as ``none`` whatever ``lossy`` and ``recovery``
or ``eval_lossy`` say, so it is normalised to ``loss=none, lossy=both, recovery=zero,
eval_lossy=true`` and runs once per seed.

Resuming: a run whose ``summary.json`` says ``completed``, ``diverged`` or ``gave_up`` is finished (a
divergence is a deterministic result, not an accident) and is skipped; any other run
directory (no summary: killed; ``failed``) is deleted and the run starts again. Every file is
written atomically or re-created, so a sweep killed at any moment (SIGKILL included) completes
on the next call. ``summary.csv`` is rebuilt from the run directories on disk after each run,
so shards writing to one folder merge by themselves.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

from ..config.fabric import add_fabric_arguments, fabric_overrides
from ..config import (IDENTITY_AT_DEFAULT_OMITTED, NON_SEMANTIC, ExperimentConfig, from_dict, load_yaml,
                      parse_overrides, save_yaml)
from ..io import atomic_write_json, atomic_write_text, check_writable, output_errors
from ..loss import parse_loss_model
from ..loss.spec import label
from ..results.table import read_summary, run_status, write_summary_csv
from .precheck import check_inputs, environmental, needs, refuse, refused
from .runtime import die_with_parent
from .spec_record import record_spec

log = logging.getLogger(__name__)

SPEC_KEYS = ("base", "grid", "description")
# Keys that say where or how a run is executed, not what is trained: they stay out of the
# hash so a shard on another machine (another device, another output folder) finds the run.
# Checkpointing settings too: a resumed run ends exactly as an uninterrupted one.
FINISHED = ("completed", "diverged", "gave_up")
# A sweep's exit status when some runs failed: not 1 (a bug), 2 (bad input, nothing trained) or 130 (Ctrl-C).
FAILED_EXIT = 3

TrainFn = Callable[..., dict]


# -- the spec ------------------------------------------------------------------------------------
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


# -- runs ------------------------------------------------------------------------------------------
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
    with a lossy cable is not lossless)."""
    if parse_loss_model(config.loss).lossless and not config.bad_link and not config.corrupt_share:
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
    parts = [label(config.loss), f"tp{config.tp_size}", *_pipeline_parts(config), f"seed{config.seed}"]
    parts += [getattr(config, key) for key in ("lossy", "recovery", "algorithm")
              if getattr(config, key) != getattr(defaults, key)]
    if config.transport != defaults.transport:
        parts.append(config.transport + ("" if config.nic == defaults.nic else f"-{config.nic}")
                     + ("-gbn" if config.retransmit == "go_back_n" else ""))
    if config.dp_mode != defaults.dp_mode:
        parts.append(config.dp_mode)
    prefix = "".join(c if c.isalnum() or c in "._-" else "-" for c in "_".join(parts))
    return f"{prefix}-{key}"


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


def parse_shard(text: Optional[str], environ: Optional[dict] = None) -> tuple[int, int]:
    """``K/N`` -> (K, N); ``auto`` reads them from a Slurm job array (see slurm_shard)."""
    if not text:
        return 1, 1
    if text.strip() == "auto":
        return slurm_shard(os.environ if environ is None else environ)
    k, slash, n = text.partition("/")
    try:
        k, n = int(k), int(n)
    except ValueError:
        raise ValueError(f"--shard {text!r}: expected K/N, e.g. 2/3") from None
    if not slash or n < 1 or not 1 <= k <= n:
        raise ValueError(f"--shard {text!r}: expected K/N with 1 <= K <= N")
    return k, n


def slurm_shard(environ) -> tuple[int, int]:
    """(K, N) of this task of a Slurm job array: tasks MIN, MIN+STEP, ... are shards 1..COUNT."""
    names = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_COUNT")
    if not environ.get(names[0]):
        raise ValueError("--shard auto: not a Slurm job array task (SLURM_ARRAY_TASK_ID is not set); "
                         "submit with sbatch --array, or give --shard K/N")
    values = {}
    for name in (*names, "SLURM_ARRAY_TASK_STEP", "SLURM_ARRAY_TASK_MAX"):
        text = environ.get(name)
        if text in (None, ""):
            continue
        try:
            values[name] = int(text)
        except ValueError:
            raise ValueError(f"--shard auto: {name}={text!r} is not a whole number") from None
    task, low, step = values[names[0]], values.get(names[1], 0), values.get("SLURM_ARRAY_TASK_STEP", 1)
    count = values.get(names[2])
    if count is None and "SLURM_ARRAY_TASK_MAX" in values:
        count = (values["SLURM_ARRAY_TASK_MAX"] - low) // max(step, 1) + 1
    if count is None:
        raise ValueError("--shard auto: SLURM_ARRAY_TASK_COUNT (or SLURM_ARRAY_TASK_MAX) is not set")
    if step < 1 or (task - low) % step:
        raise ValueError(f"--shard auto: task {task} is not in the array {low}:{step} "
                         "(SLURM_ARRAY_TASK_MIN / SLURM_ARRAY_TASK_STEP)")
    k = (task - low) // step + 1
    if count < 1 or not 1 <= k <= count:
        raise ValueError(f"--shard auto: SLURM_ARRAY_TASK_ID={task} is outside the array "
                         f"(SLURM_ARRAY_TASK_MIN={low}, SLURM_ARRAY_TASK_COUNT={count}); an array "
                         "with gaps (--array=1,5,9) cannot be sharded, use a range such as --array=0-7")
    return k, count


def shard(runs: list[Run], k: int, n: int) -> list[Run]:
    """Shard k of n (1-based): disjoint, covering, the same on every machine (sorted by hash)."""
    ordered = sorted(runs, key=lambda r: (r.key, r.dir_name))
    mine = {r.key for i, r in enumerate(ordered) if i % n == k - 1}
    return [r for r in runs if r.key in mine]   # keep grid order: baselines first, as written


def failure_summary(config: ExperimentConfig, error: str) -> dict:
    """What the sweep records for a run that ended without writing its own summary."""
    return {"status": "failed", "error": error, "name": config.name, "dataset": None,
            "config": config.to_dict(), "steps": 0, "wall_time_s": None, "tokens_per_s": None,
            "final": {}, "best": {}, "packets": {"train": [], "eval": []},
            "packets_by_site": {"train": [], "eval": []}, "disagreement": {},
            "diverged_at": None, "versions": {}}


def _default_train() -> TrainFn:
    from .experiment import run_experiment   # torch and transformers load only when training
    return run_experiment


ERROR_FILE = "error.txt"   # where a dist run's ranks put the one line that refused it


def dist_command(config: ExperimentConfig, run_dir: Path, resume: bool = False) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={config.mesh().world}", "-m", "lossysim", "train",
            "--config", str(run_dir / "config.yaml"), "--out", str(run_dir), "--backend", "dist",
            *(["--resume"] if resume else [])]


def execute(run: Run, train: Optional[TrainFn] = None, progress: bool = True) -> dict:
    """Run one experiment; always leaves a summary.json, returns it.

    An interrupted run starts again from a clean directory, unless it saves training
    checkpoints (``checkpoint_every``): then the trainer resumes from its last complete one.
    A failed run always starts clean (its state may be what made it fail).
    """
    run_dir = run.run_dir
    resume = getattr(run.config, "checkpoint_every", 0) > 0 and run_status(run_dir) != "failed"
    if run_dir.exists() and not resume:
        shutil.rmtree(run_dir)   # a stale attempt: its metrics would mix with the new ones
    run_dir.mkdir(parents=True, exist_ok=True)
    save_yaml(run.config, run_dir / "config.yaml")
    error = None
    try:
        if run.config.backend == "dist":
            # A refused setting writes nothing in the run's folder; its ranks say why in this file.
            reason = run_dir / ERROR_FILE
            code = subprocess.call(dist_command(run.config, run_dir, resume),
                                   env={**os.environ, "LOSSYSIM_ERROR_FILE": str(reason)},
                                   preexec_fn=die_with_parent if sys.platform == "linux" else None)
            if code != 0:
                said = reason.read_text().splitlines()[:1] if reason.exists() else []
                error = f"torchrun exited with status {code}" + "".join(f": {line}" for line in said)
            reason.unlink(missing_ok=True)
        else:
            extra = {"resume": True} if resume else {}
            (train or _default_train())(run.config, run_dir, progress=progress, position=1, **extra)
    except Exception as err:   # the trainer records training failures itself; this is the rest
        log.debug("run %s raised", run.dir_name, exc_info=True)
        error = f"{type(err).__name__}: {err}"
    summary = read_summary(run_dir)
    if summary is None:
        summary = failure_summary(run.config, error or "the run wrote no summary.json")
        atomic_write_json(run_dir / "summary.json", summary)
    return summary


# -- the sweep ----------------------------------------------------------------------------------------
@dataclass
class SweepResult:
    runs: list[Run]
    statuses: dict[str, str]          # dir_name -> status at the end
    ran: int = 0
    skipped: int = 0

    def count(self, status: str) -> int:
        return sum(1 for s in self.statuses.values() if s == status)

    @property
    def exit_code(self) -> int:
        return FAILED_EXIT if self.count("failed") else 0


def _clean_temporaries(out: Path) -> None:
    """Remove the temporary files of atomic writes that a kill interrupted."""
    for tmp in out.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)
    for tmp in out.glob("*/.*.tmp"):
        tmp.unlink(missing_ok=True)


def run_sweep(spec: SweepSpec, out: Union[str, Path], shard_k: int = 1, shard_n: int = 1,
              train: Optional[TrainFn] = None, progress: bool = True, check: bool = True) -> SweepResult:
    """Run every unfinished run of the spec; ``check``: first make sure each model, tokenizer and
    data set they need can be loaded here (see check_inputs)."""
    out = Path(out)
    every = expand(spec, out)   # validated before anything is touched
    runs = shard(every, shard_k, shard_n)
    if check:
        check_inputs(runs)   # what the runs load can be loaded here, before anything is written
    refuse(runs)   # and the runs' settings fit their models
    check_writable(out)
    with output_errors(out):
        return _run_all(spec, runs, out, shard_k, shard_n, train, progress, [r.dir_name for r in every])


def _run_all(spec: SweepSpec, runs: list[Run], out: Path, shard_k: int, shard_n: int,
             train: Optional[TrainFn], progress: bool, names: list[str]) -> SweepResult:
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    _clean_temporaries(out)
    kept = record_spec(out, spec.to_dict(), names)   # every shard's names: the report finds the missing ones
    if kept:
        print(f"sweep: {kept}", file=sys.stderr)
    result = SweepResult(runs=runs, statuses={})
    label = spec.name if shard_n == 1 else f"{spec.name} {shard_k}/{shard_n}"
    bar = tqdm(total=len(runs), desc=label, unit="run", position=0, disable=not progress,
               dynamic_ncols=True)
    try:
        for i, run in enumerate(runs):
            status = run_status(run.run_dir)
            if status in FINISHED:
                result.skipped += 1
            else:
                bar.set_postfix_str(run.dir_name)
                status = execute(run, train=train, progress=progress).get("status")
                result.ran += 1
                error = read_summary(run.run_dir).get("error")
                if status != "completed":
                    bar.write(f"{run.dir_name}: {status}: {error}", file=sys.stderr)
                write_summary_csv(out)
                if status == "failed" and environmental(error):
                    rest = [r for r in runs[i + 1:] if run_status(r.run_dir) not in FINISHED]
                    if rest and all(needs(r.config) == needs(run.config) for r in rest):
                        raise ValueError(f"sweep stopped: {run.dir_name} failed for a reason of this machine "
                                         f"that the {len(rest)} remaining runs share: {error}")
            result.statuses[run.dir_name] = status
            bar.update()
    finally:
        bar.close()
    write_summary_csv(out)
    return result


# -- command line ---------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="sweep spec (YAML): base config keys plus a `grid` of lists")
    parser.add_argument("--out", help="results folder (default: results/<spec name>)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a base config key (repeatable)")
    parser.add_argument("--grid", dest="grid", action="append", default=[], metavar="KEY=VALUES",
                        help="replace or add a grid axis, values separated by spaces, "
                             "e.g. --grid 'seed=0 1 2' (repeatable)")
    parser.add_argument("--shard", metavar="K/N",
                        help="run only part K of N (1-based); N machines with K=1..N cover the grid; "
                             "auto: K and N of this Slurm job array task (SLURM_ARRAY_TASK_ID, "
                             "SLURM_ARRAY_TASK_MIN, SLURM_ARRAY_TASK_COUNT)")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their state; train nothing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_fabric_arguments(parser)   # base config keys, as --set would set them


def run(args: argparse.Namespace, train: Optional[TrainFn] = None) -> int:
    spec = load_spec(args.spec, {**parse_overrides(args.overrides), **fabric_overrides(args)},
                     parse_grid_overrides(args.grid))
    out = Path(args.out or Path("results") / Path(args.spec).stem)
    k, n = parse_shard(args.shard)
    if args.dry_run:
        runs = shard(expand(spec, out), k, n)
        why = refused(runs)
        for i, r in enumerate(runs, 1):
            state = "refused" if r.dir_name in why else \
                run_status(r.run_dir) or ("incomplete" if r.run_dir.exists() else "todo")
            point = " ".join(f"{key}={value}" for key, value in r.point.items())
            reason = f"  ({why[r.dir_name]})" if r.dir_name in why else ""
            print(f"{i:4d}  {state:<10}  {r.dir_name}  {point}{reason}")
        print(f"{len(runs)} runs (shard {k}/{n}) in {out}" + (f"; train refuses {len(why)} of them" if why else ""))
        refuse(runs)   # bad input: exit 2, as the sweep itself would
        return 0
    result = run_sweep(spec, out, k, n, train=train, progress=not args.no_progress)
    failed, diverged = result.count("failed"), result.count("diverged")
    print(f"sweep {spec.name}: {len(result.runs)} runs (shard {k}/{n}; {result.ran} run now, "
          f"{result.skipped} already done): {result.count('completed')} completed, "
          f"{diverged} diverged, {failed} failed")
    print(f"summary: {out / 'summary.csv'}")
    if failed:
        print(f"{failed} run(s) failed (their errors are in summary.csv); run the sweep again to "
              f"retry them; exit status {result.exit_code} (some runs failed)", file=sys.stderr)
    return result.exit_code
