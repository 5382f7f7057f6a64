"""Sweeps: grid expansion, stable run names, resume after SIGKILL, shards, failures, torchrun launch."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from lossysim import cli
from lossysim.run import sweep
from lossysim.config import ExperimentConfig, save_yaml
from lossysim.io import append_jsonl, atomic_write_json, read_jsonl
from lossysim.loss import parse_loss_model

ROOT = Path(__file__).resolve().parents[1]
SPLITS = ("validation_matched", "validation_mismatched")


def fake_accuracy(config: ExperimentConfig, split: str = "validation_matched") -> float:
    """A made-up accuracy that falls with the loss rate, more for bursts, and moves with the seed."""
    model = parse_loss_model(config.loss)
    burst_penalty = 1.5 if (not model.lossless and model.mean_burst > 2) else 1.0
    shift = 0.0 if split == "validation_matched" else -0.01
    # Each layout learns a little differently, so a setting compared with another layout's baseline shows.
    layout = (0.01 * (config.pp_size - 1) + 0.002 * (config.n_microbatches - 1) + 0.003 * (config.dp_size - 1)
              + (0.004 if config.pp_schedule == "gpipe" else 0.0))
    return 0.9 - model.loss_rate * burst_penalty + 0.01 * config.seed + shift - layout


def fake_step_s(config: ExperimentConfig) -> float:
    """A fake run's simulated seconds per step: 1 ms, stretched by loss, and for ``p`` equal stages and ``m``
    micro-batches with free sends the schedule's closed form, (m + p - 1) / (m p) of one stage's work."""
    p, m = config.pp_size, config.n_microbatches
    return 1e-3 * (1 + 10 * parse_loss_model(config.loss).loss_rate) * ((m + p - 1) / (m * p) if p > 1 else 1.0)


def fake_pipeline(config: ExperimentConfig) -> dict:
    """summary.json's ``pipeline`` section of a fake run with stages: bubble (p - 1) / (m + p - 1), and the
    configured rate lost on the boundaries' lossy directions."""
    p, m = config.pp_size, config.n_microbatches
    rate = parse_loss_model(config.loss).loss_rate
    lossy = config.pp_lossy()
    sent = {d: 10000 for d in ("fwd", "bwd")}
    lost = {d: round(sent[d] * rate) if d in lossy else 0 for d in sent}
    section = {"pp_size": p, "pp_schedule": config.pp_schedule, "microbatches": m, "bubble": (p - 1) / (m + p - 1),
               "pipeline_s_per_step": fake_step_s(config), "pp_s_per_step": 0.0,
               "observed_loss_rate_pp": sum(lost.values()) / sum(sent[d] for d in lossy) if lossy else 0.0,
               "packets_by_boundary": [[{"direction": d, "link_class": "inter", "sent": sent[d], "lost": lost[d]}
                                        for d in sent]] * (p - 1)}
    for d in sent:
        section.update({f"packets_sent_pp_{d}": sent[d] * (p - 1), f"packets_lost_pp_{d}": lost[d] * (p - 1)})
    return section


