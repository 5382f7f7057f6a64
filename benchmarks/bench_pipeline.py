"""What pipeline stages cost the simulator, measured side by side (interleaved repeats, min and median).

A sim tp 1 x pp 2 training step of the tiny GPT-2 with 2 micro-batches against a sim tp 1 step on the
same 32-row batch: the same compute, plus the boundary's activation and gradient sends (lossy at 1% on
the inter-node link, so the send path draws, drops and counts packets) and the schedule's clock.
Target: <= 1.3x. A tp 1 step in the same 2 micro-batches runs beside them, to tell what cutting the batch
costs (two forwards and backwards of 16 rows) from what the stages add.

    python benchmarks/bench_pipeline.py [--device cuda] [--repeats 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_collectives import stepping, timed  # noqa: E402

from lossysim.config import ExperimentConfig  # noqa: E402
import threads_flag  # noqa: E402

BATCH = 32
TARGET = 1.3


def stepper(pp: int, device: torch.device, microbatches: int = 0):
    """One training step at a time of tp 1 x pp ``pp`` (micro-batches: ``pp`` unless given), a stage per node."""
    config = ExperimentConfig(model="tiny", dataset="synthetic", max_length=32, max_train_samples=800,
                              batch_size=BATCH, steps=10_000, dropout=0.0, tp_size=1, pp_size=pp, ranks_per_node=1,
                              microbatches=microbatches or None,
                              lossy_links="inter_node", lossy_traffic="pp_forward,pp_backward",
                              # one stage sends nothing: config refuses a loss nothing meets
                              loss="bernoulli:0.01" if pp > 1 else "none",
                              device=str(device), out=tempfile.mkdtemp()).validate()
    return stepping(config, device)


def side_by_side(steps, device, repeats: int) -> list[list[float]]:
    """Seconds of each of ``steps`` over ``repeats`` interleaved rounds (after 3 rounds of warm-up)."""
    for _ in range(3):
        for step in steps:
            step()
    times = [[] for _ in steps]
    for _ in range(repeats):
        for step, out in zip(steps, times):
            out.append(timed(step, device))
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=30)
    args = threads_flag.parse_args(parser)
    os.environ.setdefault("LOSSYSIM_CACHE", tempfile.mkdtemp())
    device = torch.device(args.device)
    torch.manual_seed(0)

    print(f"sim training step, tiny GPT-2, {BATCH} rows, on {device}; tp 1 x pp 2 (1f1b, 2 micro-batches, "
          "boundary lossy at 1%) against tp 1")
    # The third: tp 1 in the same 2 micro-batches (gradient accumulation), to tell what cutting the batch
    # costs from what the stages, their sends and the schedule's clock cost.
    staged, plain, split = side_by_side([stepper(2, device), stepper(1, device), stepper(1, device, 2)], device,
                                        args.repeats)
    for name, times in (("tp1 x pp2", staged), ("tp1", plain), ("tp1, m=2", split)):
        print(f"   {name:<10} min {min(times) * 1e3:7.2f} ms  median {statistics.median(times) * 1e3:7.2f} ms")
    for name, base, target in (("tp1", plain, TARGET), ("tp1, m=2", split, None)):
        by_min, by_median = min(staged) / min(base), statistics.median(staged) / statistics.median(base)
        pairs = statistics.median(a / b for a, b in zip(staged, base))
        verdict = f" (target <= {target}: {'met' if by_median <= target else 'missed'})" if target else ""
        print(f"   tp1 x pp2 / {name}: of the minimums {by_min:.2f}, of the medians {by_median:.2f}, "
              f"median of the rounds' {pairs:.2f}{verdict}")


if __name__ == "__main__":
    main()
