"""How fast loss masks are drawn, against the targets that keep loss simulation cheap.

Targets: a Gilbert-Elliott packet costs at most 2x a Bernoulli packet, and the
vectorised Gilbert-Elliott is at least 50x a per-packet Python loop (netem's
algorithm written naively). Two loops are timed: a tight one on Python's
``random`` (the fastest a loop gets) and one drawing each number with
``torch.rand`` on a torch generator (what naive code on the project's seeded
streams does). Every candidate is timed round-robin in the same run (so
background load hits them alike), several times, and the median kept.
Also times LossyNetwork.all_reduce on a GPT-2-small activation (8x128x768 fp32,
tp 2) with and without loss, next to the plain sum it replaces.

    .venv/bin/python benchmarks/bench_loss_models.py [--repeats 7] [--threads N]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from lossysim.loss_models import Bernoulli, GilbertElliott
from lossysim.network import LossyNetwork

VECTOR_PACKETS = 10**7
LOOP_PACKETS = 10**5
GE_OVER_BERNOULLI_MAX = 2.0
VECTOR_OVER_LOOP_MIN = 50.0


def loop_gilbert_elliott(n: int, model: GilbertElliott, uniform) -> bytearray:
    """netem's loss_gilb_ell one packet at a time: drop by the arrival state, then step."""
    lost = bytearray(n)
    p_gb, p_bg, loss_good, loss_bad = model.p_gb, model.p_bg, model.loss_good, model.loss_bad
    bad = uniform() < model.pi_bad
    for i in range(n):
        p_loss = loss_bad if bad else loss_good
        if p_loss == 1.0 or (p_loss > 0.0 and uniform() < p_loss):
            lost[i] = 1
        bad = uniform() < ((1.0 - p_bg) if bad else p_gb)
    return lost


def loop_bernoulli(n: int, p: float, uniform) -> bytearray:
    lost = bytearray(n)
    for i in range(n):
        if uniform() < p:
            lost[i] = 1
    return lost


def torch_uniform(generator: torch.Generator):
    """One float per call from a torch generator, as per-packet code on a seeded stream draws it."""
    return lambda: torch.rand((), generator=generator).item()


def round_robin(candidates: dict, repeats: int) -> dict:
    """Median seconds per candidate, each timed once per round after one warm-up call."""
    for fn in candidates.values():
        fn()
    times = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    bernoulli = Bernoulli(0.01)
    simple = GilbertElliott.from_rate(0.01, 8)
    general = GilbertElliott(0.002, 0.05, loss_good=0.01, loss_bad=0.8)
    g = torch.Generator().manual_seed(0)
    py, th = random.Random(0).random, torch_uniform(torch.Generator().manual_seed(1))
    candidates = {
        "bernoulli": (VECTOR_PACKETS, bernoulli.spec, lambda: bernoulli.sample(VECTOR_PACKETS, g)),
        "ge-simple": (VECTOR_PACKETS, simple.spec, lambda: simple.sample(VECTOR_PACKETS, g)),
        "ge-general": (VECTOR_PACKETS, general.spec, lambda: general.sample(VECTOR_PACKETS, g)),
        "loop-bernoulli": (LOOP_PACKETS, "random.random loop, " + bernoulli.spec,
                           lambda: loop_bernoulli(LOOP_PACKETS, bernoulli.p, py)),
        "loop-ge-simple": (LOOP_PACKETS, "random.random loop, " + simple.spec,
                           lambda: loop_gilbert_elliott(LOOP_PACKETS, simple, py)),
        "torchloop-bern": (LOOP_PACKETS, "torch.rand loop, " + bernoulli.spec,
                           lambda: loop_bernoulli(LOOP_PACKETS, bernoulli.p, th)),
        "torchloop-ge": (LOOP_PACKETS, "torch.rand loop, " + simple.spec,
                         lambda: loop_gilbert_elliott(LOOP_PACKETS, simple, th)),
    }
    seconds = round_robin({name: c[2] for name, c in candidates.items()}, args.repeats)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
          f"median of {args.repeats} round-robin repeats")
    print(f"{'candidate':<16}{'packets':>10}{'seconds':>11}{'Mpackets/s':>12}{'ns/packet':>11}  model")
    ns = {}
    for name, sec in seconds.items():
        packets, spec, _ = candidates[name]
        ns[name] = sec / packets * 1e9
        print(f"{name:<16}{packets:>10.0e}{sec:>11.4f}{packets / sec / 1e6:>12.2f}{ns[name]:>11.2f}  {spec}")

    print()
    checks = [
        ("GE simple cost / Bernoulli cost", ns["ge-simple"] / ns["bernoulli"], "<=", GE_OVER_BERNOULLI_MAX),
        ("GE general cost / Bernoulli cost", ns["ge-general"] / ns["bernoulli"], "<=", GE_OVER_BERNOULLI_MAX),
        ("vectorised GE / random.random loop", ns["loop-ge-simple"] / ns["ge-simple"], ">=",
         VECTOR_OVER_LOOP_MIN),
        ("vectorised Bernoulli / random.random loop", ns["loop-bernoulli"] / ns["bernoulli"], ">=",
         VECTOR_OVER_LOOP_MIN),
        ("vectorised GE / torch.rand loop", ns["torchloop-ge"] / ns["ge-simple"], ">=", VECTOR_OVER_LOOP_MIN),
        ("vectorised Bernoulli / torch.rand loop", ns["torchloop-bern"] / ns["bernoulli"], ">=",
         VECTOR_OVER_LOOP_MIN),
    ]
    passed = 0
    for label, value, op, target in checks:
        ok = value <= target if op == "<=" else value >= target
        passed += ok
        print(f"{label:<42}{value:>9.2f}x  target {op} {target:g}x  {'PASS' if ok else 'FAIL'}")
    print(f"{passed}/{len(checks)} targets met")

    print()
    shape, tp = (8, 128, 768), 2
    x = torch.randn(tp, *shape)
    nets = {spec: LossyNetwork(tp, spec, seed=0) for spec in
            ("none", "bernoulli:0.01", "ge:rate=0.01,burst=8",
             "ge:p_gb=0.002,p_bg=0.05,loss_bad=0.8,loss_good=0.01")}
    per, n_packets = nets["none"].packets(x[0].numel(), x.dtype)
    calls = {"plain x.sum(0)": lambda: x.sum(0)}
    calls.update({f"all_reduce {spec}": (lambda net=net: net.all_reduce("bench", "fwd", x, range(tp)))
                  for spec, net in nets.items()})
    call_seconds = round_robin(calls, max(args.repeats, 5) * 3)
    print(f"all_reduce of {'x'.join(map(str, shape))} fp32, tp {tp}: {per} elements/packet, "
          f"{n_packets} packets per link per call")
    for name, sec in call_seconds.items():
        print(f"{name:<72}{sec * 1e3:>9.3f} ms/call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
