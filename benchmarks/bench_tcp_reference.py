"""What lossysim charges one 4 MiB send over TCP on roce-400g (two connections, NCCL's two channels), side by
side with the event-level RACK-TLP of tests/rack_tlp.py given the same fates, at 0.1%, 1% and 5% loss:
the expected charges with their standard errors (tests/test_tcp.py's split draws, seed 41; ``--draws N``
for N draws each instead of the defaults below, which pin each mean to 5-8% at one standard error;
``--loss`` for some of the three rates only).
One thread (torch and BLAS): the reference is pure Python, one core is what it uses. Prints one line per
(nic, loss).

    python benchmarks/bench_tcp_reference.py [--draws N] [--loss 0.01 ...]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_tcp  # noqa: E402

# Draws per case: a lost final transmission (~201 ms) is what spreads the charge; at 1% it is ~2.4% of
# sends, and each split draw's standard deviation ~6 ms against a mean of ~4.5 ms; at 5% timers are common
# and chains of them (the RTO doubling) spread it most, ~70 ms against ~30 ms.
DRAWS = {0.001: 100, 0.01: 400, 0.05: 800}


def draw_count(text: str) -> int:
    if not text.isdigit() or int(text) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of draws, 2 or more")
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=draw_count, help="split draws per case (default: 100, 400, 800 at 0.1, 1, 5%%)")
    parser.add_argument("--loss", type=float, nargs="+", choices=sorted(DRAWS), default=sorted(DRAWS),
                        help="loss rates (default: all three)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"threads: torch {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}", flush=True)
    for name in ("tcp-bbr", "tcp"):
        for p in args.loss:
            started, draws = time.perf_counter(), args.draws or DRAWS[p]
            c = test_tcp.charges(name, p, draws)
            print(f"{name:8s} {p:6.1%}: model {c['model'] * 1e3:8.3f} ms (se {c['model_se'] * 1e3:.3f})  "
                  f"reference {c['reference'] * 1e3:8.3f} ms (se {c['reference_se'] * 1e3:.3f})  "
                  f"ratio {c['ratio']:.3f} (se {c['ratio_se']:.3f}), {draws} draws, "
                  f"{time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
