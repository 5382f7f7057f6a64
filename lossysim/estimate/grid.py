"""``lossysim estimate``: a grid of network settings for one model and workload, one row per setting.

Every network key takes several values (comma lists or repeated flags; loss and link specs contain
commas, so ``--loss``, ``--link-intra`` and ``--link-inter`` are repeated instead); the command runs
their product and writes ``estimate.csv``,
``estimate.json``, ``time_by_class.png`` (each setting's step stacked by traffic class) and, for
several loss rates, ``slowdown.png`` (slowdown against loss rate, one line per transport).
"""
from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Iterable, Optional

from tqdm.auto import tqdm

from ..io import atomic_write_text, check_writable, output_errors
from ..net import NetworkSpec
from ..net.algorithms import ALGORITHMS
from ..net.recovery import RECOVERY_POLICIES
from ..net.spec import LOSSY
from ..net.topology import LOSSY_LINKS
from ..net.transport import TRANSPORTS
from ..config import DP_MODES
from ..pp.schedule import SCHEDULES
from ..timing import NIC_PRESETS
from ..timing.congestion import CONGESTION
from ..util import one_of
from .shapes import NAMES, load
from .simulate import estimate
from .workload import DTYPES, Workload, layout_name

# Network keys that take several values: flag -> NetworkSpec field.
GRID = {"--loss": "loss", "--transport": "transport", "--nic": "nic", "--algorithm": "algorithm",
        "--link-intra": "link_intra", "--link-inter": "link_inter", "--lossy-links": "lossy_links",
        "--recovery": "recovery", "--lossy": "lossy", "--sockets": "sockets", "--congestion": "congestion"}
# An estimate sizes a job as NCCL would run it: its tuner's pick (training keeps the spec's ring, which
# its recorded runs name).
DEFAULTS = {"algorithm": "auto"}
WHOLE = ("loss", "link_intra", "link_inter")   # their specs contain commas: one value per flag
# The keys that take one of a fixed set of values, listed in their help.
CHOICES = {"transport": TRANSPORTS, "nic": tuple(NIC_PRESETS), "algorithm": ALGORITHMS, "lossy_links": LOSSY_LINKS,
           "recovery": RECOVERY_POLICIES, "lossy": LOSSY, "congestion": CONGESTION}
# Columns printed on the terminal (every column goes to the files).
SHOWN = ("loss", "transport", "nic", "algorithm", "loss_free_step_s", "step_mean_s", "step_p50_s", "step_p99_s",
         "step_p99_hi_s", "slowdown", "comm_share", "packets_lost", "packets_resent", "elements_lost_fwd",
         "failures_per_1000_steps")


