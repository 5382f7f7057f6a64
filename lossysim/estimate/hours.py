"""``lossysim estimate --hours H``: what H hours of cable failures cost the job on its fabric
(``fabric.reliability``): the expected cable failures, interruptions, GPU-hours lost and effective
training time, printed after the step's table (and ``hours.json`` with ``--out``). The fabric is
``--fabric`` where the command has one, else the smallest SuperPOD that holds the job's nodes (said
so in the output). With ``--link-event`` the given schedule over the hours counts too, beside the
failures the MTTF draws (``hours_events``: its ``event_*`` figures, and its share of the totals). Without
``--hours`` nothing changes.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..axes import AXES
from ..fabric.events import REROUTE_S
from ..fabric.presets import SU_NODES, SUPERPOD_SU, parse_fabric, superpod
from ..fabric.reliability import CABLE_MTTF_H, REPAIR_H, expected_cost, llama3_rates
from ..io import atomic_write_text, output_errors
from ..mesh import CARVED
from ..timing.retransmission import NIC_PRESETS, outage_waits
from . import hours_events

DGX_GPUS = 8


def add_arguments(parser) -> None:
    group = parser.add_argument_group("a run's cable failures (docs/fabric.md)")
    group.add_argument("--hours", type=float, help="also estimate this many hours of cable failures on the job's "
                       "fabric: interruptions, GPU-hours lost, effective training time")
    group.add_argument("--checkpoint-every-s", type=float, default=1800.0,
                       help="seconds between checkpoints (default 1800, an assumption): half is lost per interruption")
    group.add_argument("--restart-s", type=float, default=300.0, help="seconds a restart takes (default 300)")
    group.add_argument("--cable-mttf-h", type=float, default=CABLE_MTTF_H,
                       help=f"mean hours between one cable's failures (default {CABLE_MTTF_H:.3g}: Llama 3's 35 "
                            "switch or cable interruptions over a 16,384-GPU fabric's cables)")
    group.add_argument("--repair-h", type=float, default=REPAIR_H, help=f"hours a cable stays down (default {REPAIR_H:g})")
    # --reroute and --ib-timeout are the fabric's settings (config/fabric.py): link events read them too
    group.add_argument("--other-interruptions-per-day", default="0",
                       help="interruptions from anything but cables, a day (default 0; llama3: Llama 3's other "
                            f"{llama3_rates()['other_per_day']:.2f})")


def check(args) -> None:
    """Refuse what ``--hours`` cannot do before the grid runs."""
    if args.trace and getattr(args, "link_event", None):   # the replay has no step to run the events through
        raise ValueError("--link-event takes a named shape's layout, not --trace")
    if getattr(args, "hours", None) is None:
        return
    if args.trace:
        raise ValueError("--hours takes a named shape's layout (--tp-size, --pp-size, --dp-size), not --trace")
    if not args.hours > 0 or math.isinf(args.hours):
        raise ValueError(f"--hours {args.hours:g} must be a number of hours > 0")
    _other(args.other_interruptions_per_day)
    if given(args) and getattr(args, "fabric", None):   # (no fabric: the grid's own one line says so)
        hours_events.schedule(given(args), parse_fabric(args.fabric), args.hours)


def given(args) -> str:
    """``--link-event``'s entries joined as the config keeps them ("" without)."""
    entries = getattr(args, "link_event", None)
    return ";".join(entries) if isinstance(entries, list) else str(entries or "")


def _other(text) -> float:
    if str(text).strip().lower() == "llama3":
        return llama3_rates()["other_per_day"]
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or math.isinf(value):
        raise ValueError(f"--other-interruptions-per-day {text!r} must be a number >= 0 or llama3")
    return value


def figures(args) -> dict:
    """The expected figures of ``args.hours`` for the layout the flags give."""
    per_node = args.ranks_per_node or DGX_GPUS
    # the dense world: every mesh axis's size but those carved out of the others (a flag left out: TP over
    # a DGX node's 8 GPUs, every other axis 1)
    gpus = math.prod(getattr(args, a.size, None) or (DGX_GPUS if a.name == "tp" else 1)
                     for a in AXES if a.mesh is not None and a.mesh not in CARVED)
    nodes = max(1, -(-gpus // per_node))
    fabric = parse_fabric(getattr(args, "fabric", None))
    chosen = "given"
    if fabric is None:
        fits = [su for su in SUPERPOD_SU if su * SU_NODES >= nodes]
        if not fits:
            raise ValueError(f"--hours: {nodes} nodes need more than the largest SuperPOD ({SUPERPOD_SU[-1]} SU); "
                             "give a fabric")
        fabric, chosen = superpod(fits[0]), "the smallest SuperPOD that holds the job"
    reroute, ib_timeout = args.reroute or "ecmp", int(args.ib_timeout or 20)
    waits = outage_waits(NIC_PRESETS["roce-gbn-timeout"], ib_timeout)
    cost = expected_cost(fabric, args.hours, nodes=nodes, gpus=gpus, mttf_h=args.cable_mttf_h,
                         repair_h=args.repair_h, reroute_s=REROUTE_S[reroute], waits=waits,
                         restart_s=args.restart_s, checkpoint_s=args.checkpoint_every_s,
                         other_per_day=_other(args.other_interruptions_per_day))
    row = {"fabric": fabric.name, "fabric_chosen": chosen, "nodes": nodes, "reroute": reroute,
           "ib_timeout": ib_timeout, "checkpoint_every_s": args.checkpoint_every_s, "restart_s": args.restart_s,
           "cable_mttf_h": args.cable_mttf_h, "repair_h": args.repair_h, **cost.row(),
           "llama3_interruptions_per_day": llama3_rates()["all_per_day"]}
    if given(args).strip():
        row.update(_with_events(args, row, fabric, nodes, waits))
    return row


def _with_events(args, row: dict, fabric, nodes: int, waits) -> dict:
    """The given schedule's figures, and the totals counting them beside the MTTF's."""
    events = hours_events.cost(hours_events.schedule(given(args), fabric, args.hours), nodes,
                               REROUTE_S[row["reroute"]], waits, args.restart_s, args.checkpoint_every_s)
    mttf_lost_s = row["gpu_hours_lost"] * 3600 / row["gpus"]
    lost_s = mttf_lost_s + events.lost_s
    return {"link_event": given(args), **events.row(), "interruptions": row["interruptions"] + events.interruptions,
            "gpu_hours_lost": row["gpus"] * lost_s / 3600, "effective": max(0.0, 1 - lost_s / (args.hours * 3600))}


def report(args) -> None:
    """Print the figures (and write hours.json with ``--out``)."""
    row = figures(args)
    print(f"{row['hours']:g} h on {row['fabric']} ({row['fabric_chosen']}), {row['gpus']} GPUs: "
          f"{row['cable_failures']:.3g} cable failures, {row['interruptions']:.3g} interruptions"
          + (f" (the link events' {row['event_outages']} outages: {row['event_interruptions']} interruptions, "
             f"{row['event_stalls']} stalls of {row['event_stalled_s']:.4g} s)" if "event_outages" in row else "") +
          f", {row['routed_around']:.3g} routed around ({row['reroute']}), {row['gpu_hours_lost']:.4g} GPU-hours lost, "
          f"effective training time {100 * row['effective']:.1f}% (Llama 3: {row['llama3_interruptions_per_day']:.2f} "
          "interruptions a day of all causes, over 90% effective)")
    if args.out:
        with output_errors(args.out, "--out"):
            atomic_write_text(Path(args.out) / "hours.json", json.dumps(row, indent=1) + "\n")
