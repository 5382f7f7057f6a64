"""One estimated step of a 2,048-GPU job (Llama-3.1-70B at tp 8 x pp 4 x dp 64 on 256 nodes of 8) with one
bad leaf-spine cable on a DGX SuperPOD (superpod:8), against the same estimate without a fabric (every
inter-node link at the cable's rate, and loss-free). Prints each one's seconds and the ratio.

    python benchmarks/bench_fabric.py [--threads 1] [--model llama-3.1-70b]
"""
from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default="llama-3.1-70b")
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    from lossysim.estimate.simulate import estimate
    from lossysim.estimate.workload import Workload, job_config

    base = dict(tp_size=8, pp_size=4, dp_size=64, ranks_per_node=8, nics_per_node=8, algorithm="auto",
                transport="retransmit", nic="irn", seed=0)
    cases = {
        "no fabric, loss-free": dict(loss="none"),
        "no fabric, every inter-node link 1e-3": dict(loss="bernoulli:1e-3", lossy_links="inter_node"),
        "superpod:8, leaf3-spine1 at 1e-3": dict(loss="none", fabric="superpod:8",
                                                 bad_link="leaf3-spine1:bernoulli:1e-3"),
    }
    seconds = {}
    for name, keys in cases.items():
        config = job_config(args.model, 1, "bf16", 512, **base, **keys)
        start = time.perf_counter()
        row = estimate(args.model, config, Workload(4096), steps=args.steps)
        seconds[name] = time.perf_counter() - start
        print(f"{name:40s} {seconds[name]:8.1f} s  step {row['step_mean_s']:.4f} s  "
              f"lost {row['packets_lost']:.0f}  {row.get('blast_radius', '')}", flush=True)
    names = list(cases)
    print(f"threads {args.threads}, load {os.getloadavg()[0]:.2f}: fabric / no fabric (lossy) = "
          f"{seconds[names[2]] / seconds[names[1]]:.2f}x, fabric / loss-free = {seconds[names[2]] / seconds[names[0]]:.2f}x")


if __name__ == "__main__":
    main()
