"""Experiment tracking (report_to): TensorBoard event files read back, W&B offline, clear errors."""
import importlib.util
import math

import pytest
import yaml

from lossysim.run import tracking
from lossysim.cli import main
from lossysim.config import ExperimentConfig, from_dict
from lossysim.io import read_jsonl
from lossysim.run.experiment import run_experiment
from tiny_runs import tiny_run


pytestmark = pytest.mark.usefixtures("private_cache")


def tiny(tmp_path, **changes) -> ExperimentConfig:
    sizes = dict(max_train_samples=64, max_eval_samples=32, steps=4, eval_every=2, log_every=1, warmup_steps=1,
                 dropout=0.0, loss="bernoulli:0.05")
    return tiny_run(tmp_path / "run", **{**sizes, **changes})


def test_report_to_takes_hf_values_and_lists():
    assert tracking.parse_report_to("none") == ()
    assert tracking.parse_report_to("tensorboard") == ("tensorboard",)
    assert tracking.parse_report_to("wandb, tensorboard") == ("wandb", "tensorboard")
    assert tracking.parse_report_to(["tensorboard", "wandb"]) == ("tensorboard", "wandb")
    assert from_dict({"report_to": ["tensorboard", "wandb"]}).report_to == "tensorboard,wandb"
    for bad, needle in (("mlflow", "mlflow"), ("none,wandb", "'none' cannot")):
        with pytest.raises(ValueError, match=needle) as err:
            from_dict({"report_to": bad})
        assert str(err.value).startswith("report_to=")


def _numeric(row):
    return {k: v for k, v in row.items() if k not in ("step", "split") and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


def test_tensorboard_holds_what_metrics_jsonl_holds(tmp_path):
    config = tiny(tmp_path, report_to="tensorboard")
    summary = run_experiment(config, config.out, progress=False)
    assert summary["status"] == "completed", summary.get("error")
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    scalars = tracking.read_tensorboard(tmp_path / "run")
    expected = {}
    for row in rows:
        for key, value in _numeric(row).items():
            expected.setdefault(f"{row['split']}/{key}", []).append((row["step"], value))
    assert set(scalars) == set(expected)
    assert {"train/loss", "train/accuracy", "validation_matched/accuracy", "validation_mismatched/loss"} <= set(scalars)
    for tag, points in expected.items():
        got = scalars[tag]
        assert [s for s, _ in got] == [s for s, _ in points], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in points], rel=1e-6, abs=1e-6), tag  # float32
    logged = yaml.safe_load(tracking.read_tensorboard_text(tmp_path / "run").strip("`").removeprefix("yaml\n"))
    assert logged == config.to_dict()


def test_no_tracker_writes_nothing_extra(tmp_path):
    config = tiny(tmp_path, steps=2)
    assert run_experiment(config, config.out, progress=False)["status"] == "completed"
    assert not (tmp_path / "run" / "tensorboard").exists() and not (tmp_path / "run" / "wandb").exists()


def test_missing_wandb_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    code = main(["train", "--no-progress", "--out", str(tmp_path / "r"), "--steps", "2",
                 "--set", "max_train_samples=32", "--set", "max_eval_samples=16", "--set", "report_to=wandb"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1, err
    assert "report_to=wandb" in err and "pip install 'lossysim[wandb]'" in err
    assert code == 2 and not (tmp_path / "r").exists()   # refused before the run directory is made


def test_wandb_offline_run_records_the_metrics(tmp_path, monkeypatch):
    """Offline W&B, for real: every metrics.jsonl value reaches the live run's log at its step (the
    offline run file itself has no reader in wandb), the run's config is the experiment's, and the
    offline run lands in the run directory."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged, configs = [], []
    start = tracking._WandB.__init__

    def spy(self, *args, **kwargs):
        start(self, *args, **kwargs)
        configs.append(dict(self.run.config))
        real_log = self.run.log
        self.run.log = lambda data, step: (logged.append((step, dict(data))), real_log(data, step=step))

    monkeypatch.setattr(tracking._WandB, "__init__", spy)
    config = tiny(tmp_path, report_to="wandb,tensorboard")
    summary = run_experiment(config, config.out, progress=False)
    assert summary["status"] == "completed", summary.get("error")
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))[0].stat().st_size > 1000
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert logged == [(row["step"], {f"{row['split']}/{k}": v for k, v in _numeric(row).items()}) for row in rows]
    assert configs == [config.to_dict()]