def fake_run_experiment(config: ExperimentConfig, run_dir, *, progress=True, position=0, status="completed",
                        error=None):
    """Stands in for lossysim.run.experiment.run_experiment: writes a plausible run directory."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_yaml(config, run_dir / "config.yaml")
    model = parse_loss_model(config.loss)
    lossy = config.network_spec().lossy
    metrics = run_dir / "metrics.jsonl"
    for step in range(config.eval_every, config.steps + 1, config.eval_every):
        frac = step / config.steps
        clock = fake_step_s(config) * step  # the simulated clock every run writes
        append_jsonl(metrics, {"step": step, "split": "train", "time_s": 0.1 * step, "sim_time_s": clock,
                               "loss": 1.0 - 0.5 * frac,
                               "accuracy": 0.5 + 0.3 * frac, "lr": config.lr, "tokens_per_s": 1000.0,
                               "observed_loss_rate": model.loss_rate, "disagreement": model.loss_rate,
                               "hidden_rel_diff": model.loss_rate})
        for split in SPLITS:
            append_jsonl(metrics, {"step": step, "split": split, "time_s": 0.1 * step, "sim_time_s": clock,
                                   "loss": 1.0 - 0.5 * frac,
                                   "accuracy": 0.34 + (fake_accuracy(config, split) - 0.34) * frac,
                                   "observed_loss_rate": model.loss_rate, "disagreement": model.loss_rate})
    final = {s: {"accuracy": fake_accuracy(config, s), "loss": 0.5, "step": config.steps} for s in SPLITS}
    packets = []
    for direction in ("fwd", "bwd"):
        rate = model.loss_rate if direction in lossy else 0.0
        burst = model.mean_burst if direction in lossy else 0.0
        packets.append({"direction": direction, "sent": 100000, "lost": round(100000 * rate), "sent_bad": 0,
                        "bursts": 0, "configured_loss_rate": rate, "observed_loss_rate": rate,
                        "configured_mean_burst": burst, "observed_mean_burst": burst})
    summary = {"status": status, "error": error, "name": config.name,
               "dataset": "synthetic-nli (synthetic, not MNLI)", "config": config.to_dict(),
               "steps": config.steps if status == "completed" else config.steps // 2,
               "wall_time_s": 1.0, "tokens_per_s": 1000.0, "final": final, "best": final,
               "packets": {"train": packets, "eval": packets}, "packets_by_site": {"train": [], "eval": []},
               "disagreement": {"final_eval": model.loss_rate / 2, "final_eval_hidden_rel_diff": 0.0,
                                "mean_train": model.loss_rate},
               "diverged_at": {"step": config.steps // 2} if status == "diverged" else None, "versions": {},
               "sim_time": {"total_s": fake_step_s(config) * config.steps}}
    if config.pp_size > 1:
        summary["pipeline"] = fake_pipeline(config)
    atomic_write_json(run_dir / "summary.json", summary)
    return summary


class Recorder:
    """A fake trainer that remembers what it ran; ``outcome(config)`` picks a status or raises."""

    def __init__(self, outcome=None):
        self.calls: list[str] = []
        self.resumed: list[str] = []
        self.outcome = outcome

    def __call__(self, config, run_dir, *, progress=True, position=0, resume=False):
        assert position == 1, "the run's bar must sit below the sweep's"
        self.calls.append(Path(run_dir).name)
        if resume:
            self.resumed.append(Path(run_dir).name)
        status = self.outcome(config) if self.outcome else "completed"
        return fake_run_experiment(config, run_dir, status=status,
                                   error=None if status != "failed" else "fake failure")


def write_spec(path: Path, grid: dict, **base) -> Path:
    spec = {"name": "t", "model": "tiny", "dataset": "synthetic", "steps": 4, "eval_every": 2, **base,
            "grid": grid}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(sweep, "_default_train", lambda: rec)
    return rec


LOSSES = ["none", "bernoulli:0", "bernoulli:0.01", "ge:rate=0,burst=8", "ge:rate=0.01,burst=8"]


def test_expand_dedupes_lossless_specs_and_names_runs_stably(tmp_path):
    spec = sweep.load_spec(write_spec(tmp_path / "s.yaml", {"loss": LOSSES, "seed": [0, 1]}))
    runs = sweep.expand(spec, tmp_path / "a")
    # none, bernoulli:0 and ge:rate=0 are one experiment: 3 distinct losses x 2 seeds.
    assert len(runs) == 6
    names = sorted(r.dir_name for r in runs)
    prefixes = sorted(n.rsplit("-", 1)[0] for n in names)
    assert prefixes == sorted(f"{p}_tp2_seed{s}" for p in ("none", "bernoulli-0.01", "ge-0.01-b8") for s in (0, 1))
    for run in runs:
        assert len(run.key) == 8 and int(run.key, 16) >= 0
        assert run.dir_name.endswith("-" + run.key)
        assert Path(run.config.out) == tmp_path / "a" / run.dir_name
    # The output folder, the name and the device do not change what is trained; lr does.
    again = sweep.expand(sweep.load_spec(tmp_path / "s.yaml", {"device": "cpu", "name": "other"}), tmp_path / "b")
    assert sorted(r.dir_name for r in again) == names
    changed = sweep.expand(sweep.load_spec(tmp_path / "s.yaml", {"lr": "1e-3"}), tmp_path / "a")
    assert not set(r.dir_name for r in changed) & set(names)
    # Lossless runs are normalised whatever the grid said about direction and recovery.
    spec = sweep.load_spec(write_spec(tmp_path / "d.yaml", {"loss": ["none", "bernoulli:0.02"],
                                                             "lossy": ["fwd", "bwd"], "recovery": ["zero", "rescale"]}))
    runs = sweep.expand(spec, tmp_path / "d")
    assert len(runs) == 1 + 4
    baseline = [r for r in runs if r.config.loss == "none"]
    assert len(baseline) == 1 and baseline[0].config.lossy == "both" and baseline[0].config.recovery == "zero"


def test_pipeline_runs_name_their_stages_and_one_stage_keeps_its_old_name(tmp_path):
    spec = sweep.load_spec(write_spec(tmp_path / "s.yaml", [
        {"pp_size": [1], "microbatches": [None, 2]},             # one stage: accumulation is not named, as before
        {"pp_size": [2], "pp_schedule": ["1f1b", "gpipe"], "microbatches": [None, 2, 4]},
    ], tp_size=1, batch_size=8))
    runs = sweep.expand(spec, tmp_path / "r")
    names = [r.dir_name.rsplit("-", 1)[0] for r in runs]
    # microbatches 2 with 2 stages is the default (pp_size): the same run as none given, run once
    assert names == ["none_tp1_seed0", "none_tp1_seed0", "none_tp1_pp2_seed0", "none_tp1_pp2_m4_seed0",
                     "none_tp1_pp2_gpipe_seed0", "none_tp1_pp2_gpipe_m4_seed0"]
    assert len({r.key for r in runs}) == len(runs)   # (one stage's hash is tested in test_pipeline.py)


def test_spec_base_file_and_grid_list(tmp_path):
    (tmp_path / "base.yaml").write_text("model: tiny\ndataset: synthetic\nsteps: 9\nlr: 0.002\n")
    (tmp_path / "s.yaml").write_text(textwrap.dedent("""\
        base: base.yaml
        steps: 5
        grid:
          - {loss: ["bernoulli:0.01", "bernoulli:0.02"]}
          - {loss: ["bernoulli:0.01"], lossy: [fwd]}
        """))
    runs = sweep.expand(sweep.load_spec(tmp_path / "s.yaml"), tmp_path / "out")
    assert len(runs) == 3
    assert {r.config.steps for r in runs} == {5} and {r.config.lr for r in runs} == {0.002}
    assert sorted(r.config.lossy for r in runs) == ["both", "both", "fwd"]


def test_spec_base_may_be_an_inline_mapping(tmp_path, recorder, capsys):
    (tmp_path / "s.yaml").write_text(textwrap.dedent("""\
        base: {model: tiny, dataset: synthetic, steps: 7, lr: 0.003}
        eval_every: 7
        grid: {loss: [none, "bernoulli:0.01"]}
        """))
    runs = sweep.expand(sweep.load_spec(tmp_path / "s.yaml"), tmp_path / "out")
    assert len(runs) == 2 and {(r.config.steps, r.config.lr, r.config.eval_every) for r in runs} == {(7, 0.003, 7)}
    assert cli.main(["sweep", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    assert len(recorder.calls) == 2
    for bad in ("[1, 2]", "3", "{lr: fast}", "{nope: 1}"):
        (tmp_path / "bad.yaml").write_text(f"base: {bad}\ngrid: {{seed: [0]}}\n")
        assert cli.main(["sweep", str(tmp_path / "bad.yaml"), "--out", str(tmp_path / "b"), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and ("base" in err or "lr" in err or "nope" in err), err
    assert len(recorder.calls) == 2 and not (tmp_path / "b").exists()


def slurm(task, count, low=0, step=None):
    env = {"SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_COUNT": str(count),
           "SLURM_ARRAY_TASK_MIN": str(low), "SLURM_ARRAY_JOB_ID": "4242"}
    if step is not None:
        env["SLURM_ARRAY_TASK_STEP"] = str(step)
    return env


def test_shard_auto_reads_the_slurm_job_array():
    assert [sweep.parse_shard("auto", slurm(t, 4)) for t in range(4)] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert sweep.parse_shard("auto", slurm(7, 3, low=5)) == (3, 3)            # --array=5-7
    assert sweep.parse_shard("auto", slurm(10, 3, low=2, step=4)) == (3, 3)   # --array=2-10:4
    no_count = {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "4"}
    assert sweep.parse_shard("auto", no_count) == (3, 4)
    for env, needle in (({}, "SLURM_ARRAY_TASK_ID"), (slurm(9, 3), "outside"), (slurm(1, 3, low=0, step=2), "not in"),
                        ({**slurm(1, 3), "SLURM_ARRAY_TASK_COUNT": "x"}, "SLURM_ARRAY_TASK_COUNT"),
                        ({"SLURM_ARRAY_TASK_ID": "1"}, "SLURM_ARRAY_TASK_COUNT")):
        with pytest.raises(ValueError, match=needle):
            sweep.parse_shard("auto", env)


def test_sbatch_template_runs_one_shard_per_array_task(tmp_path, monkeypatch):
    """The template under experiments/, run as Slurm would run each task (sbatch itself faked):
    the tasks' --dry-run listings partition the grid, and only the first task queues the report."""
    spec = write_spec(tmp_path / "s.yaml", {"loss": LOSSES + ["bernoulli:0.05"], "seed": [0, 1, 2]})
    out = tmp_path / "results"
    every = {r.dir_name for r in sweep.expand(sweep.load_spec(spec), out)}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "sbatch.log"}\n')
    (bin_dir / "sbatch").chmod(0o755)
    listed = []
    for task in (3, 5):                                               # --array=3-5:2
        env = {**os.environ, **slurm(task, 2, low=3, step=2), "PATH": f"{bin_dir}:{os.environ['PATH']}",
               "SPEC": str(spec), "OUT": str(out), "SWEEP_ARGS": "--dry-run",
               "LOSSYSIM": f"{sys.executable} -m lossysim", "PYTHONPATH": str(ROOT)}
        done = subprocess.run(["bash", str(ROOT / "experiments" / "sweep_array.sbatch")], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert f"(shard {(task - 3) // 2 + 1}/2)" in done.stdout
        listed.append({line.split()[2] for line in done.stdout.splitlines()[:-1]})
    assert set().union(*listed) == every and sum(map(len, listed)) == len(every)
    queued = (tmp_path / "sbatch.log").read_text().splitlines()
    assert len(queued) == 1 and "--dependency=afterany:4242" in queued[0] and f"report {out}" in queued[0]


def test_bad_grid_point_fails_before_anything_trains(tmp_path, recorder, capsys):
    spec = write_spec(tmp_path / "s.yaml", {"loss": ["bernoulli:0.01", "ge:rate=0.5,burst=0.5"]})
    out = tmp_path / "out"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--no-progress"]) == 2
    assert "burst" in capsys.readouterr().err
    assert recorder.calls == [] and not out.exists()
    spec = write_spec(tmp_path / "typo.yaml", {"los": ["none"]})
    assert cli.main(["sweep", str(spec), "--out", str(out), "--no-progress"]) == 2
    assert "unknown config key 'los' (did you mean loss?)" in capsys.readouterr().err
    assert recorder.calls == [] and not out.exists()


def test_set_and_grid_overrides(tmp_path, recorder, capsys):
    spec = write_spec(tmp_path / "s.yaml", {"loss": ["none"], "seed": [0]})
    out = tmp_path / "out"
    code = cli.main(["sweep", str(spec), "--out", str(out), "--no-progress", "--set", "steps=6",
                     "--grid", "seed=3 4", "--grid", "loss=none bernoulli:0.01 ge:rate=0.01,burst=4"])
    assert code == 0
    frame = pd.read_csv(out / "summary.csv")
    assert len(frame) == 6 and sorted(set(frame["seed"])) == [3, 4]
    assert set(frame["steps_done"]) == {6}
    assert sorted(set(frame["loss_model"])) == ["bernoulli", "ge", "none"]
    # A grid axis cannot be --set: the grid would silently win.
    assert cli.main(["sweep", str(spec), "--out", str(out), "--set", "seed=1"]) == 2
    assert "grid axis" in capsys.readouterr().err


def test_dry_run_lists_without_training(tmp_path, recorder, capsys):
    spec = write_spec(tmp_path / "s.yaml", {"loss": LOSSES, "seed": [0, 1]})
    out = tmp_path / "out"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 7 and all("todo" in line for line in lines[:6])
    assert recorder.calls == [] and not out.exists()


def test_shards_cover_the_grid_exactly_once(tmp_path, recorder):
    spec_path = write_spec(tmp_path / "s.yaml", {"loss": LOSSES + ["bernoulli:0.05"], "seed": [0, 1, 2]})
    out = tmp_path / "out"
    every = {r.dir_name for r in sweep.expand(sweep.load_spec(spec_path), out)}
    assert len(every) == 12
    parts = []
    for k in (1, 2, 3):
        before = len(recorder.calls)
        assert cli.main(["sweep", str(spec_path), "--out", str(out), "--shard", f"{k}/3", "--no-progress"]) == 0
        parts.append(set(recorder.calls[before:]))
        assert len(recorder.calls[before:]) == len(parts[-1])
    assert all(parts) and sum(len(p) for p in parts) == len(every)
    assert parts[0] | parts[1] | parts[2] == every
    assert not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])
    # The shards' runs merge in one summary.csv, and the whole sweep now has nothing left to do.
    frame = pd.read_csv(out / "summary.csv")
    assert sorted(frame["run_dir"]) == sorted(every) and set(frame["status"]) == {"completed"}
    calls = len(recorder.calls)
    assert cli.main(["sweep", str(spec_path), "--out", str(out), "--no-progress"]) == 0
    assert len(recorder.calls) == calls
    with pytest.raises(ValueError):
        sweep.parse_shard("4/3")
    with pytest.raises(ValueError):
        sweep.parse_shard("0/3")