def add_arguments(parser) -> None:
    parser.add_argument("model", help=f"a named shape ({', '.join(NAMES)}), a config.json or a model directory")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step (default 1)")
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES), help="activation dtype (default bf16)")
    parser.add_argument("--tp-size", type=int, default=8, help="tensor-parallel degree (default 8)")
    parser.add_argument("--ranks-per-node", "--gpus-per-node", dest="ranks_per_node", type=int,
                        help="GPUs (ranks) per node (default: a TP group to a node; tp alone: all on one node)")
    parser.add_argument("--nics-per-node", type=int, help="NICs a node's inter-node traffic spreads over "
                                                          "(default: one per GPU)")
    parser.add_argument("--payload-bytes", type=int, help="payload bytes of a packet (default "
                        f"{NetworkSpec.__dataclass_fields__['payload_bytes'].default}; RoCE at MTU 4096: 4096)")
    parser.add_argument("--pp-size", type=int, default=1, help="pipeline stages (default 1)")
    parser.add_argument("--pp-schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule (default 1f1b)")
    parser.add_argument("--pp-layout", help="blocks per stage, e.g. 9,10,10,11 (default: an even split)")
    parser.add_argument("--dp-size", type=int, default=1, help="data-parallel replicas (default 1)")
    parser.add_argument("--dp-mode", default="ddp", choices=DP_MODES, help="ddp or fsdp (default ddp)")
    parser.add_argument("--microbatches", type=int,
                        help="micro-batches per replica per step (default: from --global-batch, else pp size)")
    parser.add_argument("--global-batch", type=int,
                        help="sequences per step: micro-batch x microbatches x dp size, as Megatron derives it")
    parser.add_argument("--dp-bucket-mb", type=float, default=25.0, help="DDP bucket (FSDP unit) MiB (default 25)")
    parser.add_argument("--no-dp-overlap", dest="dp_overlap", action="store_false",
                        help="buckets wait for the backward to end (default: they overlap it, as DDP's do)")
    parser.add_argument("--grad-dtype", default="fp32", choices=tuple(DTYPES),
                        help="dtype gradients are reduced in (default fp32)")
    parser.add_argument("--sampled-groups", type=int,
                        help="lossy groups simulated per stage or boundary, the slowest of the rest drawn from "
                             "their times (0: every group; default: every group up to 64 GPUs, else 2)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block's forward in backward (its all-reduces are charged again)")
    for flag, key in GRID.items():
        default = DEFAULTS.get(key, NetworkSpec.__dataclass_fields__[key].default)
        if isinstance(default, tuple):
            default = "both"
        values = f": {one_of(CHOICES[key])}" if key in CHOICES else ""
        parser.add_argument(flag, dest=key, action="append", metavar="VALUE",
                            help=f"{key}{values} (repeatable{'' if key in WHOLE else ' or comma-separated'}; "
                                 f"default {default})")
    parser.add_argument("--seed", type=int, default=0, help="root of every call site's random stream")
    parser.add_argument("--compute", default="h100", help="GPU model for compute time (default h100)")
    parser.add_argument("--steps", type=int, default=10, help="simulated steps per setting (default 10)")
    parser.add_argument("--out", help="folder for estimate.csv, estimate.json and slowdown.png")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    workload = Workload(args.seq, args.micro_batch, args.dtype, args.activation_checkpointing, pp_size=args.pp_size,
                        dp_size=args.dp_size, dp_mode=args.dp_mode, microbatches=args.microbatches,
                        global_batch=args.global_batch, pp_schedule=args.pp_schedule, pp_layout=args.pp_layout,
                        dp_bucket_mb=args.dp_bucket_mb, dp_overlap=args.dp_overlap, grad_dtype=args.grad_dtype,
                        gpus_per_node=args.ranks_per_node, sampled_groups=args.sampled_groups)
    per_node = args.ranks_per_node
    if per_node is not None and per_node > args.tp_size * args.pp_size * args.dp_size:
        raise ValueError(f"ranks_per_node={per_node} is more GPUs than the layout's "
                         f"{layout_name(args.tp_size, args.pp_size, args.dp_size, None).split(' on ')[0]}")
    # A TP group's own network holds at most its tp ranks to a node; the mesh places the rest.
    settings = grid({key: getattr(args, key) or ([DEFAULTS[key]] if key in DEFAULTS else None) for key in GRID.values()},
                    ranks=args.tp_size,
                    ranks_per_node=None if per_node is None else min(per_node, args.tp_size),
                    nics_per_node=args.nics_per_node, seed=args.seed,
                    **({} if args.payload_bytes is None else {"payload_bytes": args.payload_bytes}))
    if args.out:
        check_writable(args.out, "--out")   # before the grid: a long estimate must not be lost at the end
    # Each finished row is saved at once, beside the results (never over a completed estimate's): a grid that
    # stops part way (a crash, Ctrl-C) keeps what it computed in estimate.partial.csv and .json.
    saved = (lambda done: _save(done, args.out, ".partial")) if args.out else None
    rows = run_grid(args.model, settings, workload, args.steps, args.compute, progress=not args.no_progress,
                    on_row=saved)
    print(rows[0]["layout"], file=sys.stderr)
    print(_table(rows))
    if args.out:
        with output_errors(args.out, "--out"):
            written = write(rows, args.out)
        for path in written:
            print(f"wrote {path}", file=sys.stderr)
    return 0


def grid(values: dict, **fixed) -> list[NetworkSpec]:
    """The product of every key's values (``values[key]``: None, or strings given once or comma-separated),
    each a checked NetworkSpec; ``fixed`` settings apply to all."""
    axes = {}
    for key, given in values.items():
        if not given:
            continue
        items = given if key in WHOLE else [v.strip() for value in given for v in value.split(",") if v.strip()]
        axes[key] = list(dict.fromkeys(items))
    keys, specs, refused = list(axes), [], []
    for combo in itertools.product(*axes.values()):
        chosen = dict(zip(keys, combo))
        if chosen.get("transport") == "drop" and "nic" in axes and chosen["nic"] != axes["nic"][0]:
            continue  # a dropped packet is never repaired: every nic gives the same row
        try:
            specs.append(NetworkSpec(**fixed, **chosen))
        except ValueError as err:  # e.g. deadline with a go-back-N nic: skip it, run the rest
            refused.append((chosen, err))
    if not specs and refused:
        raise refused[0][1]
    for chosen, err in refused:
        print(f"skipped {', '.join(f'{k}={v}' for k, v in chosen.items())}: {err}", file=sys.stderr)
    return specs


