"""What data parallelism costs the simulator, measured side by side (medians of interleaved repeats).

1. A sim tp 2 x dp 2 training step of the tiny GPT-2 against a sim tp 2 step, each replica on the same
   per-replica batch (so the dp step does twice the compute plus the DP buckets), DP links lossy at 1%.
   Target: <= 2.3x.
2. A lossy DP bucket all-reduce at dp 2 (ring, Bernoulli 1%) against ``x.sum(0)`` of the same
   contributions, for the tiny model's whole gradient and for one 25 MiB DDP bucket: in place (``out=x``,
   as DDP runs its buckets; target <= 3x) and returning a fresh [dp, n] tensor (a TP call's way, for
   comparison: its allocation faults fresh pages in).
3. The whole DP bucket path (``DataParallel.average_gradients``: the replicas' gradients flattened
   into the message, the lossy all-reduce, the average written back as every replica's gradient) for
   one 25 MiB bucket at dp 2, tp 1, against ``x.sum(0)``. Target: <= 3x.

    python benchmarks/bench_data_parallel.py [--repeats 20]
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
import threads_flag  # noqa: E402
from lossysim.dp import DataParallel, Replica  # noqa: E402

CPU = torch.device("cpu")


def stepper(per_replica: int, dp: int):
    config = ExperimentConfig(model="tiny", dataset="synthetic", max_length=32, max_train_samples=800,
                              batch_size=per_replica * dp, steps=10_000, dropout=0.0, tp_size=2, dp_size=dp,
                              ranks_per_node=2, lossy_links="inter_node",
                              # one replica has no inter-node traffic: config refuses a loss nothing meets
                              loss="bernoulli:0.01" if dp > 1 else "none",
                              out=tempfile.mkdtemp()).validate()
    return stepping(config, CPU)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = threads_flag.parse_args(parser)
    os.environ.setdefault("LOSSYSIM_CACHE", tempfile.mkdtemp())
    torch.manual_seed(0)

    print("1. sim training step, tiny GPT-2, 16 rows per replica, DP links lossy at 1%")
    dp_ms, tp_ms, ratio = paired(stepper(16, 2), stepper(16, 1), CPU, args.repeats)
    print(f"   tp2 x dp2 {dp_ms * 1e3:.1f} ms, tp2 {tp_ms * 1e3:.1f} ms, ratio {ratio:.2f} (target <= 2.3)")

    print("2. DP bucket all-reduce at dp 2, ring, Bernoulli 1%, vs x.sum(0); in place (out=x) as DDP runs it,")
    print("   and returning a fresh [dp, n] tensor as a TP call does")
    network = LossyNetwork(2, "bernoulli:0.01", seed=0)
    for label, numel in (("tiny model's gradient", 468_864), ("one 25 MiB bucket", 25 * (1 << 20) // 4)):
        x = torch.randn(2, numel)
        bucket = x.clone()   # summed in place call after call: doubles each time, finite for far more calls
        for how, call in (("in place", lambda: network.all_reduce("dp.bucket0", "bwd", bucket, range(2), out=bucket)),
                          ("returned", lambda: network.all_reduce("dp.bucket0", "bwd", x, range(2)))):
            lossy, plain, ratio = paired(call, lambda: x.sum(0), CPU, args.repeats)
            target = " (target <= 3)" if how == "in place" else ""
            print(f"   {label} ({numel} elements), {how}: lossy {lossy * 1e3:.2f} ms, sum {plain * 1e3:.2f} ms, "
                  f"ratio {ratio:.2f}{target}")

    print("3. DP bucket path (flatten, all-reduce, write back) at dp 2, tp 1, one 25 MiB bucket, vs x.sum(0)")
    dp, x = bucket_path(2, 8, 25 * (1 << 20) // 4 // 8)
    path, plain, ratio = paired(dp.average_gradients, lambda: x.sum(0), CPU, args.repeats)
    print(f"   average_gradients {path * 1e3:.2f} ms, sum {plain * 1e3:.2f} ms, ratio {ratio:.2f} (target <= 3)")


class _Gradients(torch.nn.Module):
    """What ``DataParallel`` reads of a TP model at tp 1: parameters with gradients, none sharded."""

    def __init__(self, params: int, numel: int):
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(numel)) for _ in range(params))
        for p in self.weights:
            p.grad = torch.randn(numel)

    def sharded_parameters(self):
        return []


def bucket_path(dp: int, params: int, numel: int):
    """A ``DataParallel`` of ``dp`` replicas whose ``params`` gradients of ``numel`` elements fill one
    bucket, over a ring lossy at 1%; and the [dp, n] contributions a plain sum would add."""
    replicas = [Replica(_Gradients(params, numel), None, None) for _ in range(dp)]
    network = LossyNetwork(dp, "bernoulli:0.01", seed=0)
    data_parallel = DataParallel(replicas, [[network]], bucket_bytes=params * numel * 4)   # one stage, tp 1
    assert len(data_parallel.buckets) == 1
    return data_parallel, torch.randn(dp, params * numel)


if __name__ == "__main__":
    main()
