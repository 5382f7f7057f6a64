"""A machine that cannot reach the Hugging Face hub (air-gapped cluster), offline mode NOT set:
loads that need the hub fail in seconds with one line, a sweep stops before its first run, and
what needs no hub (a local model directory, the synthetic data) still trains.

The network is simulated: HF_ENDPOINT points at a closed local port (nothing listens on port 9),
and the hub caches are empty folders, so nothing here goes online.
"""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import yaml

from lossysim import cli, hub
from lossysim.run import sweep

CLOSED = "http://127.0.0.1:9"
SMALL = ["--steps", "1", "--max-train-samples", "64", "--max-eval-samples", "32", "--no-progress",
         "--set", "eval_every=1", "--set", "batch_size=8"]


@pytest.fixture
def unreachable(monkeypatch, tmp_path):
    """No offline variables, an endpoint nobody answers, empty caches; counts connection attempts."""
    import datasets.config
    import huggingface_hub.constants as constants
    for var in hub.OFFLINE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", CLOSED)
    monkeypatch.setenv("LOSSYSIM_CACHE", str(tmp_path / "lossysim-cache"))
    # The libraries read these at import (the suite imports them offline): undo that here.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", CLOSED)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", CLOSED + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    attempts = []
    real = socket.create_connection

    def counted(address, *args, **kwargs):
        attempts.append(address)
        return real(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", counted)
    hub.reset()
    yield attempts
    hub.reset()


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("lossysim ")]
    assert len(lines) == 1, err
    return lines[0]


def test_probe_says_unreachable_once_and_switches_offline_on(unreachable):
    import huggingface_hub.constants as constants
    assert hub.hub_reachable() is False
    assert hub.hub_reachable() is False
    assert len(unreachable) == 1                     # one probe per process, not one per load
    assert constants.HF_HUB_OFFLINE is True          # later loads answer from the cache at once
    assert "127.0.0.1:9" in hub.why_unavailable()


def test_user_offline_mode_is_honoured_without_probing(unreachable, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert hub.hub_reachable() is False
    assert unreachable == []
    assert "HF_DATASETS_OFFLINE=1" in hub.why_unavailable()


def test_probe_goes_to_the_proxy_when_one_is_set(unreachable, monkeypatch):
    """On a cluster whose only way out is a proxy, the proxy is what must answer."""
    for var in ("NO_PROXY", "no_proxy", "https_proxy", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://huggingface.co")
    monkeypatch.setenv("HTTPS_PROXY", CLOSED)
    assert hub.hub_reachable() is False
    assert unreachable == [("127.0.0.1", 9)]


def test_train_with_hub_model_fails_fast_in_one_line(unreachable, tmp_path, capsys):
    started = time.monotonic()
    code = cli.main(["train", "--model", "gpt2", "--dataset", "synthetic", "--out", str(tmp_path / "run"), *SMALL])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code != 0
    assert elapsed < 10, f"took {elapsed:.1f} s"
    line = _one_error_line(err)
    assert "'gpt2'" in line and "could not be reached" in line
    assert "Retrying in" not in err                  # no backoff: the hub was never asked
    assert len(unreachable) == 1
    assert code == 2 and not (tmp_path / "run").exists()   # refused before the run directory is made


def _spec(tmp_path: Path, **base) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"model": "tiny", "steps": 1, **base, "grid": {"seed": [0, 1, 2, 3]}}))
    return path


def test_sweep_needing_unreachable_dataset_stops_before_its_first_run(unreachable, tmp_path, capsys):
    spec, out = _spec(tmp_path, dataset="mnli"), tmp_path / "results"
    started = time.monotonic()
    code = cli.main(["sweep", str(spec), "--out", str(out), "--no-progress"])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 2
    assert elapsed < 10, f"took {elapsed:.1f} s"
    line = _one_error_line(err)
    assert "dataset 'mnli'" in line and "4 of the 4 runs" in line and "could not be reached" in line
    assert not out.exists() or not any(out.rglob("summary.*"))   # nothing that looks like a result


def test_sweep_preflight_trains_nothing(unreachable, tmp_path):
    calls = []
    spec = sweep.load_spec(_spec(tmp_path, model="gpt2", dataset="synthetic"))
    with pytest.raises(ValueError, match=r"model 'gpt2' cannot be loaded here, so 4 of the 4 runs"):
        sweep.run_sweep(spec, tmp_path / "results", train=lambda *a, **k: calls.append(a), progress=False)
    assert calls == []
    assert not (tmp_path / "results").exists()


def test_identical_environmental_failure_stops_the_sweep(tmp_path):
    """A failure of this machine shared by every remaining run is not repeated run after run."""
    calls = []

    def unreachable_train(config, run_dir, **kwargs):
        calls.append(config.seed)
        raise ValueError("dataset=mnli: cannot load nyu-mll/glue/mnli: the hub could not be reached")

    spec = sweep.load_spec(_spec(tmp_path, dataset="synthetic"))
    with pytest.raises(ValueError, match=r"sweep stopped: .* the 3 remaining runs share"):
        sweep.run_sweep(spec, tmp_path / "results", train=unreachable_train, progress=False, check=False)
    assert len(calls) == 1
    statuses = [json.loads(p.read_text())["status"] for p in (tmp_path / "results").glob("*/summary.json")]
    assert statuses == ["failed"]


def test_settings_failure_does_not_stop_the_sweep(tmp_path):
    calls = []

    def bad_train(config, run_dir, **kwargs):
        calls.append(config.seed)
        raise ValueError("loss went somewhere odd")

    spec = sweep.load_spec(_spec(tmp_path, dataset="synthetic"))
    result = sweep.run_sweep(spec, tmp_path / "results", train=bad_train, progress=False, check=False)
    assert len(calls) == 4 and result.count("failed") == 4


def test_local_model_directory_and_synthetic_data_train_offline(unreachable, tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel
    model_dir = tmp_path / "my-gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=128, vocab_size=300)).save_pretrained(model_dir)
    out = tmp_path / "run"
    code = cli.main(["train", "--model", str(model_dir), "--dataset", "synthetic", "--out", str(out),
                     "--set", "tokenizer=bpe", *SMALL])
    assert code == 0, capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
    assert unreachable == []                         # nothing it needs is on the hub: no probe at all
