"""``lossysim estimate --trace PATH [MODEL]``: the user's own job, from its profiler traces, through the grid
of network settings every estimate runs (docs/estimate.md, "Estimate your own job").

The layout comes from the usual flags (``--tp-size``, ``--pp-size``, ``--dp-size``, ``--ranks-per-node``,
...), through the same ``ExperimentConfig`` and ``Mesh`` as every estimate; with none of them, from the trace:
its world as one data-parallel group, or as a pipeline when it sends. The rows are run, saved and written as
every estimate's (``grid.run_rows``: estimate.csv, .json, the plots, partial rows while it runs, Ctrl-C),
with ``trace_read.json`` beside them: what was read.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm.auto import tqdm

from . import trace as traces
from .grid import GRID, config_of, grid, run_rows, workload_keys
from .trace_layout import Layout
from .trace_replay import Replay, traced_compute
from .simulate import estimate
from .workload import Workload


def run(args) -> int:
    if args.sampled_groups is not None:
        # the replay simulates every traced rank's groups (Replay's row: sampled_groups 0); nothing to sample
        raise ValueError(f"--sampled-groups {args.sampled_groups}: a trace's groups are the job's own, each "
                         "simulated, none sampled: drop --sampled-groups with --trace")
    trace = traces.read(args.trace)
    _default_layout(args, trace)
    base = config_of(args)
    layout = Layout(trace, base)             # the layout's check against the trace, before any work
    configs = grid(base, {key: getattr(args, key) for key in GRID.values()})
    read = {"trace": str(args.trace), **traces.describe(trace), "process_group_axes": layout.describe(trace)}
    name = args.model or Path(args.trace).name

    def rows_of(on_row) -> list[dict]:
        scale, compute = _compute(args, trace, base, read)
        first = Replay(trace, base, scale)
        read.update(per_class={cls: {"calls": calls, "bytes": nbytes}
                               for cls, (calls, nbytes) in first.per_class().items()},
                    not_simulated=first.not_simulated())
        _print_read(read)
        rows = []
        with tqdm(total=len(configs) * args.steps, desc=f"estimate {name}", disable=args.no_progress,
                  dynamic_ncols=True) as bar:
            for config in configs:
                row = Replay(trace, config, scale).run(args.steps, tick=lambda: bar.update(1))
                row.update(model=name, compute=compute)
                rows.append(row)
                on_row(rows)
        return rows
    return run_rows(args, configs, rows_of, extra=lambda: {"trace_read.json": json.dumps(read, indent=1) + "\n"})


def _compute(args, trace: traces.Trace, base, read: dict) -> tuple[float, str]:
    """The factor on the trace's compute and what the row calls it: the trace's own, or (a model named)
    the named model's modelled compute over the trace's."""
    if not args.model:
        read["compute"] = "trace"
        return 1.0, "trace"
    workload = Workload(args.seq, args.grad_dtype, **workload_keys(args))
    modelled = estimate(args.model, base.replace(loss="none"), workload, 1)["compute_s"]
    traced = traced_compute(trace, base)
    compute = f"modelled ({args.compute}, {args.model})"
    read.update(compute=compute, compute_traced_s=traced, compute_modelled_s=modelled)
    return modelled / traced, compute


def _default_layout(args, trace: traces.Trace) -> None:
    """With no layout flag, the trace's world is one data-parallel group, or a pipeline when it sends; a
    layout flag given leaves the others at 1."""
    if args.tp_size is None and args.pp_size is None and args.dp_size is None:
        sends = any(c.kind in ("send", "recv") for r in trace.ranks.values() for step in r.calls for c in step)
        args.pp_size, args.dp_size = (trace.world, 1) if sends else (1, trace.world)
    args.tp_size = 1 if args.tp_size is None else args.tp_size


def _print_read(read: dict) -> None:
    """What was read, in a few lines on stderr."""
    lines = [f"read {read['trace']}: {len(read['ranks_traced'])} of {read['world']} ranks"
             f"{' (its peers mirror it)' if read['mirrored'] else ''}, {read['backend']}, {read['steps']} steps; "
             f"compute: {read['compute']}"]
    for name, ranks in read["process_groups"].items():
        lines.append(f"  process group {name} {_ranks(ranks)}: {read['process_group_axes'][name]}")
    for row in read["calls_per_step"]:
        lines.append(f"  per step: {row['calls']:g} {row['collective']} on group {row['process_group']}, "
                     f"{row['bytes'] / 2**20:.3g} MiB")
    for cls, row in read["per_class"].items():
        lines.append(f"  class {cls}: {row['calls']:g} calls, {row['bytes'] / 2**20:.3g} MiB per step")
    for name, row in read["not_simulated"].items():
        lines.append(f"  not sent: {name}: {row['calls']:g} per step, {row['bytes']:g} B")
    unknown = read["not_understood"]
    lines.append("  not understood: " + ("none" if not unknown else
                                         "; ".join(f"{name} x{count}" for name, count in unknown.items())))
    print("\n".join(lines), file=sys.stderr)


def _ranks(ranks: list) -> str:
    return str(ranks) if len(ranks) <= 8 else f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)})"