def run_grid(model: str, settings: Iterable[NetworkSpec], workload: Workload, steps: int, compute: str = "h100",
             progress: bool = True, on_row=None) -> list[dict]:
    """One ``estimate`` row per setting, the shape loaded once; ``on_row(rows so far)`` after each."""
    shape = load(model)
    settings = list(settings)
    for spec in settings:
        shape.check_tp(spec.ranks)
    shape.check_seq(workload.seq)
    rows = []
    with tqdm(total=len(settings) * steps, desc=f"estimate {shape.name}", disable=not progress,
              dynamic_ncols=True) as bar:
        for spec in settings:
            row = estimate(shape, spec, workload, steps, compute, tick=lambda: bar.update(1))
            rows.append({**row, **{key: getattr(spec, key) for key in ("sockets", "congestion") if key not in row}})
            if on_row is not None:
                on_row(rows)
    return rows


def _save(rows: list[dict], out, suffix: str = "") -> list[Path]:
    """``rows`` as estimate{suffix}.csv and .json in ``out``, atomically (a reader never sees half a file)."""
    import pandas as pd
    with output_errors(out, "--out"):
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / f"estimate{suffix}.csv", out / f"estimate{suffix}.json"]
        atomic_write_text(paths[0], pd.DataFrame(rows).to_csv(index=False))
        atomic_write_text(paths[1], json.dumps(rows, indent=1) + "\n")
    return paths


def write(rows: list[dict], out) -> list[Path]:
    """estimate.csv, estimate.json, time_by_class.png and, for several loss rates, slowdown.png in ``out``."""
    paths = _save(rows, out)
    out = Path(out)
    for partial in (out / "estimate.partial.csv", out / "estimate.partial.json"):   # complete now
        partial.unlink(missing_ok=True)
    plotted = plot(rows, out / "slowdown.png")
    return paths + ([plotted] if plotted else []) + [stacked(rows, out / "time_by_class.png")]


def stacked(rows: list[dict], path: Path) -> Path:
    """One bar per setting: the step's compute (and bubble), each traffic class's loss-free time added in
    turn (tp, pp, dp or fsdp), and the repairs, the whole bar the mean step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    parts = [key for key in ("compute", "tp", "pp", "dp", "fsdp", "repair")
             if any(f"stack_{key}_s" in row for row in rows)]
    labels = [f"{row['loss']}\n{_transport(row)}" for row in rows]
    fig, ax = plt.subplots(figsize=(max(6.4, 0.9 * len(rows) + 2), 4.6))
    bottom = [0.0] * len(rows)
    for key in parts:
        heights = [row.get(f"stack_{key}_s", 0.0) for row in rows]
        ax.bar(range(len(rows)), heights, bottom=bottom, label="compute and bubble" if key == "compute" else
               "repairs (all classes)" if key == "repair" else f"{key} (loss-free)")
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=30, ha="right")
    ax.set(ylabel="seconds per step", title=f"{rows[0]['model']}, {rows[0]['layout']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot(rows: list[dict], path: Path) -> Optional[Path]:
    """Slowdown against loss rate, one line per transport (and per any other key that varies)."""
    rates = sorted({row["loss_rate"] for row in rows})
    if len(rates) < 2:
        return None
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    varying = [key for key in GRID.values() if key not in ("loss",) and len({str(r[key]) for r in rows}) > 1]
    lines: dict[str, list] = {}
    for row in rows:
        label = _transport(row) + "".join(f", {k}={row[k]}" for k in varying if k not in ("transport", "nic"))
        lines.setdefault(label, []).append((row["loss_rate"], row["slowdown"]))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, points in lines.items():
        points.sort()
        ax.plot([p[0] * 100 for p in points], [p[1] for p in points], marker="o", label=label)
    row = rows[0]
    ax.set(xscale="log" if rates[0] > 0 else "linear", xlabel="loss rate (%)", ylabel="slowdown (step time / loss-free)",
           title=f"{row['model']}, tp {row['tp_size']}, seq {row['seq']} x {row['micro_batch']}, {row['dtype']}")
    if rates[0] > 0:
        ax.set_xticks([rate * 100 for rate in rates])
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _transport(row: dict) -> str:
    """retransmit is as its nic repairs; drop ignores the nic; deadline repairs selectively."""
    return f"retransmit ({row['nic']})" if row["transport"] == "retransmit" else row["transport"]


def _table(rows: list[dict]) -> str:
    def cell(value):
        return f"{value:.4g}" if isinstance(value, float) else str(value)
    # Any other grid key that varies is shown too, or two rows would read as one setting twice.
    varying = [k for k in GRID.values() if k not in SHOWN and len({str(row.get(k)) for row in rows}) > 1]
    shown = [*SHOWN[:4], *varying, *SHOWN[4:]]
    table = [shown] + [[cell(row[k]) for k in shown] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(shown))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in table)
