"""What ``lossysim estimate`` costs: packet fates per second at real scale, and peak memory.

1. One training step of Llama-3.1-70B at tp 8, seq 4096, bf16, 1% Bernoulli loss, selective
   retransmission (nic irn): about 2e8 packet fates (320 all-reduces of 64 MiB). Target: <= 2 s.
   Printed: one step (its transfers built) and two, packets per second, and the ratio to drawing the
   same number of Bernoulli fates alone (torch.rand(n) < p and numpy's, in chunks).
2. A 20-setting grid (4 loss rates x drop, retransmit and deadline by irn and srd) of 10 steps each
   of Llama-3.1-8B at tp 8, seq 4096. Target: under a minute. ``--grid-steps 2`` runs fewer steps and
   says that it extrapolates to 10.
3. Peak resident memory of the process (torch's own import included). Target: < 1 GB.

    python benchmarks/bench_estimate.py [--grid-steps 10] [--skip-grid]
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lossysim.estimate import Workload, estimate, load  # noqa: E402
from lossysim.estimate.grid import grid  # noqa: E402

CHUNK = 1 << 24   # fates drawn at a time by the baselines: 16M floats, 64 MB


def bernoulli_alone(n: int, p: float) -> tuple[float, float]:
    """Seconds to draw n Bernoulli(p) fates with torch.rand and with numpy, in chunks."""
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for first in range(0, n, CHUNK):
        (torch.rand(min(CHUNK, n - first), generator=generator) < p).sum()
    torch_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for first in range(0, n, CHUNK):
        (rng.random(min(CHUNK, n - first), dtype=np.float32) < p).sum()
    return torch_s, time.perf_counter() - start


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid-steps", type=int, default=10)
    parser.add_argument("--skip-grid", action="store_true")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; peak memory after imports "
          f"{peak_mb():.0f} MB")

    shape = load("llama-3.1-70b")
    network = dict(ranks=8, loss="bernoulli:0.01", transport="retransmit", nic="irn")
    workload = Workload(seq=4096, micro_batch=1, dtype="bf16")
    one_step = None
    for steps in (1, 2):
        start = time.perf_counter()
        row = estimate(shape, network, workload, steps=steps)
        seconds = time.perf_counter() - start
        one_step = seconds if one_step is None else one_step
        fates = row["packets_sent"] * steps
        print(f"llama-3.1-70b tp 8, {steps} step(s): {seconds:.2f} s, {seconds / steps:.2f} s/step, "
              f"{fates:.3g} packet fates, {fates / seconds:.3g} fates/s "
              f"(slowdown {row['slowdown']:.4f}, {row['packets_lost']:.0f} lost per step)")
    print(f"TARGET 70B one step: {one_step:.2f} s (target <= 2 s: {'met' if one_step <= 2 else 'NOT met'})")
    torch_s, numpy_s = bernoulli_alone(int(fates), 0.01)
    print(f"the same {fates:.3g} Bernoulli fates alone: torch.rand {torch_s:.2f} s ({fates / torch_s:.3g}/s), "
          f"numpy {numpy_s:.2f} s ({fates / numpy_s:.3g}/s); estimate / torch.rand = {seconds / torch_s:.1f}x, "
          f"/ numpy = {seconds / numpy_s:.1f}x")
    print(f"peak memory so far {peak_mb():.0f} MB")

    if not args.skip_grid:
        shape = load("llama-3.1-8b")
        specs = grid({"loss": ["bernoulli:0.001", "bernoulli:0.005", "bernoulli:0.01", "bernoulli:0.05"],
                      "transport": ["drop,retransmit,deadline"], "nic": ["irn,srd"]},
                     ranks=8)
        total, fates = 0.0, 0.0
        for spec in specs:
            start = time.perf_counter()
            row = estimate(shape, spec, workload, args.grid_steps)
            seconds = time.perf_counter() - start
            total, fates = total + seconds, fates + row["packets_sent"] * args.grid_steps
            print(f"  {spec.loss.spec:16s} {spec.transport:10s} {spec.nic:5s} {seconds:6.1f} s "
                  f"({seconds / args.grid_steps:.2f} s/step)")
        print(f"llama-3.1-8b tp 8 grid: {len(specs)} settings x {args.grid_steps} steps in {total:.1f} s "
              f"({fates:.3g} fates, {fates / total:.3g}/s)")
        full = total * 10 / args.grid_steps
        note = "" if args.grid_steps == 10 else f" (EXTRAPOLATED from {args.grid_steps} steps per setting)"
        print(f"TARGET 8B grid of {len(specs)} settings x 10 steps: {full:.1f} s{note} "
              f"(target < 60 s: {'met' if full < 60 else 'NOT met'})")
    peak = peak_mb()
    print(f"TARGET peak memory {peak:.0f} MB (target < 1024 MB: {'met' if peak < 1024 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
