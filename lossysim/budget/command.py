"""``lossysim budget``: per traffic family and recovery policy, the largest loss rate at which fine-tuning
keeps the eval perplexity within 1% of the paired loss-free run (``budget/search.py``).

    lossysim budget --out results/budget [--families all] [--steps 6,60] [--seeds 3] [--model smollm2-135m]

Every run is an ordinary run directory under ``<out>/runs`` (named as a sweep names them), so the
command resumes: a finished run is read, never trained again, and ``lossysim report <out>/runs``
reads them all. The settings default to the real profile's (``experiments/real.yaml``): SmolLM2-135M on
Python's documentation text, 4 pieces of 64 tokens a step, lr 1e-4, evaluated loss-free once at the
end on 48 held-out pieces (what training under loss left in the model). Writes ``budgets.csv`` (a row
per family, policy and length), ``points.csv`` (every rate measured: the paired change, its interval,
the mean training-loss gap), ``training.csv`` (every rate's training losses, lossy and loss-free, per seed
and step) and, for reading (``budget/report.py``), ``budget.png``, ``training.png`` and ``budgets.md``.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from ..config import ExperimentConfig, default_jobs, from_dict
from ..io import atomic_write_text, check_writable, read_jsonl, read_summary
from ..results.perplexity import paired_change
from ..run.pool import Pool, check_jobs
from ..run.sweep import Run, config_key, execute, normalise, record_lost, run_name, side_by_side
from .families import FAMILIES, POLICIES, Family, model_for, parse_families
from .report import markdown, plot, plot_training
from .search import GRID, Budget, Point, search
from .trade import NICS, Cost, step_cost

# What the budget sets per run itself: --set cannot change them
PER_RUN = ("loss", "recovery", "lossy_traffic", "steps", "seed", "eval_every", "log_every", "name", "out")
BASE = dict(model="smollm2-135m", dataset="pydoc", task="lm", tokenizer="auto", max_length=64,
            max_train_samples=None, max_eval_samples=48, eval_batch_size=16, dropout=0.0, eval_lossy=False,
            link_inter="roce-200g", link_intra="nvlink4", compute="h100", backend="sim", ranks_per_node=1,
            lossy_links="inter_node", batch_size=4, lr=1e-4, warmup_steps=1)


class Runner:
    """Runs (or reads back) one family's runs under ``out``: the paired loss-free and lossy runs."""

    def __init__(self, out: Path, base: dict, seeds: int, progress: bool = True):
        self.out, self.base, self.seeds, self.progress = out, base, seeds, progress
        self.trained = 0

    def config(self, family: Family, steps: int, seed: int, policy: str = "zero", rate: float = 0.0) -> ExperimentConfig:
        loss = f"bernoulli:{rate:.6g}" if rate > 0 else "none"
        # BASE sets no layout key, so one in base is the user's (--set dp_size=4): it wins over the family's
        layout = {k: v for k, v in family.layout.items() if k not in self.base}
        return normalise(from_dict({**self.base, **layout, "model": model_for(family, self.base["model"]),
                                    "lossy_traffic": family.lossy_traffic, "recovery": policy, "loss": loss,
                                    "steps": steps, "eval_every": steps, "log_every": 1, "seed": seed}))

    def _run(self, config: ExperimentConfig) -> Run:
        key = config_key(config)
        name = run_name(config, key)
        return Run(config=config.replace(name=name, out=str(self.out / "runs" / name)), key=key, dir_name=name)

    def completed(self, config: ExperimentConfig) -> bool:
        return (read_summary(self._run(config).run_dir) or {}).get("status") == "completed"

    def summary(self, config: ExperimentConfig) -> tuple[dict, Path]:
        run = self._run(config)
        summary = read_summary(run.run_dir)
        if summary is None or summary.get("status") != "completed":
            summary = execute(run, progress=self.progress)
            self.trained += 1
        return summary, run.run_dir

    def configs(self, family: Family, policy: str, steps: int, rate: float) -> list[ExperimentConfig]:
        """The runs ``measure`` reads: each seed's loss-free run and its run at ``rate``."""
        return [c for seed in range(self.seeds)
                for c in (self.config(family, steps, seed), self.config(family, steps, seed, policy, rate))]

    def train(self, configs: list[ExperimentConfig], jobs: int) -> None:
        """Train those of ``configs`` not completed yet, ``jobs`` at a time side by side (``run/pool.py``, as
        ``lossysim sweep --jobs`` does: a run's result never depends on what ran beside it); dist runs one at
        a time (torchrun's ranks take the machine)."""
        todo = {run.dir_name: run for run in map(self._run, configs) if not self.completed(run.config)}
        jobs = side_by_side(list(todo.values()), jobs)
        if jobs <= 1:
            for run in todo.values():
                self.summary(run.config)
            return
        with Pool(jobs, self.progress, record_lost, execute) as pool:
            for index, run in enumerate(todo.values()):
                pool.submit(index, run)
            while pool.pending:
                pool.next_done()
                self.trained += 1

    def perplexity_and_losses(self, config: ExperimentConfig) -> tuple[float, dict]:
        summary, run_dir = self.summary(config)
        if summary.get("status") != "completed":
            raise RuntimeError(f"run {run_dir.name} {summary.get('status')}: {summary.get('error', '')}")
        final = summary.get("final") or {}
        split = "eval" if "eval" in final else next(iter(final))
        losses = {int(r["step"]): float(r["loss"]) for r in read_jsonl(run_dir / "metrics.jsonl")
                  if r.get("split") == "train" and "loss" in r}
        return math.exp(float(final[split]["loss"])), losses

    def measure(self, family: Family, policy: str, steps: int, rate: float) -> tuple[Point, list[dict]]:
        """The paired eval-perplexity change at ``rate``, and per seed and step the training losses, lossy
        and loss-free, and their gap."""
        mine, theirs, training = [], [], []
        for seed in range(self.seeds):
            free, free_losses = self.perplexity_and_losses(self.config(family, steps, seed))
            lossy, lossy_losses = self.perplexity_and_losses(self.config(family, steps, seed, policy, rate))
            mine.append(lossy)
            theirs.append(free)
            training += [{"seed": seed, "step": s, "loss_free_loss": free_losses[s], "lossy_loss": loss,
                          "gap": loss - free_losses[s]} for s, loss in lossy_losses.items() if s in free_losses]
        change, half, pairs, _ = paired_change(mine, theirs)
        return Point(rate, change, half, pairs), training


