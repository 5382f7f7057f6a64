"""A dead or silent rank ends a dist run with a clear error within the timeout, leaving no process behind."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchrun_launch import alive, descendants, rank_pids

TIMEOUT_S = 8


pytestmark = pytest.mark.usefixtures("private_cache")


def _launch(out: Path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "lossysim", "train", "--backend", "dist", "--no-progress", "--steps", "100000",
           "--max-train-samples", "64", "--max-eval-samples", "16", "--out", str(out),
           "--set", "max_length=32", "--set", "batch_size=4", "--set", "log_every=1",
           "--set", "eval_every=100000", "--set", f"timeout_s={TIMEOUT_S}", "--loss", "bernoulli:0.05"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_training(proc, out: Path):
    deadline = time.time() + 180
    while time.time() < deadline:
        if (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 2:
            return
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("training did not start")


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["dies", "hangs"])
def test_peer_fault_ends_the_run(tmp_path, fault):
    out = tmp_path / "run"
    proc = _launch(out)
    try:
        _wait_training(proc, out)
        victim = rank_pids(proc.pid, rank=1)
        assert len(victim) == 1, victim
        started_processes = descendants(proc.pid)
        survivor = rank_pids(proc.pid, rank=0)
        os.kill(victim[0], fault)
        started = time.time()
        if fault == signal.SIGSTOP:
            # lossysim's part: rank 0 finds its peer silent within timeout_s, records why and exits. The
            # stopped rank is then torchrun's to end (SIGTERM, SIGKILL 30 s later): continued, it takes
            # the SIGTERM at once.
            while alive(survivor) and time.time() < started + TIMEOUT_S + 60:
                time.sleep(0.2)
            os.kill(victim[0], signal.SIGCONT)
        proc.wait(timeout=TIMEOUT_S + 60)
        elapsed = time.time() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert elapsed < TIMEOUT_S + 60
    deadline = time.time() + 10
    while alive(started_processes) and time.time() < deadline:
        time.sleep(0.2)
    assert alive(started_processes) == [], "orphaned ranks"
    summary = out / "summary.json"
    if fault == signal.SIGSTOP:  # rank 0 outlives the silent peer and records why it stopped
        recorded = json.loads(summary.read_text())
        assert recorded["status"] == "failed"
        assert "peer rank" in recorded["error"] and "timeout_s=8" in recorded["error"]
    elif summary.exists():
        assert json.loads(summary.read_text())["status"] == "failed"
