"""A few of the quick profile's runs, idle and beside a busy torch process, at torch's own thread count and at
lossysim's (one thread), one run at a time and side by side (``--jobs``).

Each case is a fresh ``lossysim sweep`` of the same runs into an empty folder (after a one-step warm-up that
builds the data's caches), timed from its start (start-up included) to its end; "busy" starts a torch process doing matmuls on torch's default threads (a second
experiment, a notebook) before the sweep and stops it after. Targets (issue 52): beside one busy job, the
default within 1.15x of one thread; the sweep beside one busy job within 2x of its idle time. The machine's
load average is printed before and after: other programs on the machine count as "busy" too.

    python benchmarks/bench_sweep.py [--runs 2] [--steps 40]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lossysim.config import cores  # noqa: E402
from lossysim.run.spec import load_spec  # noqa: E402
from lossysim.run.names import expand  # noqa: E402

BUSY = "import torch\na = torch.randn(1024, 1024)\nwhile True:\n    a = (a @ a).clamp_(-1, 1)\n"


def _spec(runs: int, folder: Path) -> Path:
    """The quick profile's first ``runs`` runs as a spec of their own (a grid of single points)."""
    spec = load_spec(ROOT / "experiments" / "quick.yaml")
    points = [run.point for run in expand(spec, folder / "unused")[:runs]]
    path = folder / "bench.yaml"
    path.write_text(yaml.safe_dump({"name": "bench", **spec.base,
                                    "grid": [{k: [v] for k, v in point.items()} for point in points]}))
    return path


def _sweep(spec: Path, out: Path, steps: int, jobs: int, threads: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("OMP_NUM_THREADS", None)
    command = [sys.executable, "-m", "lossysim", "sweep", str(spec), "--out", str(out), "--no-progress",
               "--set", f"steps={steps}", "--set", f"eval_every={steps}", "--jobs", str(jobs),
               "--threads", str(threads)]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"sweep failed ({done.returncode}): {done.stderr[-2000:]}")
    return took


def _busy():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}   # torch's own default: every core
    return subprocess.Popen([sys.executable, "-c", BUSY], env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="the quick profile's first N runs (default 2)")
    parser.add_argument("--steps", type=int, default=40, help="steps per run (default 40; the profile's 200)")
    args = parser.parse_args()
    n = cores()
    cases = [("one at a time", 1, n), ("one at a time", 1, 1), (f"--jobs {n}", n, 1)]
    print(f"{args.runs} runs of the quick profile, {args.steps} steps each; {n} cores; torch's default "
          f"threads = {n}, lossysim's = 1; load average before: {os.getloadavg()[0]:.2f}")
    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        spec = _spec(args.runs, tmp)
        _sweep(spec, tmp / "warm-up", 1, 1, 1)   # the data's caches (tokenizer, tokenised splits), built once
        for busy in (False, True):
            proc = _busy() if busy else None
            try:
                if proc is not None:
                    time.sleep(2)   # its torch loaded and spinning
                for label, jobs, threads in cases:
                    out = tmp / f"{busy}-{jobs}-{threads}"
                    times[busy, jobs, threads] = took = _sweep(spec, out, args.steps, jobs, threads)
                    print(f"{'busy' if busy else 'idle'}  {label:<14} threads {threads}: {took:7.1f} s  "
                          f"(load {os.getloadavg()[0]:.2f})", flush=True)
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(f"beside a busy job, torch's default ({n} threads) / one thread: "
          f"{times[True, 1, n] / times[True, 1, 1]:.2f}x  (lossysim's default is one thread: 1.00x; target <= 1.15x)")
    print(f"idle, torch's default / one thread: {times[False, 1, n] / times[False, 1, 1]:.2f}x")
    for jobs, threads in ((1, n), (1, 1), (n, 1)):
        print(f"jobs {jobs}, threads {threads}: busy / idle {times[True, jobs, threads] / times[False, jobs, threads]:.2f}x"
              + ("  (target <= 2x)" if jobs == n else ""))
    print(f"idle, --jobs {n} / one at a time (both one thread): {times[False, n, 1] / times[False, 1, 1]:.2f}x")


if __name__ == "__main__":
    main()
