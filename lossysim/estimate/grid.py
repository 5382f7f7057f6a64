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
from typing import Callable, Iterable, Optional

from tqdm.auto import tqdm

from .. import axes
from ..config import DEFAULT_THREADS, ExperimentConfig, coerce, set_threads
from ..config.fabric import add_fabric_arguments, fabric_overrides
from . import events as link_events
from ..io import atomic_write_text, check_writable, output_errors
from ..mesh import DEFAULT_ORDER
from ..net.algorithms import ALGORITHMS
from ..net.recovery import RECOVERY_POLICIES
from ..net.spec import LOSSY, MAX_PAYLOAD_BYTES
from ..net.topology import LOSSY_LINKS
from ..net.transport import TRANSPORTS
from ..timing import NIC_PRESETS
from ..timing.congestion import CONGESTION
from ..traffic import KINDS
from ..util import one_of
from .accounting import CLASSES
from .shapes import NAMES, load
from .simulate import estimate
from .workload import DTYPES, Workload, job_config

# Network keys that take several values: flag -> config key.
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
    parser.add_argument("model", nargs="?", help=f"a named shape ({', '.join(NAMES)}), a config.json or a model "
                        "directory (with --trace: optional, its modelled compute replaces the trace's)")
    parser.add_argument("--trace", help="estimate your own job: its torch.profiler traces (a folder, one per rank, "
                                        "or one file whose peers mirror it); docs/estimate.md")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step (default 1)")
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES), help="activation dtype (default bf16)")
    parser.add_argument("--ranks-per-node", "--gpus-per-node", dest="ranks_per_node", type=int,
                        help="GPUs (ranks) per node (default: a TP group to a node; tp alone: all on one node)")
    parser.add_argument("--nics-per-node", type=int, help="NICs a node's inter-node traffic spreads over "
                                                          "(default: one per GPU)")
    parser.add_argument("--payload-bytes", type=int, help="payload bytes of a packet (default "
                        f"{ExperimentConfig.__dataclass_fields__['payload_bytes'].default}; RoCE at MTU 4096: 4096; "
                        f"at most {MAX_PAYLOAD_BYTES}, a jumbo frame)")
    for setting in axes.settings():   # every axis's flags, from its declaration
        _add_setting(parser, setting)
    for flag in axes.workload_flags():   # and their estimate-only settings
        parser.add_argument(flag.flag, dest=flag.field, type=flag.type, default=flag.default, help=flag.help)
    parser.add_argument("--global-batch", type=int,
                        help="sequences per step: micro-batch x microbatches x dp size, as Megatron derives it")
    parser.add_argument("--grad-dtype", default="fp32", choices=tuple(DTYPES),
                        help="dtype gradients are reduced in (default fp32)")
    parser.add_argument("--sampled-groups", type=int,
                        help="lossy groups simulated per stage or boundary, the slowest of the rest drawn from "
                             "their times (0: every group; default: every group up to 64 GPUs, else 2)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block's forward in backward (its all-reduces are charged again)")
    parser.add_argument("--parallel-order", default=DEFAULT_ORDER,
                        help=f"how global ranks are laid out, innermost first (default {DEFAULT_ORDER}, Megatron's)")
    parser.add_argument("--lossy-traffic", default="all",
                        help=f"which traffic can lose packets: all, or some of {', '.join(KINDS)} (default all)")
    for flag, key in GRID.items():
        default = DEFAULTS.get(key, ExperimentConfig.__dataclass_fields__[key].default)
        if isinstance(default, tuple):
            default = "both"
        values = f": {one_of(CHOICES[key])}" if key in CHOICES else ""
        parser.add_argument(flag, dest=key, action="append", metavar="VALUE",
                            help=f"{key}{values} (repeatable{'' if key in WHOLE else ' or comma-separated'}; "
                                 f"default {default})")
    parser.add_argument("--seed", type=int, default=0, help="root of every call site's random stream")
    parser.add_argument("--compute", default="h100", help="GPU model: compute time, and NCCL's tables and NVLS as in "
                                                            "training (default h100)")
    parser.add_argument("--steps", type=int, default=10, help="simulated steps per setting (default 10)")
    parser.add_argument("--out", help="folder for estimate.csv, estimate.json and slowdown.png")
    parser.add_argument("--threads", type=int, help=f"torch's intra-op threads (default {DEFAULT_THREADS}); speed, "
                                                     "never results; each row records it")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_fabric_arguments(parser)


