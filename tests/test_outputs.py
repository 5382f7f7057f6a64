"""Output folders checked before any work, damaged results named, files written with the usual mode."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lossysim import cli, io
from lossysim.run import sweep
from test_sweep import Recorder, write_spec


def one_error_line(err: str, command: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"lossysim {command}: error: ")
    return lines[0]


# -- report on a damaged results folder ----------------------------------------------------------------
@pytest.fixture
def damaged(tmp_path, monkeypatch):
    """A fake sweep of 6 runs; then one summary.json truncated (as a full disk would leave it if it were
    not written atomically) and two completed runs' metrics.jsonl removed."""
    monkeypatch.setattr(sweep, "_default_train", lambda: Recorder())
    spec = write_spec(tmp_path / "s.yaml", {"loss": ["none", "bernoulli:0.01", "bernoulli:0.05"], "seed": [0, 1]})
    out = tmp_path / "results"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--no-progress"]) == 0
    run = {(d.name.split("_")[0], d.name.split("_")[2].split("-")[0]): d for d in out.iterdir() if d.is_dir()}
    text = (run["bernoulli-0.05", "seed1"] / "summary.json").read_text()
    (run["bernoulli-0.05", "seed1"] / "summary.json").write_text(text[: len(text) // 2])
    (run["bernoulli-0.05", "seed0"] / "metrics.jsonl").unlink()
    (run["bernoulli-0.01", "seed1"] / "metrics.jsonl").unlink()
    return out, run


def test_report_names_every_run_it_could_not_read_and_reports_the_rest(damaged, capsys):
    out, run = damaged
    assert cli.main(["report", str(out)]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("lossysim report: warning: ")]
    assert len(warnings) == 3, err
    truncated, no_metrics = run["bernoulli-0.05", "seed1"].name, run["bernoulli-0.05", "seed0"].name
    assert any(truncated in w and "summary.json is not valid JSON" in w for w in warnings)
    assert any(no_metrics in w and "no metrics.jsonl" in w for w in warnings)
    md = (out / "report.md").read_text()
    assert "5 runs: 5 completed, 0 diverged, 0 failed; 1 more could not be read" in md
    section = md.split("## Runs that could not be read")[1].split("##")[0]
    assert all(run[k].name in section for k in run if k != ("none", "seed0") and k != ("none", "seed1")
               and k != ("bernoulli-0.01", "seed0"))
    # Time to target: a run without metrics is unknown, never "never".
    rows = {line.split("|")[1].strip(): line for line in md.split("### Time to reach")[1].splitlines()
            if line.startswith("|") and "%" in line.split("|")[1]}
    five, one = rows["5% Bernoulli"], rows["1% Bernoulli"]
    assert "unknown" in five and "0/0, 1 unknown" in five and "never" not in five
    assert "1/1, 1 unknown" in one and "never" not in one


def test_report_strict_exits_1_when_a_run_is_damaged(damaged, capsys):
    out, _ = damaged
    assert cli.main(["report", str(out), "--strict"]) == 1
    assert (out / "report.md").is_file()   # the rest is still reported
