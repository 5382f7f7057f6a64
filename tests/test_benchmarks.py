"""The benchmarks' own set-up runs against the current code: a benchmark that breaks when an internal
call changes says so here rather than on the machine that runs it (no timing is asserted)."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from lossysim.models.shapes import named_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_the_estimate_benchmarks_kernel_start_up_sends_through_tcps_kernels():
    import bench_estimate
    assert bench_estimate.numba_start_up() >= 0.0


BENCHMARKS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "benchmarks").glob("bench_*.py"))
# Their own thread counts: one compares torch's default with one thread, the other is pure Python on one
SETS_ITS_OWN_THREADS = {"bench_sweep", "bench_tcp_reference"}


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_imports_and_parses_its_flags_against_the_current_code(name, monkeypatch, capsys):
    """Each imports (no name it uses has moved), builds its command line, and says how its thread count is set."""
    module = importlib.import_module(name)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
    with pytest.raises(SystemExit) as done:
        module.main()
    help_text = capsys.readouterr().out
    assert done.value.code == 0 and help_text.startswith("usage:")
    assert "--threads" in help_text or name in SETS_ITS_OWN_THREADS


def test_the_padding_benchmark_builds_every_gpt2_shape_it_offers():
    import bench_padding
    assert "tiny" in bench_padding.GPT2_SHAPES
    for shape in bench_padding.GPT2_SHAPES:
        assert type(named_config(shape, vocab_size=64, n_positions=16, num_labels=3)).__name__ == "GPT2Config"