def policies_for(runner: Runner, family: Family, steps: int, wanted) -> list[str]:
    """The policies of ``wanted`` that act on this family's traffic (the run accepts them)."""
    probe = runner.config(family, steps, 0, "zero", 0.01)
    return [p for p in wanted if p == "zero" or probe.accepts(recovery=p)]


def searches_of(runner: Runner, families, steps_list, policies) -> list[tuple[Family, int, str]]:
    """Every (family, length, policy) a budget table searches."""
    return [(family, steps, policy) for family in families for steps in steps_list
            for policy in policies_for(runner, family, steps, policies)]


def plan(out: Path, families, steps_list, policies, seeds: int, grid, refine: int, base: dict,
         jobs: int = 1) -> str:
    """What ``budgets`` would train, training nothing: each search replayed over the runs already completed
    in ``out`` (as a resumed budget reads them), its next rate and the most rates it may still measure (the
    rest of the grid and every bisection), the loss-free runs apart, and, from the runs done, how long the
    rest may take at ``jobs`` side by side."""
    runner = Runner(out, base, seeds, progress=False)
    done: dict[str, float] = {}   # run directory -> its wall time
    lines = [f"{'family':<13} {'policy':<17} {'steps':>5} {'measured':>8}  {'next':<8} {'at most still':>13}"]
    lossy = 0
    searches = searches_of(runner, families, steps_list, policies)
    for family, steps, policy in searches:
        coroutine, measured = search(grid, refine), 0
        rate = next(coroutine)
        try:
            while all(map(runner.completed, configs := runner.configs(family, policy, steps, rate))):
                done.update(_walls(runner, configs))
                point, _ = runner.measure(family, policy, steps, rate)
                measured += 1
                rate = coroutine.send(point)
        except StopIteration:
            rate = None
        left = 0 if rate is None else len(grid) + refine - measured
        lossy += left * seeds
        lines.append(f"{family.name:<13} {policy:<17} {steps:>5} {measured:>8}  "
                     f"{'done' if rate is None else f'{100 * rate:.3g}%':<8} {f'{left} rates':>13}")
    searched = {(family.name, steps) for family, steps, _ in searches}
    free = [runner.config(family, steps, seed) for family in families for steps in steps_list
            for seed in range(seeds) if (family.name, steps) in searched]
    free_left = sum(not runner.completed(c) for c in free)
    done.update(_walls(runner, [c for c in free if runner.completed(c)]))
    left = lossy + free_left
    lines.append(f"at most {left} runs still to train in {out} ({lossy} lossy, {seeds} a rate; "
                 f"{free_left} of the {len(free)} loss-free); trains nothing")
    if done and left:
        each = float(np.median(list(done.values())))
        lines.append(f"the {len(done)} runs done there took {each:.0f} s each (median): the rest, {jobs} at a time, "
                     f"up to about {left * each / jobs / 3600:.1f} h")
    return "\n".join(lines)


