"""Exact resume after SIGKILL, sealed checkpoints, and faults."""
import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from lossysim.run import checkpoint
from lossysim.cli import main
from lossysim.config import ExperimentConfig
from lossysim.io import read_jsonl
from lossysim.run.experiment import run_experiment
from torchrun_launch import torchrun
from tiny_runs import tiny_run

TIMINGS = ("time_s", "tokens_per_s", "wall_time_s")
# Data parallelism at tp 2 x dp 2, losing on every kind of traffic: DDP with error feedback (a memory per
# call site on every network) and periodic syncs, FSDP with rescale (gathers and reduce-scatters).
LAYOUTS = {"tp": {},
           "ddp": dict(dp_size=2, recovery="error_feedback", dp_sync_every=5, dp_bucket_mb=0.05),
           "fsdp": dict(dp_size=2, dp_mode="fsdp", recovery="rescale", dp_bucket_mb=0.05)}
# 3-D: tp 2 x pp 2 x dp 2, every replica's stages and boundaries and every stage's DDP groups losing packets.
THREE_D = dict(pp_size=2, dp_size=2, dp_bucket_mb=0.05)


pytestmark = pytest.mark.usefixtures("private_cache")


def config_for(out, **changes) -> ExperimentConfig:
    # Dropout on and bursty loss in both directions: every random stream matters.
    sizes = dict(max_train_samples=200, max_eval_samples=64, steps=12, eval_every=6, log_every=3, warmup_steps=2,
                 dropout=0.1, loss="ge:rate=0.05,burst=4", checkpoint_every=4, keep_checkpoints=0,
                 save_checkpoint=True)
    return tiny_run(out, **{**sizes, **changes})


def _without_timings(value):
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k not in TIMINGS and k != "out"}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def assert_same_run(a: Path, b: Path):
    assert _without_timings(read_jsonl(a / "metrics.jsonl")) == _without_timings(read_jsonl(b / "metrics.jsonl"))
    summary_a, summary_b = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert summary_a["status"] == summary_b["status"] == "completed"
    assert _without_timings(summary_a) == _without_timings(summary_b)
    weights = "model.safetensors"
    assert (a / "checkpoint" / weights).read_bytes() == (b / "checkpoint" / weights).read_bytes()
    # The last checkpoints hold all the rest bit for bit: every replica's weights and optimiser state,
    # every network's chains, streams, counters and recovery memory, every random stream.
    last_a, last_b = checkpoint.latest(a), checkpoint.latest(b)
    assert last_a.name == last_b.name
    for name in sorted(p.name for p in last_a.glob("rank*.pt")):
        saved_a, saved_b = (torch.load(d / name, weights_only=True) for d in (last_a, last_b))
        for part in ("progress", "window"):  # wall-clock seconds; the rest of progress is in the summary
            saved_a.pop(part), saved_b.pop(part)
        _assert_identical(saved_a, saved_b, name)


