"""Threads and jobs change how fast runs go, never what they compute: a run at 1 and 2 threads, and a sweep at
--jobs 1 and --jobs 2 (its runs in worker processes side by side), write the same metrics; the pool resumes,
refuses a bad count, and stops on Ctrl-C with exit 130."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from lossysim import cli
from lossysim.config import ExperimentConfig, cores, default_jobs
from lossysim.io import read_jsonl
from lossysim.run import sweep
from lossysim.run.experiment import run_experiment
from tiny_runs import TINY, tiny_run

ROOT = Path(__file__).resolve().parents[1]
# How a run went (its wall clock, its speed, where it was written), not what it computed.
HOW = ("wall_time_s", "tokens_per_s", "versions", "name")
SMALL = dict(TINY, steps=4, eval_every=2, log_every=1, max_train_samples=64, max_eval_samples=32)


def _what(run_dir: Path) -> tuple[dict, list]:
    """A run's summary and metrics rows without what says how it ran."""
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in HOW:
        summary.pop(key, None)
    for key in ("out", "name", "threads"):
        summary["config"].pop(key)
    rows = [{k: v for k, v in row.items() if k not in ("time_s", "tokens_per_s")}
            for row in read_jsonl(run_dir / "metrics.jsonl")]
    return summary, rows


def _close(a, b, path=""):
    """Equal, floats to 1e-6 relative (and where they differ, say so)."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for key in a:
            _close(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-12), path
    else:
        assert a == b, path


def test_threads_change_no_figure(tmp_path):
    """Every count, accuracy, packet and simulated second is exact; float32 means over a batch (a step's and an
    evaluation's loss, the ranks' hidden states' relative difference) are split over threads above torch's
    grain size and summed in another order: equal to float32's rounding (seen: 1 ulp, not growing with steps,
    so the weights train alike)."""
    before = torch.get_num_threads()
    try:
        runs = {}
        for threads in (1, 2):
            config = tiny_run(tmp_path / f"t{threads}", **SMALL, loss="bernoulli:0.05", threads=threads)
            summary = run_experiment(config, config.out, progress=False)
            assert summary["status"] == "completed"
            assert summary["config"]["threads"] == threads and torch.get_num_threads() == threads
            runs[threads] = _what(Path(config.out))
    finally:
        torch.set_num_threads(before)
    (one, rows_one), (two, rows_two) = runs[1], runs[2]
    assert rows_one
    _close(one, two)
    _close(rows_one, rows_two)
    for split, final in one["final"].items():
        assert final["accuracy"] == two["final"][split]["accuracy"]
    assert one["packets"] == two["packets"] and one["sim_time"] == two["sim_time"]
    exact = ("step", "split", "accuracy", "sim_time_s", "disagreement", "observed_loss_rate")
    assert [{k: r.get(k) for k in exact} for r in rows_one] == [{k: r.get(k) for k in exact} for r in rows_two]


def test_threads_stay_out_of_a_runs_identity():
    assert sweep.config_key(ExperimentConfig(threads=2)) == sweep.config_key(ExperimentConfig())
    with pytest.raises(ValueError, match=r"^threads=0 must be a whole number >= 1$"):
        ExperimentConfig(threads=0).validate()


def _spec(path: Path) -> Path:
    path.write_text(yaml.safe_dump({"name": "j", **SMALL, "grid": {"loss": ["none", "bernoulli:0.05"]}}))
    return path


def test_a_run_never_depends_on_what_ran_beside_it(tmp_path):
    spec = sweep.load_spec(_spec(tmp_path / "j.yaml"))
    one = sweep.run_sweep(spec, tmp_path / "one", progress=False, jobs=1)
    runs = sweep.shard(sweep.expand(spec, tmp_path / "two"), 1, 1)
    assert sweep.side_by_side(runs, 2, None) == 2   # lossysim's own trainer: worker processes
    two = sweep.run_sweep(spec, tmp_path / "two", progress=False, jobs=2)
    assert one.ran == two.ran == 2 and one.exit_code == two.exit_code == 0
    assert list(one.statuses.values()) == list(two.statuses.values()) == ["completed"] * 2
    assert list(one.statuses) == list(two.statuses)   # grid order, whatever finished first
    for name in one.statuses:
        assert _what(tmp_path / "one" / name) == _what(tmp_path / "two" / name), name
    again = sweep.run_sweep(spec, tmp_path / "two", progress=False, jobs=2)   # resumed: nothing to do
    assert (again.ran, again.skipped) == (0, 2)
    table = (tmp_path / "two" / "summary.csv").read_text().splitlines()
    assert len(table) == 3


def test_a_trainer_handed_in_runs_here_one_at_a_time(tmp_path):
    spec = sweep.load_spec(_spec(tmp_path / "j.yaml"))
    runs = sweep.expand(spec, tmp_path / "o")
    assert sweep.side_by_side(runs, 2, lambda *a, **k: {}) == 1
    assert sweep.side_by_side(runs[:1], 2, None) == 1
    dist = [r.__class__(r.config.replace(backend="dist"), r.key, r.dir_name) for r in runs]
    assert sweep.side_by_side(dist, 2, None) == 1


def test_jobs_default_to_the_cores_available(capsys):
    assert default_jobs() == cores() == len(os.sched_getaffinity(0))
    with pytest.raises(SystemExit):
        cli.main(["sweep", "x.yaml", "--help"])
    assert f"the cores available here, {cores()}" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("flag", ["--jobs", "--threads"])
def test_a_bad_count_is_one_line_and_exit_2(tmp_path, capsys, flag):
    assert cli.main(["sweep", str(_spec(tmp_path / "j.yaml")), "--out", str(tmp_path / "o"), flag, "0",
                     "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"lossysim sweep: error: {flag[2:]}=0 must be a whole number >= 1"
    assert not (tmp_path / "o").exists()


def _foreground(command: list[str]) -> list[str]:
    """``command`` with Ctrl-C's default action, as a terminal's foreground job has it: a job a shell script
    sends to the background (``&``) inherits SIGINT ignored, and so would the sweep, which then runs on."""
    again = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    return [sys.executable, "-c", again, *command]


def test_ctrl_c_stops_every_job_with_exit_130_and_the_sweep_resumes(tmp_path):
    spec = _spec(tmp_path / "j.yaml")
    out = tmp_path / "o"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [sys.executable, "-m", "lossysim", "sweep", str(spec), "--out", str(out), "--jobs", "2",
               "--no-progress", "--set", "steps=200", "--set", "eval_every=100"]
    proc = subprocess.Popen(_foreground(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and len(list(out.glob("*/metrics.jsonl"))) < 2:
        time.sleep(0.5)   # both jobs are training
    assert len(list(out.glob("*/metrics.jsonl"))) == 2, proc.communicate(timeout=60)
    os.killpg(proc.pid, signal.SIGINT)   # what a terminal's Ctrl-C does: every process of the group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.splitlines() == ["lossysim sweep: interrupted"], err   # no traceback, no leaked semaphore
    gone = time.time() + 60   # no worker left behind (multiprocessing's resource tracker ends just after)
    while time.time() < gone:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
    assert not any((d / "summary.json").exists() for d in out.iterdir() if d.is_dir())
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "2 run now, 0 already done): 2 completed" in done.stdout
