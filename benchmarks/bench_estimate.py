"""What ``lossysim estimate`` costs for a whole job: seconds, packet fates per second, peak memory.

1. One step of Llama-3.1-70B on 32 nodes x 8 H100 (tp 8 x pp 4 x dp 8, 8 RoCE 400G NICs per node,
   loss only between nodes, 4096-byte payloads, seq 4096, 16 micro-batches), 1% Bernoulli loss,
   ``retransmit`` by ``irn``. Target: <= 10 s and <= 2 GB on 2 cores. Printed: the step, packet fates per
   second, and the ratio to drawing the same number of Bernoulli fates alone (torch.rand(n) < p).
2. The same step under Gilbert-Elliott loss at the same mean rate (bursts of 4). Target: <= 3x the
   Bernoulli step.
3. ``--405b``: one step of Llama 3 405B's published layout (tp 8 x pp 16 x dp 128 = 16,384 GPUs, seq
   8192, global batch 2048, stages of 7, 8 x 14, 7 blocks). Goal: under 5 minutes.

    python benchmarks/bench_estimate.py [--steps 1] [--skip-bursty] [--405b]
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lossysim.estimate import Workload, estimate, job_config, load  # noqa: E402

CHUNK = 1 << 24   # fates drawn at a time by the baseline: 16M floats, 64 MB
NETWORK = dict(tp_size=8, transport="retransmit", nic="irn", ranks_per_node=8, nics_per_node=8,
               link_inter="roce-400g", lossy_links="inter_node", payload_bytes=4096)


def bernoulli_alone(n: int, p: float) -> float:
    """Seconds to draw n Bernoulli(p) fates with torch.rand, in chunks."""
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for first in range(0, n, CHUNK):
        (torch.rand(min(CHUNK, n - first), generator=generator) < p).sum()
    return time.perf_counter() - start


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(shape, loss: str, layout: dict, workload: Workload, steps: int) -> tuple[float, dict]:
    start = time.perf_counter()
    row = estimate(shape, job_config(shape.name, loss=loss, **layout, **NETWORK), workload, steps=steps)
    return (time.perf_counter() - start) / steps, row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--skip-bursty", action="store_true")
    parser.add_argument("--405b", dest="big", action="store_true", help="also Llama 3 405B's layout")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; peak memory after imports "
          f"{peak_mb():.0f} MB")

    shape = load("llama-3.1-70b")
    layout, workload = dict(pp_size=4, dp_size=8, microbatches=16), Workload(seq=4096)
    seconds, row = timed(shape, "bernoulli:0.01", layout, workload, args.steps)
    # TP stays on NVLink: its packets are counted from one group, never drawn; pp's and dp's are drawn for
    # the sampled groups (packets_drawn), and the job's counts scaled from them.
    fates = row["packets_drawn"]
    print(f"llama-3.1-70b {row['layout']}, 1% bernoulli, irn, {row['sampled_groups']} groups simulated per stage "
          f"or boundary: {seconds:.1f} s/step, {fates:.3g} packet fates drawn (the job's: pp "
          f"{row['pp_packets_sent']:.3g}, dp {row['dp_packets_sent']:.3g}; tp's {row['tp_packets_sent']:.3g} counted, "
          f"loss-free), {fates / seconds:.3g} fates/s; slowdown {row['slowdown']:.4f}")
    alone = bernoulli_alone(int(fates), 0.01)
    print(f"the same {fates:.3g} Bernoulli fates alone with torch.rand: {alone:.1f} s ({fates / alone:.3g}/s); "
          f"estimate / drawing alone = {seconds / alone:.1f}x")
    peak = peak_mb()
    print(f"TARGET 70B step: {seconds:.1f} s (<= 10 s: {'met' if seconds <= 10 else 'NOT met'}); peak memory "
          f"{peak:.0f} MB (<= 2048 MB: {'met' if peak <= 2048 else 'NOT met'})")

    if not args.skip_bursty:
        bursty, row = timed(shape, "ge:rate=0.01,burst=4", layout, workload, args.steps)
        print(f"TARGET bursty (Gilbert-Elliott, 1%, bursts of 4): {bursty:.1f} s/step = {bursty / seconds:.2f}x "
              f"Bernoulli (<= 3x: {'met' if bursty <= 3 * seconds else 'NOT met'}); slowdown {row['slowdown']:.4f}")

    if args.big:
        big = load("llama-3.1-405b")
        layout = dict(pp_size=16, dp_size=128, global_batch=2048, pp_layout=",".join(["7"] + ["8"] * 14 + ["7"]))
        seconds, row = timed(big, "bernoulli:0.01", layout, Workload(seq=8192), 1)
        print(f"GOAL 405B {row['layout']}: {seconds:.0f} s for one step (< 300 s: "
              f"{'met' if seconds < 300 else 'NOT met'}); {row['packets_drawn']:.3g} fates drawn, slowdown "
              f"{row['slowdown']:.4f}")
    print(f"peak memory {peak_mb():.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
