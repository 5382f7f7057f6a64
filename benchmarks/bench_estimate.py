"""What ``lossysim estimate`` costs for a whole job: seconds, packet fates per second, peak memory.

1. One step of Llama-3.1-70B on 32 nodes x 8 H100 (tp 8 x pp 4 x dp 8, 8 RoCE 400G NICs per node,
   loss only between nodes, 4096-byte payloads, seq 4096, 16 micro-batches), 1% Bernoulli loss,
   ``retransmit`` by ``irn``. Target: <= 10 s and <= 2 GB on 2 cores. Printed: the step, packet fates per
   second, and the ratio to drawing the same number of Bernoulli fates alone (torch.rand(n) < p).
2. The same step under Gilbert-Elliott loss at the same mean rate (bursts of 4). Target: <= 3x the
   Bernoulli step.
3. ``--405b``: one step of Llama 3 405B's published layout (tp 8 x pp 16 x dp 128 = 16,384 GPUs, seq
   8192, global batch 2048, stages of 7, 8 x 14, 7 blocks), ``irn``. Target (issue 52): <= 20 s on one
   core with start-up (``import lossysim.estimate``, printed first).
4. ``--deepseek``: one step of DeepSeek-V3's published layout (README), 1% loss on the expert all-to-alls,
   ``irn``. Target: <= 20 s on one core with start-up.
5. ``--tcp``: the TCP row's time over the IRN row's, each timed in this process side by side (irn, then
   tcp): the 70B step of 1. (the README's DDP layout, ring), and with ``--405b`` / ``--deepseek`` theirs
   too (the 405B tcp row took 26 minutes of CPU before issue 52: run it once, if at all). Target <= 3x.
   numba's one-time start-up (its import and the kernels loaded from its cache, paid once per process by
   the first TCP row) is timed first and printed on its own, and beside the 70B ratio.
   The 70B tcp row is timed a second time on the Python loops (``timing.carried.COMPILED`` and
   ``net.transport.rack_kernel.COMPILED`` off: what runs without numba), its row compared with the
   compiled one's, every figure equal.

Torch runs one intra-op thread (``--threads``, default 1): the targets are one core's, and a shared
machine's spare threads only spin.

    python benchmarks/bench_estimate.py [--steps 1] [--skip-bursty] [--405b] [--deepseek] [--tcp] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
_start = time.perf_counter()
from lossysim.estimate import Workload, estimate, job_config, load  # noqa: E402
STARTUP = time.perf_counter() - _start   # torch itself was imported above: lossysim's own start-up

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


def timed(shape, loss: str, layout: dict, workload: Workload, steps: int, nic: str = "irn") -> tuple[float, dict]:
    start = time.perf_counter()
    row = estimate(shape, job_config(shape.name, loss=loss, **layout, **{**NETWORK, "nic": nic}), workload,
                   steps=steps)
    return (time.perf_counter() - start) / steps, row


def deepseek(nic: str) -> tuple[float, dict]:
    """One step of DeepSeek-V3's published layout (the README's command), ``nic`` repairing."""
    shape = load("deepseek-v3")
    config = job_config("deepseek-v3", micro_batch=1, global_batch=15360, tp_size=1, pp_size=16, dp_size=128,
                        ep_size=64, ranks_per_node=8, pp_layout="3," + "4," * 13 + "3,3", link_inter="ib-ndr400",
                        loss="bernoulli:0.01", transport="retransmit", nic=nic, algorithm="ring",
                        lossy_traffic="ep_dispatch,ep_combine,ep_dispatch_backward,ep_combine_backward")
    start = time.perf_counter()
    row = estimate(shape, config, Workload(seq=4096), steps=1)
    return time.perf_counter() - start, row


def big(nic: str) -> tuple[float, dict]:
    """One step of Llama 3 405B's published layout, ``nic`` repairing."""
    layout = dict(pp_size=16, dp_size=128, global_batch=2048, pp_layout=",".join(["7"] + ["8"] * 14 + ["7"]),
                  algorithm="ring")
    return timed(load("llama-3.1-405b"), "bernoulli:0.01", layout, Workload(seq=8192), 1, nic)


