"""What expert parallelism costs the simulator, measured side by side (medians of interleaved repeats).

1. A sim dp 2 training step of the tiny MoE (``tiny-moe``: 2 blocks of 8 experts, 2 per token) with its
   experts over an ep 2 group (each replica 4 experts, the tokens dispatched and combined through the lossy
   all-to-all, the replicas side by side in lockstep), against the same step at ep 1 (each replica all 8
   experts, no all-to-all): the same model, batch and replicas, dispatch and combine lossy at 1% between
   two nodes. Target: <= 1.5x.
2. One lossy all-to-all (Bernoulli 1%, 4 ranks over two nodes, rows of 64 floats, 0 to 80 rows per pair),
   with its schedule built for the call's sizes, against a plain all-to-all (the messages concatenated per
   receiver).
3. ``lossysim estimate`` of one DeepSeek-V3 step in its published layout (2048 GPUs: pp 16 x dp 128, ep 64
   over 8 nodes, tp 1; 15360 sequences of 4096 tokens, micro-batch 1), 1% Bernoulli loss on the expert
   all-to-alls (dispatch and combine, both ways), retransmitted (irn): seconds to estimate it, one thread (a
   shared machine's second core answers late: see docs/estimate.md). Target: <= 60 s.

Every part runs on one intra-op thread (``--threads``): ``sim``'s ep replicas take turns on one thread
anyway, and two threads on a shared 2-core machine time its other jobs (two runs on 2 threads measured ep
1's step at 2.0 s and 7.2 s, ep 2's at 0.11 s and 0.65 s; on one thread 52 ms and 57 ms).

    python benchmarks/bench_experts.py [--repeats 20] [--threads 1] [--skip-deepseek]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_collectives import paired, stepping  # noqa: E402

from lossysim import LossyNetwork  # noqa: E402
from lossysim.config import ExperimentConfig  # noqa: E402

CPU = torch.device("cpu")


def stepper(ep: int):
    config = ExperimentConfig(model="tiny-moe", dataset="synthetic", max_length=32, max_train_samples=800,
                              batch_size=32, steps=10_000, tp_size=1, dp_size=2, ep_size=ep, ranks_per_node=1,
                              loss="bernoulli:0.01", lossy_traffic="ep_dispatch,ep_combine,dp",
                              out=tempfile.mkdtemp()).validate()
    return stepping(config, CPU)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    parser.add_argument("--skip-deepseek", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("LOSSYSIM_CACHE", tempfile.mkdtemp())
    torch.manual_seed(0)

    print("1. sim training step, tiny-moe, dp 2, 16 rows per replica, dispatch/combine/DP lossy at 1%")
    ep2, ep1, ratio = paired(stepper(2), stepper(1), CPU, args.repeats)
    print(f"   ep 2 {ep2 * 1e3:.1f} ms, ep 1 {ep1 * 1e3:.1f} ms, ratio {ratio:.2f} (target <= 1.5)")

    print("2. one all-to-all, 4 ranks on 2 nodes, rows of 64 floats, Bernoulli 1%, vs a plain all-to-all")
    g = torch.Generator().manual_seed(0)
    messages = [[torch.randn(int(torch.randint(0, 80, (1,), generator=g)), 64, generator=g) for _ in range(4)]
                for _ in range(4)]
    network = LossyNetwork(4, "bernoulli:0.01", ranks_per_node=2, seed=0)
    lossy, plain, ratio = paired(lambda: network.all_to_all("ep", "fwd", messages),
                                 lambda: [torch.cat([messages[s][d] for s in range(4)]) for d in range(4)],
                                 CPU, args.repeats)
    print(f"   lossy {lossy * 1e3:.3f} ms, plain {plain * 1e3:.3f} ms, ratio {ratio:.1f}")
    if not args.skip_deepseek:
        deepseek()


def deepseek():
    import time

    from lossysim.estimate import Workload, estimate, job_config, load
    print("3. estimate of one DeepSeek-V3 step, published layout, 1% loss on the expert all-to-alls, irn")
    start = time.perf_counter()
    shape = load("deepseek-v3")
    loaded = time.perf_counter()
    config = job_config("deepseek-v3", micro_batch=1, global_batch=15360, tp_size=1, pp_size=16, dp_size=128,
                        ep_size=64, ranks_per_node=8, pp_layout="3," + "4," * 13 + "3,3", link_inter="ib-ndr400",
                        loss="bernoulli:0.01", transport="retransmit", nic="irn",
                        lossy_traffic="ep_dispatch,ep_combine,ep_dispatch_backward,ep_combine_backward")
    row = estimate(shape, config, Workload(seq=4096), steps=1)
    done = time.perf_counter()
    print(f"   shape {loaded - start:.1f} s, step {done - loaded:.1f} s (target <= 60); step {row['step_mean_s']:.2f} s, "
          f"loss-free {row['loss_free_step_s']:.2f} s, dispatch {row['stack_ep_dispatch_s']:.2f} s, "
          f"combine {row['stack_ep_combine_s']:.2f} s, repairs {row['stack_repair_s']:.3f} s")


if __name__ == "__main__":
    main()
