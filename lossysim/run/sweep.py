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
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

from ..config import DEFAULT_THREADS, ExperimentConfig, default_jobs, from_dict, parse_overrides, save_yaml  # noqa: F401
from ..config.fabric import add_fabric_arguments, fabric_overrides
from ..io import atomic_write_json, check_writable, output_errors
from ..loss import parse_loss_model   # noqa: F401  (what tests reach through the sweep)
from ..results.table import read_summary, run_status, write_summary_csv
from .names import LOSS_ONLY, Run, config_key, expand, normalise, run_name   # noqa: F401  (the sweep's API)
from .pool import Inline, Pool, check_jobs
from .precheck import check_inputs, environmental, needs, refuse, refused
from .runtime import die_with_parent
from .shards import parse_shard, shard, slurm_shard   # noqa: F401
from .spec import SPEC_KEYS, SweepSpec, load_spec, parse_grid_overrides   # noqa: F401
from .spec_record import record_spec

log = logging.getLogger(__name__)

FINISHED = ("completed", "diverged", "gave_up")
# A sweep's exit status when some runs failed: not 1 (a bug), 2 (bad input, nothing trained) or 130 (Ctrl-C).
FAILED_EXIT = 3

TrainFn = Callable[..., dict]


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


def execute(run: Run, train: Optional[TrainFn] = None, progress: bool = True, position: int = 1) -> dict:
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
            (train or _default_train())(run.config, run_dir, progress=progress, position=position, **extra)
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
              train: Optional[TrainFn] = None, progress: bool = True, check: bool = True,
              jobs: int = 1) -> SweepResult:
    """Run every unfinished run of the spec, ``jobs`` at a time (``pool``); ``check``: first make sure each
    model, tokenizer and data set they need can be loaded here (see check_inputs)."""
    check_jobs(jobs)
    out = Path(out)
    every = expand(spec, out)   # validated before anything is touched
    runs = shard(every, shard_k, shard_n)
    if check:
        check_inputs(runs)   # what the runs load can be loaded here, before anything is written
    refuse(runs)   # and the runs' settings fit their models
    check_writable(out)
    with output_errors(out):
        return _run_all(spec, runs, out, shard_k, shard_n, train, progress, [r.dir_name for r in every], jobs)


def record_lost(run: Run, error: str) -> None:
    """A run whose worker process died: its summary says failed, and why (``Pool``'s ``on_lost``)."""
    atomic_write_json(run.run_dir / "summary.json", failure_summary(run.config, error))


def side_by_side(todo: list[Run], jobs: int, train: Optional[TrainFn] = None) -> int:
    """How many of ``todo`` run at once: one for a dist run (torchrun's ranks take the machine's devices), or
    for a trainer other than lossysim's own (one handed in runs only in this process)."""
    jobs = min(jobs, len(todo))
    if jobs <= 1 or any(run.config.backend == "dist" for run in todo):
        return 1
    from .experiment import run_experiment
    return jobs if (train or _default_train()) is run_experiment else 1


def _run_all(spec: SweepSpec, runs: list[Run], out: Path, shard_k: int, shard_n: int,
             train: Optional[TrainFn], progress: bool, names: list[str], jobs: int = 1) -> SweepResult:
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    _clean_temporaries(out)
    kept = record_spec(out, spec.to_dict(), names)   # every shard's names: the report finds the missing ones
    if kept:
        print(f"sweep: {kept}", file=sys.stderr)
    result = SweepResult(runs=runs, statuses={})
    statuses = {i: run_status(run.run_dir) for i, run in enumerate(runs)}
    todo = [i for i, run in enumerate(runs) if statuses[i] not in FINISHED]
    result.skipped = len(runs) - len(todo)
    jobs = side_by_side([runs[i] for i in todo], jobs, train)
    label = spec.name if shard_n == 1 else f"{spec.name} {shard_k}/{shard_n}"
    bar = tqdm(total=len(runs), desc=label, unit="run", position=0, disable=not progress,
               dynamic_ncols=True, initial=result.skipped)

    runner = Inline(lambda run: execute(run, train=train, progress=progress).get("status")) if jobs == 1 \
        else Pool(jobs, progress, record_lost, execute)
    waiting, stopped = list(todo), None

    def feed() -> None:
        bar.set_postfix_str(runs[waiting[0]].dir_name)
        runner.submit(waiting[0], runs[waiting.pop(0)])
    try:
        with runner:
            while waiting and runner.pending < jobs:
                feed()
            while runner.pending:
                i, status = runner.next_done()
                run = runs[i]
                statuses[i] = status
                result.ran += 1
                error = read_summary(run.run_dir).get("error")
                if status != "completed":
                    bar.write(f"{run.dir_name}: {status}: {error}", file=sys.stderr)
                write_summary_csv(out)
                bar.update()
                if status == "failed" and environmental(error) and stopped is None:
                    rest = [r for r in (runs[k] for k in waiting) if run_status(r.run_dir) not in FINISHED]
                    if rest and all(needs(r.config) == needs(run.config) for r in rest):
                        stopped = (f"sweep stopped: {run.dir_name} failed for a reason of this machine "
                                   f"that the {len(rest)} remaining runs share: {error}")
                        waiting = []   # the runs under way end first: what they finish is kept
                if waiting:
                    feed()
    finally:
        bar.close()
    result.statuses = {run.dir_name: statuses[i] for i, run in enumerate(runs)}
    if stopped:
        raise ValueError(stopped)
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
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help=f"runs side by side, each its own process on its threads (default: the cores "
                             f"available here, {default_jobs()}; dist runs go one at a time)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch's intra-op threads of every run (default: the spec's, else "
                             f"{DEFAULT_THREADS}); speed, never results")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their state; train nothing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_fabric_arguments(parser)   # base config keys, as --set would set them


def run(args: argparse.Namespace, train: Optional[TrainFn] = None) -> int:
    overrides = {**parse_overrides(args.overrides), **fabric_overrides(args)}   # the fabric's flags: base keys
    if getattr(args, "threads", None) is not None:
        overrides["threads"] = args.threads
    jobs = check_jobs(default_jobs() if getattr(args, "jobs", None) is None else args.jobs)
    spec = load_spec(args.spec, overrides, parse_grid_overrides(args.grid))
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
    result = run_sweep(spec, out, k, n, train=train, progress=not args.no_progress, jobs=jobs)
    failed, diverged = result.count("failed"), result.count("diverged")
    print(f"sweep {spec.name}: {len(result.runs)} runs (shard {k}/{n}; {result.ran} run now, "
          f"{result.skipped} already done): {result.count('completed')} completed, "
          f"{diverged} diverged, {failed} failed")
    print(f"summary: {out / 'summary.csv'}")
    if failed:
        print(f"{failed} run(s) failed (their errors are in summary.csv); run the sweep again to "
              f"retry them; exit status {result.exit_code} (some runs failed)", file=sys.stderr)
    return result.exit_code