def numba_start_up() -> float:
    """Seconds to import numba and load the TCP kernels (one tiny send of one connection through them: its
    window carried, its round 0 and a resend)."""
    from lossysim.net.transport.sends import HostSends
    from lossysim.net.transport.tcp import _Rack
    from lossysim.timing.retransmission import NIC_PRESETS
    start = time.perf_counter()
    one = np.array([0])
    rack = _Rack(NIC_PRESETS["tcp"], HostSends(np.array([10]), 10, np.array([1e-6]), np.array([1e-5]),
                                               np.array([True]), None, True, one), None)
    rack.first(one, np.array([9]))
    rack.resent(one, np.array([9]), np.array([False]))
    return time.perf_counter() - start


def ratio_line(name: str, irn: float, tcp: float) -> None:
    print(f"TARGET {name} tcp row / irn row: {tcp:.1f} s / {irn:.1f} s = {tcp / irn:.2f}x "
          f"(<= 3x: {'met' if tcp <= 3 * irn else 'NOT met'})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--skip-bursty", action="store_true")
    parser.add_argument("--405b", dest="big", action="store_true", help="also Llama 3 405B's layout")
    parser.add_argument("--deepseek", action="store_true", help="also DeepSeek-V3's layout")
    parser.add_argument("--tcp", action="store_true", help="the tcp rows over the irn rows")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; start-up (import lossysim.estimate) "
          f"{STARTUP:.1f} s; peak memory after imports {peak_mb():.0f} MB; load {os.getloadavg()[0]:.1f}")

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

    if args.tcp:
        ddp = dict(layout, algorithm="ring")
        kernel_start = numba_start_up()
        print(f"numba's start-up, once per process before the first TCP row (import, the kernel loaded from "
              f"its cache): {kernel_start:.1f} s; the rows below are timed after it")
        irn, _ = timed(shape, "bernoulli:0.01", ddp, workload, args.steps, "irn")
        tcp, row = timed(shape, "bernoulli:0.01", ddp, workload, args.steps, "tcp")
        ratio_line(f"70B DDP ({row['layout']}, 1%)", irn, tcp)
        print(f"70B DDP with numba's start-up: {tcp + kernel_start:.1f} s / {irn:.1f} s = "
              f"{(tcp + kernel_start) / irn:.2f}x")
        from lossysim.net.transport import rack_kernel
        from lossysim.timing import carried, carried_kernel
        if carried_kernel.connections() is not None:
            carried.COMPILED = rack_kernel.COMPILED = False
            python, again = timed(shape, "bernoulli:0.01", ddp, workload, args.steps, "tcp")
            carried.COMPILED = rack_kernel.COMPILED = True
            same = again == row   # NaN-free rows: == compares every figure
            print(f"70B DDP tcp row on the Python loop: {python:.1f} s ({python / tcp:.2f}x the compiled); "
                  f"the same row: {'yes' if same else 'NO'}")
        else:
            print("numba is not installed: the tcp row ran the Python loop (pip install -e '.[fast]')")

    for wanted, name, run in ((args.big, "405B", big), (args.deepseek, "DeepSeek-V3", deepseek)):
        if not wanted:
            continue
        irn, row = run("irn")
        print(f"TARGET {name} {row['layout']} irn, one step: {irn:.1f} s + start-up {STARTUP:.1f} s = "
              f"{irn + STARTUP:.1f} s (<= 20 s: {'met' if irn + STARTUP <= 20 else 'NOT met'}); "
              f"{row['packets_drawn']:.3g} fates drawn, slowdown {row['slowdown']:.4f}")
        if args.tcp:
            tcp, row = run("tcp")
            ratio_line(f"{name} (1%)", irn, tcp)
    print(f"peak memory {peak_mb():.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