def test_failed_runs_are_recorded_counted_and_retried(tmp_path, monkeypatch, capsys):
    def outcome(config):
        if config.loss == "bernoulli:0.05":
            return "failed"
        if config.loss == "bernoulli:0.1":
            raise RuntimeError("trainer crashed outside its own guard")
        if config.loss == "bernoulli:0.2":
            return "diverged"
        return "completed"

    rec = Recorder(outcome)
    monkeypatch.setattr(sweep, "_default_train", lambda: rec)
    losses = ["none", "bernoulli:0.05", "bernoulli:0.1", "bernoulli:0.2"]
    spec = write_spec(tmp_path / "s.yaml", {"loss": losses, "seed": [0]})
    out = tmp_path / "out"
    # Failed runs exit 3 (sweep.FAILED_EXIT), whatever their number: never 2, which is bad input, nothing trained.
    assert cli.main(["sweep", str(spec), "--out", str(out), "--no-progress"]) == 3
    captured = capsys.readouterr()
    assert "2 failed" in captured.out and "1 diverged" in captured.out and "failed" in captured.err
    assert len(rec.calls) == 4   # the sweep went on after each failure
    frame = pd.read_csv(out / "summary.csv").set_index("loss")
    assert frame.loc["bernoulli:0.05", "status"] == "failed"
    assert frame.loc["bernoulli:0.1", "status"] == "failed"
    assert "trainer crashed" in frame.loc["bernoulli:0.1", "error"]
    assert frame.loc["bernoulli:0.2", "status"] == "diverged" and frame.loc["none", "status"] == "completed"
    # Rerun: only the failed runs go again (from clean directories); now they succeed.
    rec.outcome = None
    assert cli.main(["sweep", str(spec), "--out", str(out), "--no-progress"]) == 0
    assert sorted(rec.calls[4:]) == sorted(n for n in rec.calls[:4] if n.startswith(("bernoulli-0.05", "bernoulli-0.1_")))
    frame = pd.read_csv(out / "summary.csv")
    assert len(frame) == 4 and sorted(frame["status"]) == ["completed"] * 3 + ["diverged"]
    result = sweep.SweepResult(runs=[], statuses={str(i): "failed" for i in range(150)})
    assert result.exit_code == 3 and sweep.SweepResult(runs=[], statuses={"a": "completed"}).exit_code == 0