def _walls(runner: Runner, configs) -> dict[str, float]:
    """Each completed run's wall time, by its directory (a run two searches share counts once)."""
    return {run.dir_name: float(read_summary(run.run_dir).get("wall_time_s", math.nan))
            for run in map(runner._run, configs)}


def budgets(out: Path, families, steps_list, policies, seeds: int, grid, refine: int, base: dict,
            nics=NICS, progress: bool = True, jobs: int = 1) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Every (family, length, policy)'s search, advanced side by side: each round trains the runs every
    search asks for next together (``jobs`` at a time), then hands each search its point. Returns the
    table, the points and every measured rate's training losses step by step."""
    runner = Runner(out, base, seeds, progress)
    searches = searches_of(runner, families, steps_list, policies)
    coroutines = [search(grid, refine) for _ in searches]
    asked = {i: next(c) for i, c in enumerate(coroutines)}
    training: list[dict] = [{} for _ in searches]   # rate -> that rate's rows of ``measure``
    found: dict[int, Budget] = {}
    while asked:
        runner.train([c for i, rate in asked.items() for c in runner.configs(searches[i][0], searches[i][2],
                                                                             searches[i][1], rate)], jobs)
        for i, rate in list(asked.items()):
            family, steps, policy = searches[i]
            point, training[i][rate] = runner.measure(family, policy, steps, rate)
            try:
                asked[i] = coroutines[i].send(point)
            except StopIteration as done:
                found[i] = done.value
                del asked[i]
    rows, points, steps_rows = [], [], []
    prices: dict[tuple, Cost] = {}   # a family's policies often share a budget rate, and so a price
    # pricing takes seconds a row, TCP's DP row half a minute
    for i, (family, steps, policy) in enumerate(tqdm(searches, desc="pricing", disable=not progress or not nics)):
        budget = found[i]
        costs = {nic: _price(prices, family, budget.rate, nic) for nic in nics}
        rows.append({"family": family.name, "traffic": family.label, "policy": policy, "steps": steps,
                     "budget_rate": budget.rate, "failed_at": budget.failed_at,
                     "bracketed": budget.bracketed, "budget": budget.describe(), "seeds": seeds,
                     **{k: v for nic, cost in costs.items() for k, v in
                        ((f"retransmit_{nic}_pct", cost.pct), (f"retransmit_{nic}_pct_ci", cost.half_width),
                         (f"retransmit_{nic}_failures_per_1000_steps", cost.failures_per_1000_steps))}})
        points += [{"family": family.name, "policy": policy, "steps": steps, "rate": p.rate,
                    "change_pct": p.change_pct, "change_pct_ci": p.half_width, "upper_pct": p.upper,
                    "pairs": p.pairs, "passes": p.passes, "train_loss_gap": _mean_gap(training[i].get(p.rate))}
                   for p in budget.points]
        steps_rows += [{"family": family.name, "policy": policy, "steps": steps, "rate": rate, **row}
                       for rate in sorted(training[i]) for row in training[i][rate]]
    return pd.DataFrame(rows), pd.DataFrame(points), pd.DataFrame(steps_rows)


def _price(prices: dict, family: Family, rate, nic: str) -> Cost:
    """``step_cost`` once per family, rate and NIC; nothing to price without a rate."""
    if rate is None:
        return Cost(math.nan, math.nan, math.nan)
    key = (family.name, rate, nic)
    if key not in prices:
        prices[key] = step_cost(family, rate, nic)
    return prices[key]


