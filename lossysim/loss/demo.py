"""``lossysim demo``: sample each loss model and set what it does against what it was configured to do.

A few seconds long, it lets a user check the loss models before trusting a
training run to them: every observed loss rate comes with its distance from the
configured one in burst-aware standard errors (``rate_z``), so |rate_z| of a few
units is what a correct model gives.
"""
from __future__ import annotations

import argparse
import math

import pandas as pd
import torch

from ..util import stream_seed
from .models import LossModel
from .spec import parse_loss_model

DEMO_SPECS = (
    "none",
    "bernoulli:1%",
    "bernoulli:5%",
    "ge:rate=1%,burst=8",
    "ge:rate=5%,burst=20",
    "ge:p_gb=0.002,p_bg=0.05,loss_bad=0.8,loss_good=0.01",
)
_CHUNK = 1 << 22  # packets per draw: memory stays bounded for any --packets


def _packet_count(text: str) -> int:
    """Accept 1e6 as well as 1000000."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--packets={text!r} is not a number") from None
    if not value.is_integer() or value < 1:
        raise argparse.ArgumentTypeError(f"--packets={text} must be a whole number >= 1")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--packets", type=_packet_count, default=1_000_000,
                        help="packets sampled per model (default 1e6)")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed; each model's stream is derived from it and the spec")


def observe(model: LossModel, packets: int, generator: torch.Generator) -> tuple[int, int]:
    """(packets lost, runs of consecutive losses) over one chain of ``packets`` packets."""
    lost_total = runs = 0
    state, previous = None, torch.zeros(1, dtype=torch.bool)
    for start in range(0, packets, _CHUNK):
        lost, state = model.sample(min(_CHUNK, packets - start), generator, state)
        starts = lost & ~torch.cat([previous, lost[:-1]])  # a run continues across chunks
        lost_total += int(lost.sum())
        runs += int(starts.sum())
        previous = lost[-1:]
    return lost_total, runs


def table(packets: int, seed: int = 0, specs=DEMO_SPECS) -> pd.DataFrame:
    """One row per model: configured vs observed loss rate and mean burst."""
    rows = []
    for spec in specs:
        model = parse_loss_model(spec)
        generator = torch.Generator().manual_seed(stream_seed(seed, model.spec, "demo"))
        lost, runs = observe(model, packets, generator)
        rate = lost / packets
        se = math.sqrt(model.variance_per_packet / packets)
        rows.append({
            "model": spec,
            "packets": packets,
            "loss_rate": model.loss_rate,
            "observed_loss_rate": rate,
            "rate_z": (rate - model.loss_rate) / se if se > 0 else math.nan,
            "mean_burst": model.mean_burst,
            "observed_mean_burst": lost / runs if runs else 0.0,
        })
    return pd.DataFrame(rows)


def run(args: argparse.Namespace) -> int:
    df = table(args.packets, args.seed)
    print(f"{args.packets:,} packets per model, seed {args.seed}. "
          "rate_z = (observed - configured loss rate) / burst-aware standard error.")
    print(df.to_string(index=False, formatters={
        "loss_rate": "{:.6f}".format, "observed_loss_rate": "{:.6f}".format,
        "rate_z": "{:+.2f}".format, "mean_burst": "{:.3f}".format,
        "observed_mean_burst": "{:.3f}".format}))
    return 0