def test_stale_run_directory_is_cleared(tmp_path, recorder):
    spec = write_spec(tmp_path / "s.yaml", {"loss": ["bernoulli:0.01"]})
    out = tmp_path / "out"
    (run,) = sweep.expand(sweep.load_spec(spec), out)
    run.run_dir.mkdir(parents=True)
    append_jsonl(run.run_dir / "metrics.jsonl", {"step": 999, "split": "train", "time_s": 0.0})
    (run.run_dir / "metrics.jsonl").open("a").write('{"step": 1000, "spl')   # torn by a kill
    (out / ".summary.csv.abc.tmp").write_text("half a csv")
    assert cli.main(["sweep", str(spec), "--out", str(out), "--no-progress"]) == 0
    assert recorder.calls == [run.dir_name]
    steps = [row["step"] for row in read_jsonl(run.run_dir / "metrics.jsonl")]
    assert 999 not in steps and steps == sorted(steps)
    assert not list(out.glob(".*.tmp"))


def test_checkpointing_runs_resume_instead_of_starting_over(tmp_path, recorder):
    spec = write_spec(tmp_path / "s.yaml", {"loss": ["bernoulli:0.01", "bernoulli:0.02"]}, checkpoint_every=2)
    out = tmp_path / "out"
    interrupted, failed = sweep.expand(sweep.load_spec(spec), out)
    # The checkpoint settings are not part of the experiment: same directory as without them.
    plain = sweep.expand(sweep.load_spec(spec, {"checkpoint_every": 0}), out)
    assert [r.dir_name for r in plain] == [interrupted.dir_name, failed.dir_name]
    for run in (interrupted, failed):
        (run.run_dir / "checkpoints").mkdir(parents=True)
        (run.run_dir / "checkpoints" / "marker").write_text("state")
    atomic_write_json(failed.run_dir / "summary.json", {"status": "failed", "error": "boom"})
    assert cli.main(["sweep", str(spec), "--out", str(out), "--no-progress"]) == 0
    assert sorted(recorder.calls) == sorted([interrupted.dir_name, failed.dir_name])
    assert recorder.resumed == [interrupted.dir_name]
    assert (interrupted.run_dir / "checkpoints" / "marker").exists()
    assert not (failed.run_dir / "checkpoints").exists(), "a failed run starts from a clean directory"