def _mean_gap(rows) -> float:
    """The training-loss gap over every step and seed of one rate."""
    return float(np.mean([row["gap"] for row in rows])) if rows else math.nan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="folder for the runs and the budget table")
    parser.add_argument("--families", default="all", help=f"all, or some of {', '.join(f.name for f in FAMILIES)} "
                                                          "separated by commas")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="recovery policies to try (those that act on a family's traffic are kept; default "
                             f"{','.join(POLICIES)}; any recovery policy, e.g. hadamard+rescale)")
    parser.add_argument("--steps", default="6", help="optimizer steps per run, several separated by commas "
                                                     "(a budget per length, side by side)")
    parser.add_argument("--seeds", type=int, default=3, help="paired seeds per rate (>= 3)")
    parser.add_argument("--grid", default=",".join(f"{r:g}" for r in GRID), help="loss rates (scanned from the lowest up)")
    parser.add_argument("--refine", type=int, default=2, help="bisections between the last pass and first failure")
    parser.add_argument("--model", default=BASE["model"], help="the pretrained model")
    parser.add_argument("--nics", default=",".join(NICS),
                        help="NIC presets whose retransmission cost is set beside each budget (none: skip)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any run setting (device=cuda, batch_size=8, ...); a layout key (dp_size=4) over "
                             "every family's own")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help=f"runs side by side (default: the cores available here, {default_jobs()}); each "
                             "run's result is the same at any N")
    parser.add_argument("--dry-run", action="store_true",
                        help="each search's rates measured so far in --out, its next, and the most runs still "
                             "to train; train nothing")
    parser.add_argument("--no-progress", action="store_true")


def _numbers(text: str, kind, flag: str, what: str) -> list:
    """``text``'s numbers separated by commas, each read as ``kind``; a word that is none refused by name."""
    out = []
    for word in filter(None, (w.strip() for w in str(text).split(","))):
        try:
            out.append(kind(word))
        except ValueError:
            raise ValueError(f"{flag} {word}: {what}, separated by commas") from None
    return out


def run(args) -> int:
    from ..config.load import parse_overrides
    families = parse_families(args.families)
    steps_list = list(dict.fromkeys(_numbers(args.steps, int, "--steps", "optimizer steps, >= 1")))
    grid = sorted(set(_numbers(args.grid, float, "--grid", "loss rates in (0, 1)")))
    policies = [p.strip() for p in str(args.policies).split(",") if p.strip()]
    from ..net.recovery.registry import RECOVERY_POLICIES
    unknown = sorted(set(policies) - set(RECOVERY_POLICIES))
    if unknown:
        raise ValueError(f"--policies {','.join(unknown)}: must be some of {', '.join(RECOVERY_POLICIES)}")
    if args.seeds < 3:
        raise ValueError(f"--seeds {args.seeds}: a budget's interval needs at least 3 paired seeds")
    if not steps_list or min(steps_list) < 1:
        raise ValueError(f"--steps {args.steps}: optimizer steps, >= 1, separated by commas")
    nics = [] if args.nics == "none" else [n.strip() for n in str(args.nics).split(",") if n.strip()]
    from ..timing.retransmission import NIC_PRESETS
    bad = sorted(set(nics) - set(NIC_PRESETS))
    if bad:
        raise ValueError(f"--nics {','.join(bad)}: must be none or some of {', '.join(NIC_PRESETS)}")
    jobs = check_jobs(default_jobs() if args.jobs is None else args.jobs)
    settings = parse_overrides(args.set)
    fixed = sorted(set(settings) & set(PER_RUN))
    if fixed:
        raise ValueError(f"--set {fixed[0]}: the budget sets it for each run (--grid, --policies, --steps, --seeds)")
    base = {**BASE, "model": args.model, **settings}
    search(grid, args.refine)   # a bad grid or refine refused here, before --out is made
    if not searches_of(Runner(Path(args.out), base, args.seeds, progress=False), families, steps_list, policies):
        raise ValueError(f"--policies {','.join(policies)}: none acts on the traffic of "
                         f"{', '.join(f.name for f in families)} (zero acts on every family's)")
    out = Path(args.out)
    if args.dry_run:
        print(plan(out, families, steps_list, policies, args.seeds, grid, args.refine, base, jobs))
        return 0
    check_writable(out)
    table, points, training = budgets(out, families, steps_list, policies, args.seeds, grid, args.refine, base,
                                      nics, progress=not args.no_progress, jobs=jobs)
    atomic_write_text(out / "budgets.csv", table.to_csv(index=False))
    atomic_write_text(out / "points.csv", points.to_csv(index=False))
    atomic_write_text(out / "training.csv", training.to_csv(index=False))
    atomic_write_text(out / "budgets.md", markdown(table, points, base, args.seeds, nics, settings))
    if not points.empty:
        plot(points, out / "budget.png")
    if not training.empty:
        plot_training(training, out / "training.png")
    print(markdown(table, points, base, args.seeds, nics, settings))
    return 0
