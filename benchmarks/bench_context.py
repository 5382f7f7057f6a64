"""What context parallelism costs the simulator and the estimate, measured side by side.

1. A sim tp 1 x cp 2 training step of the tiny GPT-2 as a byte-level causal LM on CPython's documentation
   topics (pydoc; 16 rows of up to 128 bytes, the cp profile's) against the tp 1 step on the same batch: the same compute, plus
   cutting the sequences into the ranks' chunks, the keys' and values' sends in every block (each context
   rank on its own node, 1% Bernoulli loss, ``mask``) and their gradients back, and the reassembly.
   Target: <= 1.5x (interleaved repeats: min and median of each).
2. ``--estimate``: one step at 1% loss, retransmitted by ``irn``, of Llama-3.1-8B at 131,072 tokens with
   tp 8 x cp 16 (each context rank on its own node, 16 nodes) and of Llama 3 405B at 131,072 tokens on
   Llama 3's long-context layout (tp 8 x cp 16 x pp 16 x dp 8, 16,384 GPUs). Target: <= 60 s each on 2
   cores.

    python benchmarks/bench_context.py [--device cuda] [--repeats 20] [--threads 1] [--estimate]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import side_by_side  # noqa: E402

from lossysim.config import ExperimentConfig  # noqa: E402
from lossysim.data import train_batches  # noqa: E402
from lossysim.estimate import Workload, estimate, job_config, load  # noqa: E402
from lossysim.run.build import build  # noqa: E402
from lossysim.run.state import TrainState, Window  # noqa: E402
from lossysim.run.step import train_step  # noqa: E402

BATCH = 16
TARGET = 1.5
ESTIMATE_TARGET_S = 60.0
NETWORK = dict(tp_size=8, transport="retransmit", nic="irn", ranks_per_node=8, nics_per_node=8,
               lossy_links="inter_node", loss="bernoulli:0.01")
JOBS = {"llama-3.1-8b": dict(cp_size=16),
        "llama-3.1-405b": dict(cp_size=16, pp_size=16, dp_size=8, pp_layout=",".join(["7"] + ["8"] * 14 + ["7"]))}


def stepper(cp: int, device: torch.device):
    """One training step at a time of tp 1 x cp ``cp`` (each context rank on its own node)."""
    config = ExperimentConfig(model="tiny", task="lm", dataset="pydoc", tokenizer="bytes", max_length=128,
                              max_train_samples=400,
                              batch_size=BATCH, steps=10_000, dropout=0.0, tp_size=1, cp_size=cp, ranks_per_node=1,
                              lossy_links="inter_node", recovery="mask" if cp > 1 else "zero",
                              # one context rank sends nothing: config refuses a loss nothing meets
                              loss="bernoulli:0.01" if cp > 1 else "none",
                              device=str(device), out=tempfile.mkdtemp()).validate()
    parts = build(config, device, 0, True, None)
    state, window, batches = TrainState(), Window(device), train_batches(parts.data, config.batch_size, 0)
    batch = next(batches)          # the same batch every step
    return lambda: train_step(parts, config, state, window, batch, device)


def estimated(model: str, layout: dict) -> tuple[float, float, dict]:
    """Wall and CPU seconds of one estimated step, and its row."""
    start, cpu = time.perf_counter(), time.process_time()
    row = estimate(load(model), job_config(model, **NETWORK, **layout), Workload(seq=131072), steps=1)
    return time.perf_counter() - start, time.process_time() - cpu, row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--estimate", action="store_true", help="also time the two estimates")
    parser.add_argument("--threads", type=int, help="intra-op threads (default: torch's; on shared cores 1 keeps "
                                                     "idle threads from spinning into the figures)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {device}")
    one, two = side_by_side([stepper(1, device), stepper(2, device)], device, args.repeats)
    for name, times in (("cp 1", one), ("cp 2 (1% loss, mask)", two)):
        print(f"{name}: min {min(times) * 1e3:.1f} ms, median {statistics.median(times) * 1e3:.1f} ms")
    ratio = min(two) / min(one)
    print(f"TARGET cp 2 / cp 1 (min): {ratio:.2f}x (<= {TARGET}x: {'met' if ratio <= TARGET else 'NOT met'}); "
          f"medians {statistics.median(two) / statistics.median(one):.2f}x")
    if args.estimate:
        for model, layout in JOBS.items():
            seconds, cpu, row = estimated(model, layout)
            print(f"{model} {row['layout']}, seq 131072, 1% bernoulli, irn: estimated in {seconds:.1f} s "
                  f"(CPU {cpu:.1f} s) "
                  f"({row['packets_drawn']:.3g} packet fates drawn); step {row['step_mean_s']:.3f} s, slowdown "
                  f"{row['slowdown']:.4f}, cp {row['stack_cp_s']:.4f} s loss-free + repairs {row['cp_repair_s']:.4f} s")
            print(f"TARGET {model} estimate: {seconds:.1f} s (<= {ESTIMATE_TARGET_S:.0f} s: "
                  f"{'met' if seconds <= ESTIMATE_TARGET_S else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
