"""``lossysim estimate``: a grid of network settings for one model and workload, one row per setting.

Every network key takes several values (comma lists or repeated flags; loss and link specs contain
commas, so ``--loss``, ``--link-intra`` and ``--link-inter`` are repeated instead); the command runs
their product and writes ``estimate.csv``,
``estimate.json`` and, for several loss rates, ``slowdown.png`` (slowdown against loss rate, one
line per transport).
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
from ..timing import NIC_PRESETS
from ..util import one_of
from .shapes import NAMES, load
from .simulate import estimate
from .workload import DTYPES, Workload

# Network keys that take several values: flag -> NetworkSpec field.
GRID = {"--loss": "loss", "--transport": "transport", "--nic": "nic", "--algorithm": "algorithm",
        "--link-intra": "link_intra", "--link-inter": "link_inter", "--lossy-links": "lossy_links",
        "--recovery": "recovery", "--lossy": "lossy"}
WHOLE = ("loss", "link_intra", "link_inter")   # their specs contain commas: one value per flag
# The keys that take one of a fixed set of values, listed in their help.
CHOICES = {"transport": TRANSPORTS, "nic": tuple(NIC_PRESETS), "algorithm": ALGORITHMS, "lossy_links": LOSSY_LINKS,
           "recovery": RECOVERY_POLICIES, "lossy": LOSSY}
# Columns printed on the terminal (every column goes to the files).
SHOWN = ("loss", "transport", "nic", "algorithm", "loss_free_step_s", "step_mean_s", "step_p99_s", "slowdown",
         "comm_share", "packets_lost", "packets_resent", "elements_lost_fwd", "failures_per_1000_steps")


def add_arguments(parser) -> None:
    parser.add_argument("model", help=f"a named shape ({', '.join(NAMES)}), a config.json or a model directory")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step (default 1)")
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES), help="activation dtype (default bf16)")
    parser.add_argument("--tp-size", type=int, default=8, help="tensor-parallel degree (default 8)")
    parser.add_argument("--ranks-per-node", type=int, help="ranks per node (default: all on one node)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block's forward in backward (its all-reduces are charged again)")
    for flag, key in GRID.items():
        default = NetworkSpec.__dataclass_fields__[key].default
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
    workload = Workload(args.seq, args.micro_batch, args.dtype, args.activation_checkpointing)
    settings = grid({key: getattr(args, key) for key in GRID.values()}, ranks=args.tp_size,
                    ranks_per_node=args.ranks_per_node, seed=args.seed)
    if args.out:
        check_writable(args.out, "--out")   # before the grid: a long estimate must not be lost at the end
    rows = run_grid(args.model, settings, workload, args.steps, args.compute, progress=not args.no_progress)
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
             progress: bool = True) -> list[dict]:
    """One ``estimate`` row per setting, the shape loaded once."""
    shape = load(model)
    settings = list(settings)
    for spec in settings:
        shape.check_tp(spec.ranks)
    shape.check_seq(workload.seq)
    rows = []
    with tqdm(total=len(settings) * steps, desc=f"estimate {shape.name}", disable=not progress,
              dynamic_ncols=True) as bar:
        for spec in settings:
            rows.append(estimate(shape, spec, workload, steps, compute, tick=lambda: bar.update(1)))
    return rows


def write(rows: list[dict], out) -> list[Path]:
    """estimate.csv, estimate.json and, for several loss rates, slowdown.png in ``out``."""
    import pandas as pd
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "estimate.csv", out / "estimate.json"]
    atomic_write_text(paths[0], pd.DataFrame(rows).to_csv(index=False))
    atomic_write_text(paths[1], json.dumps(rows, indent=1) + "\n")
    plotted = plot(rows, out / "slowdown.png")
    return paths + ([plotted] if plotted else [])


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
