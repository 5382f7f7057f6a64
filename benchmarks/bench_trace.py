"""What ``lossysim estimate --trace`` costs: calls replayed per second from a trace of thousands of calls.

An NCCL trace is written (no GPU records one here: ``tests/nccl_trace.py`` writes record_param_comms' fields)
for rank 0 of tp 8 x dp 4 on 4 nodes of 8 GPUs (its peers mirror it): each step 3,840 TP all-reduces of
8 MiB (bf16; inside the node, NVLink, never lossy) and 160 DP all-reduces of 25 MiB across nodes (RoCE
400G, 4096-byte payloads), 4,000 calls a step with compute between them. Printed: the read (events per
second), then one replayed step loss-free and at 1% Bernoulli loss retransmitted by IRN: calls replayed
per second, packet fates drawn per second. Numbers from a shared machine are noisy: compare within a run.

    python benchmarks/bench_trace.py [--steps 2]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import threads_flag  # noqa: E402
from lossysim.estimate import job_config  # noqa: E402
from lossysim.estimate import trace as traces  # noqa: E402
from lossysim.estimate.trace_replay import simulate_trace  # noqa: E402
from nccl_trace import NcclCall, write_trace  # noqa: E402

TP_CALLS, DP_CALLS = 3840, 160
LAYOUT = dict(tp_size=8, dp_size=4, ranks_per_node=8, nics_per_node=8, link_inter="roce-400g",
              lossy_links="inter_node", payload_bytes=4096)


def write(folder: Path, steps: int) -> Path:
    groups = {"0": tuple(range(32)), "1": tuple(range(8)), "2": tuple(range(0, 32, 8))}
    tp_numel, dp_numel = 4 << 20, 25 << 20 >> 2
    step_us, calls_steps, compute = 2_000_000.0, [], []
    for s in range(steps):
        t0, calls = s * step_us, []
        for i in range(TP_CALLS):
            start = t0 + i * 400.0
            compute.append((start - 300.0, start))
            calls.append(NcclCall("allreduce", tp_numel, tp_numel, "1", start, 100.0))
        for i in range(DP_CALLS):     # buckets during the last part of the backward
            calls.append(NcclCall("allreduce", dp_numel, dp_numel, "2", t0 + 1_000_000 + i * 4000.0, 3000.0,
                                  dtype="Float"))
        calls_steps.append((t0, t0 + step_us, calls))
    return write_trace(folder / "rank0.json.gz", 0, groups, calls_steps, compute)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="traced steps, each replayed once")
    args = threads_flag.parse_args(parser)
    import scipy.stats  # noqa: F401  (the row's intervals import it once: not the replay's cost)
    with tempfile.TemporaryDirectory() as tmp:
        path = write(Path(tmp), args.steps)
        start = time.perf_counter()
        trace = traces.read(path)
        read_s = time.perf_counter() - start
    calls = sum(len(step) for step in trace.ranks[0].calls)
    events = 2 * calls + sum(len(b) for b in trace.ranks[0].busy)
    print(f"read {calls} calls ({events} events) in {read_s:.2f} s: {events / read_s:,.0f} events/s")
    for loss, extra in (("none", {}), ("bernoulli:0.01", dict(transport="retransmit", nic="irn"))):
        config = job_config("tiny", tp_size=8, dp_size=4, loss=loss, **extra,
                            **{k: v for k, v in LAYOUT.items() if k not in ("tp_size", "dp_size")})
        start = time.perf_counter()
        row = simulate_trace(trace, config, steps=args.steps)
        seconds = time.perf_counter() - start
        print(f"{loss:>15}: {args.steps} steps of {calls // args.steps} calls in {seconds:.2f} s: "
              f"{calls / seconds:,.0f} calls/s, {row['packets_drawn'] * args.steps / seconds:,.0f} fates drawn/s; "
              f"step {row['step_mean_s']:.4f} s (loss-free {row['loss_free_step_s']:.4f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