def test_dist_runs_go_through_torchrun(tmp_path, monkeypatch):
    launched = []

    def fake_call(cmd, **kwargs):
        launched.append(cmd)
        config_path = Path(cmd[cmd.index("--config") + 1])
        run_dir = Path(cmd[cmd.index("--out") + 1])
        config = sweep.from_dict(yaml.safe_load(config_path.read_text()))
        if config.seed == 1:
            return 1   # died without a summary (e.g. a NCCL error killed every rank)
        fake_run_experiment(config, run_dir)
        return 0

    monkeypatch.setattr(sweep.subprocess, "call", fake_call)
    monkeypatch.setattr(sweep, "_default_train", lambda: pytest.fail("dist runs must not train in-process"))
    spec = write_spec(tmp_path / "s.yaml", {"loss": ["bernoulli:0.01"], "seed": [0, 1]}, backend="dist",
                      tp_size=4)
    out = tmp_path / "out"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--no-progress"]) == sweep.FAILED_EXIT   # a failed run
    assert len(launched) == 2
    cmd = launched[0]
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc_per_node=4" in cmd
    assert cmd[cmd.index("--nproc_per_node=4") + 1:][:3] == ["-m", "lossysim", "train"]
    assert cmd[-2:] == ["--backend", "dist"]
    run_dir = Path(cmd[cmd.index("--out") + 1])
    assert Path(cmd[cmd.index("--config") + 1]) == run_dir / "config.yaml"
    assert "--resume" not in cmd
    assert sweep.dist_command(sweep.from_dict({"tp_size": 2}), run_dir, resume=True)[-1] == "--resume"
    # a process per rank: every stage's TP group too
    staged = sweep.from_dict({"tp_size": 2, "pp_size": 2, "lossy_traffic": "pp_forward"})
    assert f"--nproc_per_node={2 * 2}" in sweep.dist_command(staged, run_dir)
    frame = pd.read_csv(out / "summary.csv").set_index("seed")
    assert frame.loc[0, "status"] == "completed"
    assert frame.loc[1, "status"] == "failed" and "torchrun exited with status 1" in frame.loc[1, "error"]


