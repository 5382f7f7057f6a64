"""What lossysim charges one 4 MiB send over TCP on roce-400g (two connections, NCCL's two channels), side by
side with the event-level RACK-TLP of tests/rack_tlp.py given the same fates, at 0.1%, 1% and 5% loss:
the expectations tests/test_tcp.py holds within 10% of each other (its draws, seed 41; ``--trials N`` draws
N per stratum instead of the test's). Prints one line per (nic, loss).

    python benchmarks/bench_tcp_reference.py [--trials N]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_tcp  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, help="draws per stratum (default: the test's)")
    args = parser.parse_args()
    for name in ("tcp-bbr", "tcp"):
        for p in (0.001, 0.01, 0.05):
            started = time.perf_counter()
            trials = args.trials or test_tcp.TRIALS[name, p]
            model, reference, ratio, se = test_tcp.charges(name, p, trials)
            print(f"{name:8s} {p:6.1%}: model {model * 1e3:8.3f} ms  reference {reference * 1e3:8.3f} ms  "
                  f"ratio {ratio:.3f} (se {se:.3f}), {2 * trials} draws, {time.perf_counter() - started:.1f} s",
                  flush=True)


if __name__ == "__main__":
    main()