def _assert_identical(a, b, where: str) -> None:
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_identical(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


def _wait_for(predicate, proc, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"process ended before the kill: {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    raise AssertionError("timed out waiting for the run to progress")


@pytest.mark.parametrize("layout", [*LAYOUTS, "3d"])
def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path, layout):
    changes = THREE_D if layout == "3d" else LAYOUTS[layout]
    reference = config_for(tmp_path / "reference", **changes)
    assert run_experiment(reference, reference.out, progress=False)["status"] == "completed"

    killed = config_for(tmp_path / "killed", **changes)
    config_path = tmp_path / "killed.yaml"
    config_path.write_text(yaml.safe_dump(killed.to_dict()))
    proc = subprocess.Popen([sys.executable, "-m", "lossysim", "train", "--config", str(config_path),
                             "--no-progress"], stderr=subprocess.PIPE, text=True)
    metrics = Path(killed.out) / "metrics.jsonl"

    def past_first_checkpoint():  # somewhere after step 4's checkpoint, before the end
        return checkpoint.latest(killed.out) is not None and metrics.exists() and \
            any(r["step"] >= 5 for r in read_jsonl(metrics))
    _wait_for(past_first_checkpoint, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (Path(killed.out) / "summary.json").exists()

    summary = run_experiment(killed, killed.out, progress=False, resume=True)
    assert summary["status"] == "completed", summary.get("error")
    assert_same_run(Path(reference.out), Path(killed.out))


def test_half_written_checkpoint_is_ignored_and_corrupt_one_is_an_error(tmp_path, capsys):
    config = config_for(tmp_path / "run", steps=8, eval_every=4, save_checkpoint=False)
    assert run_experiment(config, config.out, progress=False)["status"] == "completed"
    sealed = checkpoint.complete(config.out)
    assert [p.name for p in sealed] == ["step-0000004", "step-0000008"]
    # A folder being written when the process died: no manifest, never chosen.
    partial = Path(config.out) / "checkpoints" / ".step-0000012.tmp"
    partial.mkdir()
    (partial / "rank0.pt").write_bytes(b"truncated")
    assert checkpoint.latest(config.out) == sealed[-1]
    # A sealed checkpoint whose file changed: a one-line error naming it.
    data = bytearray((sealed[-1] / "rank0.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (sealed[-1] / "rank0.pt").write_bytes(bytes(data))
    (Path(config.out) / "summary.json").unlink()   # as if killed after it: a finished run is never resumed
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(config.to_dict()))
    code = main(["train", "--config", str(config_path), "--resume", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1
    assert "corrupt" in err and "step-0000008" in err


def _files(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.mark.parametrize("finished", [True, False])
def test_resume_with_a_different_experiment_is_refused(tmp_path, finished):
    """Checked against the finished run's summary, or (killed) its checkpoint."""
    config = config_for(tmp_path / "run", steps=4, save_checkpoint=False)
    assert run_experiment(config, config.out, progress=False)["status"] == "completed"
    if not finished:
        (Path(config.out) / "summary.json").unlink()
    before = _files(config.out)
    changed = config.replace(loss="bernoulli:0.2")
    with pytest.raises(ValueError, match=r"with loss='ge:rate=0.05,burst=4', this run has loss='bernoulli:0.2'"):
        run_experiment(changed, changed.out, progress=False, resume=True)
    # refused before the run took its folder over: summary, config, metrics, checkpoints as they were
    assert _files(config.out) == before


def test_resuming_a_finished_run_does_nothing(tmp_path, capsys):
    """A finished run with checkpoints is resumed by doing nothing: its summary, metrics and checkpoints stay
    byte for byte (it was cut back to its last checkpoint and trained again, so a kill then left a finished
    run with no summary). The same experiment named otherwise (a pp_layout spelling out the even split)
    is the same run."""
    config = config_for(tmp_path / "run", steps=4, save_checkpoint=False, tp_size=1, pp_size=2,
                        loss="bernoulli:0.05", lossy_traffic="pp_forward,pp_backward")
    first = run_experiment(config, config.out, progress=False)
    assert first["status"] == "completed" and checkpoint.latest(config.out) is not None
    before = _files(config.out)
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(config.to_dict()))
    for layout in ([], ["--pp-layout", "1,1"]):
        assert main(["train", "--config", str(config_path), "--resume", "--no-progress", *layout]) == 0
        assert _files(config.out) == before
    assert run_experiment(config, config.out, progress=False, resume=True) == first


def test_an_even_split_written_out_resumes_a_run_of_the_default_layout(tmp_path):
    """pp_layout 1,1 is the default's even split of two blocks into two stages: the same experiment, as
    microbatches equal to pp_size is. Another split of a deeper model is another experiment."""
    config = config_for(tmp_path / "run", steps=4, save_checkpoint=False, tp_size=1, pp_size=2,
                        loss="bernoulli:0.05", lossy_traffic="pp_forward,pp_backward")
    assert run_experiment(config, config.out, progress=False)["status"] == "completed"
    (Path(config.out) / "summary.json").unlink()   # as if killed after step 4's checkpoint
    spelled = config.replace(pp_layout="1, 1")
    summary = run_experiment(spelled, spelled.out, progress=False, resume=True)
    assert summary["status"] == "completed", summary.get("error")
    checkpoint.check_same_experiment(config.to_dict(), spelled, "here", layers=2)
    with pytest.raises(ValueError, match=r"with pp_layout=None, this run has pp_layout='1,3'"):
        checkpoint.check_same_experiment(config.to_dict(), config.replace(pp_layout="1,3"), "here", layers=4)


def _back_to_first_checkpoint(config, tmp_path):
    """A copy of a finished run cut back to its first checkpoint, as if it had stopped there."""
    resumed = tmp_path / "resumed"
    shutil.copytree(config.out, resumed)
    first, *later = checkpoint.complete(resumed)
    for path in later:
        shutil.rmtree(path)
    (resumed / "summary.json").unlink()
    return resumed, first


def test_progress_is_saved_and_resumed_as_a_plain_dict(tmp_path):
    """Checkpoints hold the run's progress as the plain dict they always held, so a checkpoint written
    before the progress had a class of its own resumes exactly, and the other way round."""
    config = config_for(tmp_path / "full", steps=8, eval_every=4)
    assert run_experiment(config, config.out, progress=False)["status"] == "completed"
    resumed, first = _back_to_first_checkpoint(config, tmp_path)
    saved = torch.load(first / "rank0.pt", weights_only=True)
    assert type(saved["progress"]) is dict
    assert list(saved["progress"]) == ["step", "best", "final", "train_disagreement", "tokens", "train_time",
                                       "compute_s", "reached", "last_row", "failures", "restart_s"]
    # Plain values only, as an older version wrote them: nothing that needs this version's classes.
    saved["progress"] = json.loads(json.dumps(saved["progress"]))
    torch.save(saved, first / "rank0.pt")
    manifest = json.loads((first / "manifest.json").read_text())
    manifest["files"]["rank0.pt"] = hashlib.sha256((first / "rank0.pt").read_bytes()).hexdigest()
    (first / "manifest.json").write_text(json.dumps(manifest))
    summary = run_experiment(config.replace(out=str(resumed)), resumed, progress=False, resume=True)
    assert summary["status"] == "completed", summary.get("error")
    assert_same_run(Path(config.out), resumed)


def _as_written_by_0_2(path: Path) -> None:
    """Rewrite a checkpoint as lossysim 0.2 wrote it: no nic settings (its selective repeat), no
    failures, the network clock as one repaired total beside the loss-free one, fewer counters."""
    saved = torch.load(path / "rank0.pt", weights_only=True)
    new_keys = ("nic", "channels", "nics_per_node", "restart_s", "restart_lost_steps", "max_failures",
                "hadamard_block")
    saved["config"] = {k: v for k, v in saved["config"].items() if k not in new_keys}
    saved["config"]["retransmit"] = "selective"
    for key in ("failures", "restart_s"):
        saved["progress"].pop(key)
    for net in ("train_net", "eval_net"):
        state = saved[net]
        state["config"] = {k: v for k, v in state["config"].items() if k not in ("nic", "channels", "nics_per_node")}
        state["config"]["retransmit"] = "selective"
        for entry in state["channels"].values():
            entry["counts"] = entry["counts"][:6]     # sent, lost, sent_bad, bursts, resent, missing
        ideal, repairs = state["clock"]["ideal_comm_s"], state["clock"]["repairs_s"]
        state["clock"] = {"comm_s": None if repairs is None else ideal + repairs[0], "fixed_comm_s": 0.0,
                          "ideal_comm_s": ideal}
    torch.save(saved, path / "rank0.pt")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["rank0.pt"] = hashlib.sha256((path / "rank0.pt").read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_written_by_0_2_resumes_exactly(tmp_path):
    """The same losses, masks, weights and clock; what 0.2 did not keep (the ideal-nic clock, timer
    waits) is counted from the resume on."""
    config = config_for(tmp_path / "full", steps=8, eval_every=4, loss="bernoulli:0.05", transport="retransmit")
    assert run_experiment(config, config.out, progress=False)["status"] == "completed"
    resumed, first = _back_to_first_checkpoint(config, tmp_path)
    _as_written_by_0_2(first)
    summary = run_experiment(config.replace(out=str(resumed)), resumed, progress=False, resume=True)
    assert summary["status"] == "completed", summary.get("error")
    ideal = ("sim_time_s_ideal_nic", "total_s_ideal_nic", "timeouts_intra", "timeouts_inter")
    strip = lambda value: _without_timings({k: v for k, v in value.items() if k not in ideal})  # noqa: E731
    full = [strip(r) for r in read_jsonl(Path(config.out) / "metrics.jsonl")]
    assert [strip(r) for r in read_jsonl(resumed / "metrics.jsonl")] == full
    assert strip(summary["sim_time"]) == strip(json.loads((Path(config.out) / "summary.json").read_text())["sim_time"])


def assert_resumes_exactly(config, resumed: Path) -> dict:
    """Run ``config`` through, then again in ``resumed`` from its first checkpoint (the later ones, the
    summary and the exported model deleted): the two end the same. The resumed run's summary."""
    assert run_experiment(config, config.out, progress=False)["status"] == "completed"
    shutil.copytree(config.out, resumed)
    for path in checkpoint.complete(resumed)[1:]:
        shutil.rmtree(path)
    (resumed / "summary.json").unlink()
    shutil.rmtree(resumed / "checkpoint", ignore_errors=True)   # (save_checkpoint's export: written again)
    summary = run_experiment(config.replace(out=str(resumed)), resumed, progress=False, resume=True)
    assert summary["status"] == "completed", summary.get("error")
    assert_same_run(Path(config.out), resumed)
    return summary


@pytest.mark.parametrize("recovery", ["hadamard", "error_feedback"])
def test_resume_keeps_what_a_recovery_policy_keeps(tmp_path, recovery):
    """The Hadamard signs' streams and the per-send buffers of error feedback (stale keeps its buffers
    the same way) travel in the checkpoint with the networks: a run resumed from step 4 ends exactly
    as the uninterrupted one."""
    config = config_for(tmp_path / "full", steps=8, eval_every=4, recovery=recovery, hadamard_block=256)
    assert_resumes_exactly(config, tmp_path / "resumed")


def test_a_checkpoint_is_read_onto_the_cpu_whatever_the_device(tmp_path, monkeypatch):
    """A generator's state must be a CPU byte tensor (a CUDA generator's too): a resumed run reads its
    checkpoint onto the CPU and each part copies its tensors to its device, so a GPU run resumes. Over TCP,
    whose congestion windows (numpy) travel in it as well; resumed exactly."""
    read, real = [], checkpoint.load
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: read.append(k.get("map_location")) or real(*a, **k))
    config = config_for(tmp_path / "full", steps=8, eval_every=4, transport="retransmit", nic="tcp")
    assert_resumes_exactly(config, tmp_path / "resumed")
    assert read == ["cpu"]


def test_keep_last_k_checkpoints(tmp_path):
    config = config_for(tmp_path / "run", steps=6, checkpoint_every=2, keep_checkpoints=2,
                        save_checkpoint=False, eval_every=6)
    assert run_experiment(config, config.out, progress=False)["status"] == "completed"
    assert [p.name for p in checkpoint.complete(config.out)] == ["step-0000004", "step-0000006"]




@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dist_resume_from_mid_run_checkpoint_is_exact(tmp_path, layout):
    """Two processes: tp 2, or tp 1 x dp 2 (each rank's file holds its replica and its data-parallel
    network)."""
    changes = dict(LAYOUTS[layout], tp_size=1) if layout != "tp" else {}
    config = config_for(tmp_path / "full", backend="dist", dropout=0.0, **changes)
    config_path = tmp_path / "dist.yaml"
    config_path.write_text(yaml.safe_dump(config.to_dict()))
    proc = torchrun(["train", "--no-progress", "--config", str(config_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The same run as if killed after step 4's checkpoint: later files gone, resume from step 4.
    resumed = tmp_path / "resumed"
    shutil.copytree(config.out, resumed)
    for later in checkpoint.complete(resumed)[1:]:
        shutil.rmtree(later)
    for name in ("summary.json", "checkpoint"):
        shutil.rmtree(resumed / name, ignore_errors=True) if name == "checkpoint" else (resumed / name).unlink()
    proc = torchrun(["train", "--no-progress", "--config", str(config_path), "--out", str(resumed), "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "step-0000004" in proc.stderr
    assert_same_run(Path(config.out), resumed)
    if layout == "tp":   # finished now: every rank learns from rank 0 that there is nothing to resume
        before = _files(resumed)
        proc = torchrun(["train", "--no-progress", "--config", str(config_path), "--out", str(resumed), "--resume"])
        assert proc.returncode == 0 and "nothing to resume" in proc.stderr, proc.stderr[-3000:]
        assert _files(resumed) == before


class _Payload:
    """What a hostile checkpoint would carry: unpickling it runs a command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("form", ["torch", "pickle"])
def test_a_checkpoint_carrying_code_is_refused_without_running_it(tmp_path, capsys, form):
    """A rank file replaced by one whose unpickling runs a command, its manifest checksum rewritten to
    match: resume refuses it in one line naming the file, and the command never runs."""
    config = config_for(tmp_path / "run", steps=4, eval_every=4, save_checkpoint=False)
    assert run_experiment(config, config.out, progress=False)["status"] == "completed"
    sealed = checkpoint.latest(config.out)
    marker = tmp_path / "payload-ran"
    contents = {"config": {}, "progress": _Payload(marker)}
    with open(sealed / "rank0.pt", "wb") as f:
        torch.save(contents, f) if form == "torch" else pickle.dump(contents, f, protocol=2)
    manifest = json.loads((sealed / "manifest.json").read_text())
    manifest["files"]["rank0.pt"] = hashlib.sha256((sealed / "rank0.pt").read_bytes()).hexdigest()
    (sealed / "manifest.json").write_text(json.dumps(manifest))
    (Path(config.out) / "summary.json").unlink()   # as if killed after it: a finished run is never resumed
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(config.to_dict()))
    capsys.readouterr()
    code = main(["train", "--config", str(config_path), "--resume", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert not marker.exists()
    assert code != 0 and len(err.splitlines()) == 1, err
    assert str(sealed / "rank0.pt") in err and "not loaded" in err