# -- end to end: a real sweep killed with SIGKILL, then resumed -------------------------------------------
def tiny_spec(path: Path, losses, seeds=(0,), **extra) -> Path:
    """A sweep small enough for a test: tiny model, synthetic task, a few steps."""
    spec = {"name": "tiny", "model": "tiny", "dataset": "synthetic", "steps": 6, "batch_size": 8,
            "eval_batch_size": 32, "max_length": 32, "max_train_samples": 64, "max_eval_samples": 32,
            "eval_every": 3, "log_every": 2, "warmup_steps": 1, "tp_size": 2, **extra,
            "grid": {"loss": list(losses), "seed": list(seeds)}}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def completed_runs(out: Path) -> list[str]:
    return [p.parent.name for p in out.glob("*/summary.json") if sweep.run_status(p.parent) == "completed"]


def test_sigkilled_sweep_finishes_on_the_next_call(tmp_path):
    spec = tiny_spec(tmp_path / "tiny.yaml", ["none", "bernoulli:0.05", "ge:rate=0.05,burst=4"])
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "lossysim", "sweep", str(spec), "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    try:
        while not completed_runs(out):
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no run completed in 120 s"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done_before = completed_runs(out)
    assert 1 <= len(done_before) < 3, "the kill must land before the sweep ends"
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 already done" in result.stdout or f"{len(done_before)} already done" in result.stdout
    runs = sweep.expand(sweep.load_spec(spec), out)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(r.dir_name for r in runs)
    for run in runs:
        summary = json.loads((run.run_dir / "summary.json").read_text())
        assert summary["status"] == "completed", summary.get("error")
        assert summary["config"]["loss"] == run.config.loss
        assert summary["steps"] == 6
        rows = read_jsonl(run.run_dir / "metrics.jsonl")
        keys = [(r["step"], r["split"]) for r in rows]
        assert len(keys) == len(set(keys)), "a resumed run must not keep the killed attempt's rows"
        assert yaml.safe_load((run.run_dir / "config.yaml").read_text())["loss"] == run.config.loss
    frame = pd.read_csv(out / "summary.csv")
    assert sorted(frame["run_dir"]) == sorted(r.dir_name for r in runs)
    assert set(frame["status"]) == {"completed"}
    assert all(math.isfinite(a) for a in frame["accuracy"])
    assert not list(out.rglob(".*.tmp"))