def _add_setting(parser, setting) -> None:
    """A setting's ``lossysim estimate`` flag (``Setting.estimate``; none without one)."""
    flag = setting.estimate
    if flag is None:
        return
    name = flag.name or setting.flag or f"--{setting.field.replace('_', '-')}"
    if setting.type is bool:   # a switch: given, the other value than the default
        parser.add_argument(name, dest=setting.field, action="store_false" if flag.default else "store_true",
                            help=flag.help)
        return
    kind = next((t for t in getattr(setting.type, "__args__", (setting.type,)) if t is not type(None)), str)
    parser.add_argument(name, dest=setting.field, type=kind, default=flag.default, help=flag.help,
                        **({"choices": setting.choices} if setting.choices else {}))


def axis_keys(args) -> dict:
    """Every axis's settings as the flags give them (a flag left out: its ``unset``, else the default)."""
    keys = {}
    for setting in axes.settings():
        if setting.estimate is not None:
            value = getattr(args, setting.field, None)
            unset = setting.default if setting.estimate.unset is None else setting.estimate.unset
            keys[setting.field] = unset if value is None else value
    return keys


def workload_keys(args) -> dict:
    """Every axis's estimate-only settings as the flags give them (``Workload``'s fields)."""
    return {flag.field: getattr(args, flag.field) for flag in axes.workload_flags()}


def run(args) -> int:
    """A named shape's (or a config.json's) grid; ``command.run`` sends ``--trace`` to ``traced.run``."""
    if not args.model:
        raise ValueError("name a model (a named shape, a config.json or a model directory), or give --trace")
    workload = Workload(args.seq, args.grad_dtype, args.sampled_groups, **workload_keys(args))
    configs = grid(config_of(args), {key: getattr(args, key) for key in GRID.values()})
    return run_rows(args, configs, lambda on_row: run_grid(args.model, configs, workload, args.steps,
                                                           progress=not args.no_progress, on_row=on_row))


def run_rows(args, configs: list, rows_of: Callable, extra: Optional[Callable[[], dict]] = None) -> int:
    """Every estimate's run of a grid: ``rows_of(on_row)`` computes the rows of ``configs``, calling
    ``on_row(rows so far)`` after each; the table, and with ``--out`` the files (``extra()``: more files,
    name -> text, written beside them)."""
    threads = set_threads(DEFAULT_THREADS if getattr(args, "threads", None) is None else args.threads)
    if args.out:
        check_writable(args.out, "--out")   # before the grid: a long estimate must not be lost at the end
        _check_no_partial(Path(args.out))
    # Each finished row is saved at once, beside the results (never over a completed estimate's): a grid that
    # stops part way (a crash, Ctrl-C) keeps what it computed in estimate.partial.csv and .json.
    finished = []

    def saved(done: list[dict]) -> None:
        for row in done:
            row["threads"] = threads
        if args.out:
            _save(done, args.out, PARTIAL)
        finished[:] = done
    try:
        rows = rows_of(saved)
    except KeyboardInterrupt:
        kept = (f"; their rows are in {Path(args.out) / f'estimate{PARTIAL}.csv'} and .json" if args.out and finished
                else "")
        print(f"lossysim estimate: interrupted after {len(finished)} of {len(configs)} settings{kept}",
              file=sys.stderr)
        return 130
    for row in rows:
        row["threads"] = threads   # how it ran, beside what it computed
    print(rows[0]["layout"], file=sys.stderr)
    print(_table(rows))
    if rows[0].get("fabric_slowdown"):   # on a fabric: each class's loss-free time stretched by its busiest cable
        r, qps = rows[0], rows[0]["qps_per_connection"]
        print(f"fabric slowdown ({r['fabric']}, {r['routing']}, {qps} QP{'s' * (qps != 1)} a connection): "
              + (r["fabric_slowdown"] if r.get("shared_cables", True) else "not charged (shared_cables false)"))
    for row in rows:   # on a fabric: who crosses each lossy cable (every row's, in estimate.json)
        if row.get("blast_radius"):
            print(f"blast radius ({row['loss']}, {row['transport']}, {row['nic']}): {row['blast_radius']}")
        if row.get("event_flows") is not None:
            print(link_events.report(row))
    if args.out:
        with output_errors(args.out, "--out"):
            written = write(rows, args.out)
            for name, text in (extra() if extra else {}).items():
                atomic_write_text(Path(args.out) / name, text)
                written.append(Path(args.out) / name)
        for path in written:
            print(f"wrote {path}", file=sys.stderr)
    return 0


