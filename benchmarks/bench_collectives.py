"""Lossy collectives against a plain sum, and what the transports and the time model cost.

Measured side by side in one run (medians of interleaved repeats, so drift hits both):

1. A lossy all-reduce of a [8, 128, 768] fp32 activation per rank at 1% Bernoulli loss, for
   each algorithm, against ``x.sum(0)`` of the same tensors (the loss-free sum a simulator
   must do anyway), at tp 2, 4 and 8. Targets: ring within 1.5x of the floor below (timed against
   it in the same process, interleaved: 'vs floor'), and its cost per rank growing no faster than
   linearly with tp. Each row runs in a fresh process
   (the heap's history decides whether an output page-faults). Beside it, the floor no
   all-reduce that hands every receiver its own tensor can go below: the sum written into
   the first receiver's row, copied to the others, and one more read of it (the non-finite
   watch), timed the same way.
2. The transports: retransmit (selective, go-back-N) and deadline against drop.
3. The time model's own cost inside a sim tp2 training step of the tiny GPT-2: the clock
   bookkeeping a drop network does per call, against the whole step. Target: < 2%.

    python benchmarks/bench_collectives.py [--device cuda] [--repeats 30]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lossysim import LossyNetwork  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def paired(a, b, device, repeats: int) -> tuple[float, float, float]:
    """Median seconds of a and b, and the median of the per-pair ratios a/b."""
    for _ in range(3):
        a(), b()
    ta, tb, ratio = [], [], []
    for _ in range(repeats):
        x, y = timed(a, device), timed(b, device)
        ta.append(x), tb.append(y), ratio.append(x / y)
    return statistics.median(ta), statistics.median(tb), statistics.median(ratio)


def floor(x: torch.Tensor) -> torch.Tensor:
    """What any all-reduce handing each of R receivers its own tensor must do: sum into one row,
    copy it to the others, read it once more (the non-finite watch)."""
    out = torch.empty(x.shape[0], *x.shape[1:], dtype=x.dtype, device=x.device)
    torch.sum(x, 0, out=out[0])
    out[1:].copy_(out[0].expand(x.shape[0] - 1, *x.shape[1:]))
    out[0].sum()
    return out


def measure_row(device, tp: int, algorithm: str, repeats: int) -> dict:
    """One row of section 1, in this (fresh) process: ``algorithm`` "floor" or a network's."""
    g = torch.Generator(device=device).manual_seed(tp)
    x = torch.randn(tp, 8, 128, 768, generator=g, device=device)
    if algorithm == "floor":
        lossy = lambda: floor(x)  # noqa: E731
    else:
        net = LossyNetwork(tp, "bernoulli:0.01", seed=0, algorithm=algorithm)
        lossy = lambda: net.all_reduce("h.0.attn.reduce", "fwd", x, range(tp))  # noqa: E731
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t_lossy, t_sum, ratio = paired(lossy, lambda: x.sum(0), device, repeats)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / (repeats + 3)
    vs_floor = paired(lossy, lambda: floor(x), device, repeats)[2] if algorithm != "floor" else 1.0
    return {"lossy": t_lossy, "sum": t_sum, "ratio": ratio, "faults": faults, "vs_floor": vs_floor}


def bench_all_reduce(device, repeats, threads):
    print("\n1. Lossy all-reduce of [8, 128, 768] fp32 per rank, Bernoulli 1%, vs x.sum(0)")
    print("   (each row in a fresh process: whether a call's output page-faults depends on what ran before")
    print("   in the process, by 0 to 3000 faults a call here; 'faults' is the page faults per pair of calls)")
    print(f"{'tp':>3} {'algorithm':>9} {'lossy ms':>9} {'sum ms':>8} {'ratio':>6} {'faults':>7} {'vs floor':>8}  target")
    per_rank = {}
    for tp in (2, 4, 8):
        for algorithm in ("floor", "ring", "tree", "direct"):
            got = json.loads(subprocess.run(
                [sys.executable, __file__, "--row", str(tp), algorithm, "--device", str(device), "--repeats",
                 str(repeats), "--threads", str(threads)], check=True, capture_output=True, text=True).stdout)
            per_rank[(algorithm, tp)] = got["lossy"] / tp
            limit = 1.5
            note = ("PASS" if got["vs_floor"] <= limit else "FAIL") + f" <= {limit:g}x the floor" \
                if algorithm == "ring" else \
                "(sum into row 0, copy to the other rows, read once more)" if algorithm == "floor" else ""
            print(f"{tp:>3} {algorithm:>9} {got['lossy'] * 1e3:9.3f} {got['sum'] * 1e3:8.3f} {got['ratio']:6.2f} "
                  f"{got['faults']:7.0f} {got['vs_floor']:8.2f}  {note}")
    for algorithm in ("ring", "tree", "direct"):
        growth = per_rank[(algorithm, 8)] / per_rank[(algorithm, 2)]
        verdict = ("PASS" if growth <= 4 else "FAIL") + " <= 4 (linear)" if algorithm == "ring" else ""
        print(f"cost per rank, tp 8 / tp 2, {algorithm}: {growth:.2f}  {verdict}")