def test_a_refused_dist_run_keeps_its_reason_and_every_rank_is_launched(tmp_path, monkeypatch):
    """torchrun's ranks refuse a setting caught only once the model is built (and write nothing in the
    run's folder): the sweep still records their one line. A tp x dp run launches tp x dp ranks."""
    launched = []

    def refusing_call(cmd, env, **kwargs):
        launched.append(cmd)
        run_dir = Path(cmd[cmd.index("--out") + 1])
        monkeypatch.setattr(os, "environ", env)   # what each rank's process sees
        code = cli.main(["train", "--config", str(run_dir / "config.yaml"), "--no-progress",
                         "--set", "n_head=3"])   # stands in for a rank's own check of the heads
        return code

    monkeypatch.setattr(sweep.subprocess, "call", refusing_call)
    spec = write_spec(tmp_path / "s.yaml", {"seed": [0]}, backend="dist", tp_size=2, dp_size=2)
    out = tmp_path / "out"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--no-progress"]) == sweep.FAILED_EXIT
    assert "--nproc_per_node=4" in launched[0]
    error = pd.read_csv(out / "summary.csv")["error"][0]
    assert error.startswith("torchrun exited with status 2: ") and "n_head" in error
    run_dir = Path(launched[0][launched[0].index("--out") + 1])
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "summary.json"]

