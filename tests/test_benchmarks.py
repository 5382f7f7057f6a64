"""The benchmarks' own set-up runs against the current code: a benchmark that breaks when an internal
call changes says so here rather than on the machine that runs it (no timing is asserted)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_the_estimate_benchmarks_kernel_start_up_sends_through_tcps_kernels():
    import bench_estimate
    assert bench_estimate.numba_start_up() >= 0.0