def bench_transports(device, repeats):
    print("\n2. Transports, tp 4 ring, [8, 128, 768] fp32, Bernoulli 1%, vs drop")
    tp = 4
    x = torch.randn(tp, 8, 128, 768, device=device)
    drop = LossyNetwork(tp, "bernoulli:0.01", seed=0)
    base = lambda: drop.all_reduce("s", "fwd", x, range(tp))  # noqa: E731
    for name, kwargs in (("retransmit selective", dict(transport="retransmit")),
                         ("retransmit go_back_n", dict(transport="retransmit", retransmit="go_back_n")),
                         ("deadline 1.5x", dict(transport="deadline"))):
        net = LossyNetwork(tp, "bernoulli:0.01", seed=0, **kwargs)
        t_net, t_drop, ratio = paired(lambda: net.all_reduce("s", "fwd", x, range(tp)), base, device, repeats)
        print(f"{name:>22}: {t_net * 1e3:8.3f} ms vs drop {t_drop * 1e3:8.3f} ms  ({ratio:.2f}x)")


def bench_time_model(device, repeats):
    print("\n3. Time model's own cost in a sim tp2 training step of the tiny GPT-2 (drop, Bernoulli 1%)")
    from transformers import GPT2Config, GPT2ForSequenceClassification
    from lossysim import parallelize
    torch.manual_seed(0)
    # Special tokens inside the 512-token vocabulary (GPT2Config's defaults, 50256, are not).
    config = GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=512, n_positions=64, num_labels=3,
                        pad_token_id=0, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    net = LossyNetwork(2, "bernoulli:0.01", seed=0)
    model = parallelize(GPT2ForSequenceClassification(config).to(device), 2, net)
    ids = torch.randint(1, 512, (32, 32), device=device)
    labels = torch.randint(0, 3, (32,), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    calls = []
    original = net.simulate

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    net.simulate = counting
    step()
    per_step_calls = len(calls)
    net.simulate = original
    shape = ("all_reduce", 32 * 32 * 128, torch.float32, device, None)
    transfer = net._transfers[shape]

    def clock_bookkeeping():  # what the time model adds to each drop call: the shape's lookup and its sum
        for _ in range(per_step_calls):
            net._transfers.get(shape)
            net.time.ideal += transfer.ideal
    t_clock, t_step, ratio = paired(clock_bookkeeping, step, device, repeats)
    print(f"step {t_step * 1e3:.2f} ms, clock bookkeeping for its {per_step_calls} collectives "
          f"{t_clock * 1e6:.1f} us: {100 * ratio:.3f}%  {'PASS' if ratio < 0.02 else 'FAIL'} < 2%")
    retransmit = LossyNetwork(2, "bernoulli:0.01", seed=0, transport="retransmit")
    model.group.network = retransmit
    t_re, t_drop, ratio = paired(step, lambda: None, device, max(repeats // 3, 5))
    model.group.network = net
    t_drop = statistics.median(timed(step, device) for _ in range(max(repeats // 3, 5)))
    print(f"the same step with retransmit (selective): {t_re * 1e3:.2f} ms vs drop {t_drop * 1e3:.2f} ms "
          f"({t_re / t_drop:.2f}x: the transport draws every resend)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--row", nargs=2, metavar=("TP", "ALGORITHM"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.row:
        print(json.dumps(measure_row(device, int(args.row[0]), args.row[1], args.repeats)))
        return 0
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    bench_all_reduce(device, args.repeats, args.threads)
    bench_transports(device, args.repeats)
    bench_time_model(device, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