def config_of(args) -> ExperimentConfig:
    """The training config the flags describe (the first value of every grid key), validated as ``lossysim
    train`` validates it: the same layout, micro-batch and network rules, the same one-line errors."""
    for axis in axes.AXES:   # each axis's own checks of its flags (``Axis.estimate_check``)
        if axis.estimate_check is not None:
            axis.estimate_check(args)
    if args.steps < 1:   # before any progress bar starts
        raise ValueError(f"--steps {args.steps} must be >= 1")
    if args.microbatches is not None and args.microbatches < 1:   # before the batch it multiplies is refused
        raise ValueError(f"--microbatches {args.microbatches} must be >= 1 (or left out: from --global-batch, else "
                         "the pp size)")
    keys = dict(**axis_keys(args), max_length=args.seq, activation_checkpointing=args.activation_checkpointing,
                ranks_per_node=args.ranks_per_node, nics_per_node=args.nics_per_node, compute=args.compute, seed=args.seed,
                parallel_order=args.parallel_order, lossy_traffic=args.lossy_traffic, **DEFAULTS)
    if args.payload_bytes is not None:
        keys["payload_bytes"] = args.payload_bytes
    keys.update(coerce(fabric_overrides(args)))
    return job_config(args.model or "tiny", args.micro_batch, args.dtype, args.global_batch, **keys)


PARTIAL = ".partial"   # the rows of a grid not yet complete: estimate.partial.csv and .json


def _check_no_partial(out: Path) -> None:
    """An interrupted grid's rows are the only copy of what it computed: another grid must not replace them."""
    found = [p.name for p in (out / f"estimate{PARTIAL}.csv", out / f"estimate{PARTIAL}.json") if p.is_file()]
    if found:
        raise ValueError(f"--out {out} holds the rows of an interrupted estimate ({' and '.join(found)}): move or "
                         "delete them to run another estimate there, or choose another --out")


def grid(base: ExperimentConfig, values: dict) -> list[ExperimentConfig]:
    """The product of every network key's values (``values[key]``: None, or strings given once or
    comma-separated) over ``base``, each a validated config. A combination the config refuses (deadline
    with a go-back-N nic) is skipped with a note; a value that no combination accepts (an unknown name,
    NVLS on a GPU without it) is an error, the config's own, as in training."""
    axes = {}
    for key, given in values.items():
        if not given:
            continue
        items = given if key in WHOLE else [v.strip() for value in given for v in value.split(",") if v.strip()]
        axes[key] = list(dict.fromkeys(items))
    keys, configs, refused, accepted = list(axes), [], [], set()
    for combo in itertools.product(*axes.values()):
        chosen = dict(zip(keys, combo))
        try:
            config = base.replace(**chosen)
        except ValueError as err:
            refused.append((chosen, err))
            continue
        accepted.update(chosen.items())
        if chosen.get("transport") == "drop" and "nic" in axes and chosen["nic"] != axes["nic"][0]:
            continue  # a dropped packet is never repaired: every nic gives the same row
        configs.append(config)
    for chosen, err in refused:
        if not configs or any(item not in accepted for item in chosen.items()):
            raise err
    for chosen, err in refused:
        print(f"skipped {', '.join(f'{k}={v}' for k, v in chosen.items())}: {err}", file=sys.stderr)
    return configs


def run_grid(model: str, configs: Iterable[ExperimentConfig], workload: Workload, steps: int,
             progress: bool = True, on_row=None) -> list[dict]:
    """One ``estimate`` row per config, the shape loaded once; ``on_row(rows so far)`` after each."""
    shape = load(model)
    configs = list(configs)
    for config in configs:
        shape.check_tp(config.tp_size)
    shape.check_seq(workload.seq)
    rows = []
    with tqdm(total=len(configs) * steps, desc=f"estimate {shape.name}", disable=not progress,
              dynamic_ncols=True) as bar:
        for config in configs:
            rows.append(estimate(shape, config, workload, steps, tick=lambda: bar.update(1)))
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
    for partial in (out / f"estimate{PARTIAL}.csv", out / f"estimate{PARTIAL}.json"):   # complete now
        partial.unlink(missing_ok=True)
    plotted = plot(rows, out / "slowdown.png")
    if plotted is None:   # an earlier estimate's plot must not pass for this one's
        (out / "slowdown.png").unlink(missing_ok=True)
    return paths + ([plotted] if plotted else []) + [stacked(rows, out / "time_by_class.png")]


def stacked(rows: list[dict], path: Path) -> Path:
    """One bar per setting: the step's compute (and bubble), each traffic class's loss-free time added in
    turn (tp, pp, dp or fsdp), and the repairs, the whole bar the mean step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    parts = [key for key in ("compute", *CLASSES, "repair")
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
