"""Output folders checked before any work, damaged results named, files written with the usual mode."""
from __future__ import annotations

import json
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
    section = md.split("## Runs that are incomplete or could not be read")[1].split("##")[0]
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


@pytest.mark.parametrize("damage, why", [
    (lambda text: text[: len(text) // 2], "summary.json is not valid JSON"),
    (lambda text: json.dumps({"status": "completed", "config": "oops"}), "completed run has a str as its config"),
    (lambda text: json.dumps({"status": "completed"}), "summary.json of a completed run has no config"),
    (lambda text: json.dumps({**json.loads(text), "final": {"validation_matched": [1]}}), "unexpected shape"),
    (lambda text: json.dumps({**json.loads(text), "collectives": ["all_reduce", {"network": 3}]}),
     "collectives hold 2 malformed record(s)"),
], ids=["truncated", "config-of-another-type", "incomplete", "final-of-another-shape", "malformed-collectives"])
def test_report_names_a_damaged_run_reports_the_rest_and_keeps_its_row(tmp_path, monkeypatch, capsys, damage, why):
    """A summary.json cut short, of the wrong shape, incomplete, or with malformed collectives: the run is
    named, the other five are reported, summary.csv keeps the row it had for a run it cannot read now
    (marked stale: maybe the last readable copy of its results), and --strict exits 1."""
    import pandas as pd
    monkeypatch.setattr(sweep, "_default_train", lambda: Recorder())
    spec = write_spec(tmp_path / "s.yaml", {"loss": ["none", "bernoulli:0.01", "bernoulli:0.05"], "seed": [0, 1]})
    out = tmp_path / "results"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--no-progress"]) == 0
    before = pd.read_csv(out / "summary.csv")
    victim = sorted(d for d in out.iterdir() if d.is_dir())[2]
    (victim / "summary.json").write_text(damage((victim / "summary.json").read_text()))
    capsys.readouterr()
    assert cli.main(["report", str(out), "--strict"]) == 1
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("lossysim report: warning: ")]
    assert len(warnings) == 1 and victim.name in warnings[0] and why in warnings[0], err
    md = (out / "report.md").read_text()
    partly = "collectives" in why   # its numbers are sound: reported, its malformed records left out
    assert f"{6 if partly else 5} runs: {6 if partly else 5} completed" in md
    assert victim.name in md.split("## Runs that are incomplete or could not be read")[1].split("##")[0]
    after = pd.read_csv(out / "summary.csv")
    assert sorted(after["run_dir"]) == sorted(before["run_dir"])
    if partly:
        assert "stale" not in after.columns
        return
    assert after.set_index("run_dir")["stale"].to_dict() == {d: d == victim.name for d in before["run_dir"]}
    kept = after[after["run_dir"] == victim.name].drop(columns="stale").dropna(axis=1)
    earlier = before[before["run_dir"] == victim.name].dropna(axis=1)
    pd.testing.assert_frame_equal(kept.reset_index(drop=True), earlier[kept.columns].reset_index(drop=True))
    assert "summary.csv keeps the earlier rows of " + victim.name in err
    assert cli.main(["report", str(out)]) == 0   # and again: still kept, still stale
    assert pd.read_csv(out / "summary.csv").set_index("run_dir")["stale"][victim.name]


def test_report_checks_its_out_before_creating_anything(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli.main(["report", str(tmp_path / "empty"), "--out", str(tmp_path / "x")]) == 2
    assert "no finished runs" in one_error_line(capsys.readouterr().err, "report")
    assert not (tmp_path / "x").exists()
    (tmp_path / "file").write_text("")
    assert cli.main(["report", str(tmp_path / "empty"), "--out", str(tmp_path / "file" / "x")]) == 2
    line = one_error_line(capsys.readouterr().err, "report")
    assert f"--out {tmp_path / 'file' / 'x'} cannot be created: {tmp_path / 'file'} is not a folder" in line


# -- output folders: checked first, errors named -----------------------------------------------------------
def test_check_writable_creates_nothing_and_names_the_option(tmp_path):
    io.check_writable(tmp_path / "a" / "b", "--out")
    assert not (tmp_path / "a").exists() and list(tmp_path.iterdir()) == []
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=rf"^--out {tmp_path / 'f'} is not a folder$"):
        io.check_writable(tmp_path / "f", "--out")
    with pytest.raises(ValueError, match="^--dir .*/f/x cannot be created: .*/f is not a folder$"):
        io.check_writable(tmp_path / "f" / "x", "--dir")
    with pytest.raises(ValueError, match="^--out /proc/lossysim-x is not writable: "):
        io.check_writable("/proc/lossysim-x")   # no process may create files there, root included


def test_output_errors_name_the_option_only_for_files_under_the_folder(tmp_path):
    with pytest.raises(ValueError, match=rf"^--out {tmp_path} is not writable: No space left on device$"):
        with io.output_errors(tmp_path):
            raise OSError(28, "No space left on device", str(tmp_path / "x.csv"))
    with pytest.raises(FileNotFoundError):   # someone else's file: its own error
        with io.output_errors(tmp_path):
            raise FileNotFoundError(2, "No such file or directory", "/elsewhere/data.txt")


ESTIMATE = ["estimate", "tiny", "--tp-size", "2", "--seq", "16", "--steps", "1", "--no-progress"]


def test_estimate_refuses_an_unwritable_out_before_simulating(tmp_path, monkeypatch, capsys):
    from lossysim.estimate import grid
    simulated = []
    monkeypatch.setattr(grid, "run_grid", lambda *a, **k: simulated.append(a) or [])
    (tmp_path / "file").write_text("")
    assert cli.main([*ESTIMATE, "--out", str(tmp_path / "file" / "est")]) == 2
    line = one_error_line(capsys.readouterr().err, "estimate")
    assert "--out" in line and str(tmp_path / "file" / "est") in line
    assert simulated == []


def test_estimate_names_out_when_a_write_fails(tmp_path, monkeypatch, capsys):
    from lossysim.estimate import grid
    row = {**{key: 0 for key in grid.SHOWN}, "loss_rate": 0.0, "layout": "tp2 x pp1 x dp1 = 2 GPUs on 1 node"}
    monkeypatch.setattr(grid, "run_grid", lambda *a, **k: [row])

    def full_disk(path, text):
        raise OSError(28, "No space left on device", str(path))
    monkeypatch.setattr(grid, "atomic_write_text", full_disk)
    assert cli.main([*ESTIMATE, "--out", str(tmp_path / "est")]) == 2
    layout, error = capsys.readouterr().err.strip().splitlines()   # the layout's name, then one error line
    assert layout == row["layout"]
    line = one_error_line(error, "estimate")
    assert line.endswith(f"--out {tmp_path / 'est'} is not writable: No space left on device")


def test_an_estimate_grid_that_stops_part_way_keeps_its_finished_rows(tmp_path, monkeypatch, capsys):
    """Each finished setting is saved at once, beside the results: the second of two settings is interrupted
    (Ctrl-C), which ends in one line (exit 130) naming where the first's row is; estimate.partial.csv and .json
    hold it, and the completed estimate already in --out is left as it was. Another grid in that folder is
    refused while the interrupted one's rows are there (it would replace them); one that completes leaves no
    partial files."""
    import json
    import pandas as pd
    from lossysim.estimate import grid
    real, calls = grid.estimate, []

    def second_interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    out = tmp_path / "est"
    assert cli.main([*ESTIMATE, "--loss", "bernoulli:0.05", "--out", str(out)]) == 0   # a completed one
    completed = (out / "estimate.csv").read_text()
    capsys.readouterr()
    monkeypatch.setattr(grid, "estimate", second_interrupted)
    assert cli.main([*ESTIMATE, "--loss", "bernoulli:0.01", "--loss", "bernoulli:0.02", "--out", str(out)]) == 130
    assert capsys.readouterr().err.strip() == (f"lossysim estimate: interrupted after 1 of 2 settings; their rows are "
                                               f"in {out / 'estimate.partial.csv'} and .json")
    kept = (out / "estimate.partial.json").read_text()
    rows = json.loads(kept)
    assert len(rows) == 1 and rows[0]["loss"] == "bernoulli:0.01"
    assert pd.read_csv(out / "estimate.partial.csv")["loss"].tolist() == ["bernoulli:0.01"]
    assert (out / "estimate.csv").read_text() == completed
    monkeypatch.setattr(grid, "estimate", real)
    assert cli.main([*ESTIMATE, "--loss", "bernoulli:0.03", "--out", str(out)]) == 2
    line = one_error_line(capsys.readouterr().err, "estimate")
    assert "holds the rows of an interrupted estimate (estimate.partial.csv and estimate.partial.json)" in line
    assert (out / "estimate.partial.json").read_text() == kept and (out / "estimate.csv").read_text() == completed
    for partial in out.glob("estimate.partial.*"):   # the user moves them away: then one that completes
        partial.unlink()
    assert cli.main([*ESTIMATE, "--loss", "bernoulli:0.01", "--out", str(out)]) == 0
    assert not list(out.glob("estimate.partial.*"))


def test_an_estimate_leaves_no_file_of_an_earlier_one(tmp_path):
    """A folder's files come from one estimate: rerun with one loss rate, the earlier grid's slowdown plot
    (two rates) goes."""
    out = tmp_path / "est"
    assert cli.main([*ESTIMATE, "--loss", "bernoulli:0.01", "--loss", "bernoulli:0.02", "--out", str(out)]) == 0
    assert (out / "slowdown.png").is_file()
    assert cli.main([*ESTIMATE, "--loss", "bernoulli:0.01", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["estimate.csv", "estimate.json", "time_by_class.png"]


def test_an_interrupted_command_is_one_line(monkeypatch, capsys):
    from lossysim.loss import demo
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(demo, "run", interrupted)
    assert cli.main(["demo"]) == 130
    assert capsys.readouterr().err.strip() == "lossysim demo: interrupted"


def test_sweep_refuses_an_unwritable_out_before_training(tmp_path, monkeypatch, capsys):
    rec = Recorder()
    monkeypatch.setattr(sweep, "_default_train", lambda: rec)
    spec = write_spec(tmp_path / "s.yaml", {"seed": [0, 1]})
    (tmp_path / "file").write_text("")
    assert cli.main(["sweep", str(spec), "--out", str(tmp_path / "file" / "r"), "--no-progress"]) == 2
    assert "--out" in one_error_line(capsys.readouterr().err, "sweep") and rec.calls == []

    def full_disk(path, text):
        raise OSError(28, "No space left on device", str(path))
    from lossysim.run import spec_record
    monkeypatch.setattr(spec_record, "atomic_write_text", full_disk)   # a sweep's first write: its spec's record
    assert cli.main(["sweep", str(spec), "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    line = one_error_line(capsys.readouterr().err, "sweep")
    assert line.endswith(f"--out {tmp_path / 'r'} is not writable: No space left on device")


# -- sweep run names ---------------------------------------------------------------------------------------
def test_sweep_names_fsdp_runs_and_finds_folders_named_before(tmp_path, monkeypatch):
    spec = sweep.load_spec(write_spec(tmp_path / "s.yaml", {"dp_mode": ["ddp", "fsdp"]}, dp_size=2, tp_size=1))
    ddp, fsdp = sweep.expand(spec, tmp_path / "r")
    assert ddp.dir_name == f"none_tp1_seed0-{ddp.key}"   # unchanged: sweeps under way find their runs
    assert fsdp.dir_name == f"none_tp1_seed0_fsdp-{fsdp.key}"
    # A folder an earlier version named without dp_mode is the same run: resumed, not run again.
    rec = Recorder()
    monkeypatch.setattr(sweep, "_default_train", lambda: rec)
    sweep.run_sweep(spec, tmp_path / "r", progress=False, check=False)
    (tmp_path / "r" / fsdp.dir_name).rename(tmp_path / "r" / f"none_tp1_seed0-{fsdp.key}")
    again = sweep.expand(spec, tmp_path / "r")
    assert [r.dir_name for r in again] == [ddp.dir_name, f"none_tp1_seed0-{fsdp.key}"]
    rec.calls.clear()
    assert sweep.run_sweep(spec, tmp_path / "r", progress=False, check=False).skipped == 2
    assert rec.calls == []


# -- the small things ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_atomic_writes_get_the_mode_open_would_give(tmp_path, umask):
    previous = os.umask(umask)
    try:
        io.atomic_write_text(tmp_path / "atomic.txt", "x")
        (tmp_path / "plain.txt").write_text("x")
    finally:
        os.umask(previous)
    mode = stat.S_IMODE((tmp_path / "atomic.txt").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == 0o666 & ~umask


def test_fit_names_a_binary_file_and_never_suggests_unpickling(tmp_path, capsys):
    import pickle
    binary = tmp_path / "trace.txt"
    binary.write_bytes(b"01\xff\xfe01")
    assert cli.main(["fit", str(binary)]) == 2
    line = one_error_line(capsys.readouterr().err, "fit")
    assert str(binary) in line and "0xff at offset 2" in line
    fake = tmp_path / "trace.npy"
    fake.write_bytes(pickle.dumps([0, 1, 1]))
    assert cli.main(["fit", str(fake)]) == 2
    line = one_error_line(capsys.readouterr().err, "fit")
    assert str(fake) in line and "not a valid .npy trace" in line and "pickle" not in line


def test_kernel_counts_of_a_runner_shape_make_transformers_say_nothing(monkeypatch):
    import logging

    from lossysim.estimate import shapes
    from lossysim.models import cost
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    monkeypatch.setattr(cost, "_count", cost._count.__wrapped__)   # counted afresh, not from another test
    logging.Logger.warning_once.cache_clear()   # transformers says each warning once per process
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        shapes.load("tiny")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []
