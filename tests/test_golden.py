"""Same seed, same numbers: short lossy runs reproduce, exactly, what the code gave when they were
captured (tests/golden/runs.json, written by tests/golden/capture.py).

Each case is a few steps of a tiny GPT-2 or Llama through ring, tree or direct all-reduces, with
zero or rescale recovery, drop, retransmit or deadline transports: per-step losses, accuracies,
packet counts and the simulated clock must match bit for bit. Captured before the layout change
(0.2); recaptured when the time model became NCCL's and the transports' timers real ones: every
number of every case but the clock stayed, except the deadline case's, whose transport gives up
by the clock.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from golden_runs import CASES, KEYS, config_for
from lossysim.io import read_jsonl
from lossysim.run.experiment import run_experiment

GOLDEN = json.loads((Path(__file__).parent / "golden" / "runs.json").read_text())


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LOSSYSIM_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.mark.parametrize("name", CASES)
def test_runs_reproduce_their_captured_numbers(name, tmp_path, one_torch_thread):
    config = config_for(name, tmp_path / name)
    summary = run_experiment(config, config.out, progress=False)
    assert summary["status"] == "completed", summary.get("error")
    rows = read_jsonl(Path(config.out) / "metrics.jsonl")
    got = [{k: row[k] for k in ("step", "split", *KEYS) if k in row} for row in rows]
    expected = GOLDEN[name]
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected):
        assert mine == theirs, (name, mine["step"], mine["split"],
                                {k: (mine.get(k), theirs.get(k)) for k in theirs if mine.get(k) != theirs.get(k)})


def test_a_changed_number_is_caught(tmp_path, one_torch_thread):
    """The comparison bites: one more percent of loss changes the numbers."""
    config = config_for("gpt2-ring-zero-bernoulli", tmp_path / "r").replace(loss="bernoulli:0.06")
    run_experiment(config, config.out, progress=False)
    rows = read_jsonl(Path(config.out) / "metrics.jsonl")
    assert rows[0]["packets_lost_fwd"] != GOLDEN["gpt2-ring-zero-bernoulli"][0]["packets_lost_fwd"] \
        or rows[0]["loss"] != GOLDEN["gpt2-ring-zero-bernoulli"][0]["loss"]

