"""Same seed, same numbers: short lossy runs reproduce what the code gave when they were captured
(tests/golden/runs.json and summaries.json, written by tests/golden/capture.py), on any CPU.

Each case is a few steps of a tiny GPT-2 or Llama through ring, tree or direct all-reduces, with
zero or rescale recovery, drop, retransmit or deadline transports. What is exact by construction
must match bit for bit: packets sent and lost per direction and step, the loss rate observed from
them, packets sent, lost, resent and missing, runs of losses, timeouts and failures per link class
and call site, the simulated clock (the deadline transport gives up by that clock, which is float64
arithmetic on counts and config, never on trained values), accuracy and disagreement. The fp32
figures (loss, hidden_rel_diff) are sums whose rounding depends on the CPU's BLAS and vector width;
they must match within ``FLOAT_RTOL`` (see tests/golden_runs.py for how it was chosen).

Captured before the layout change (0.2); recaptured when the time model became NCCL's and the
transports' timers real ones: every number of every case but the clock stayed, except the deadline
case's, whose transport gives up by the clock.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from golden_runs import CASES, FLOAT_KEYS, FLOAT_RTOL, config_for, differences, numbers
from lossysim.tp.parallelize import TensorParallelModel

HERE = Path(__file__).parent
RUNS = json.loads((HERE / "golden" / "runs.json").read_text())
SUMMARIES = json.loads((HERE / "golden" / "summaries.json").read_text())
GOLDEN = {name: {"rows": RUNS[name], "summary": SUMMARIES[name]} for name in RUNS}


pytestmark = pytest.mark.usefixtures("private_cache")


@pytest.fixture
def top_two_gaps(monkeypatch):
    """The gap between the two largest logits of every prediction every forward makes, and the largest
    logit's size: all accuracies and disagreements are argmaxes of these logits."""
    seen = {"gap": float("inf"), "scale": 0.0}
    forward = TensorParallelModel.forward

    def recording(self, **inputs):
        out = forward(self, **inputs)
        top = self.rank_logits.detach().float().topk(2, dim=-1).values
        seen["gap"] = min(seen["gap"], float((top[..., 0] - top[..., 1]).min()))
        seen["scale"] = max(seen["scale"], float(self.rank_logits.detach().abs().max()))
        return out

    monkeypatch.setattr(TensorParallelModel, "forward", recording)
    return seen


def test_the_golden_files_hold_the_same_cases():
    assert list(RUNS) == list(SUMMARIES) == list(CASES)


@pytest.mark.parametrize("name", CASES)
def test_runs_reproduce_their_captured_numbers(name, tmp_path, one_torch_thread, top_two_gaps):
    got = numbers(config_for(name, tmp_path / name))
    assert not differences(got, GOLDEN[name]), (name, differences(got, GOLDEN[name]))
    # Accuracy and disagreement are compared exactly: no argmax can flip on a CPU that moves every
    # logit by at most FLOAT_RTOL of the largest, as long as every top-two gap is wider than twice that.
    assert top_two_gaps["gap"] > 2 * FLOAT_RTOL * top_two_gaps["scale"], (name, top_two_gaps)


def test_numbers_hold_at_the_lowest_kernel_level(tmp_path):
    """Portability on one machine: torch's CPU kernels dispatched at their lowest level (no AVX), MKL's
    BLAS on its SSE2-compatible code path and numpy's loops at their baseline round differently from
    the native ones; every case must still match the same files within the same tolerances."""
    out = tmp_path / "numbers.json"
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", MKL_CBWR="COMPATIBLE",
               NPY_DISABLE_CPU_FEATURES="X86_V3 X86_V4 AVX512_SKX AVX512_ICL",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(HERE / "golden_runs.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["capability"] == "DEFAULT"
    assert list(result["cases"]) == list(CASES)
    for name, got in result["cases"].items():
        assert not differences(got, GOLDEN[name]), (name, differences(got, GOLDEN[name]))


def test_a_changed_number_is_caught(tmp_path, one_torch_thread):
    """The comparison bites: one more percent of loss changes which packets are lost, and the exact
    keys say so."""
    config = config_for("gpt2-ring-zero-bernoulli", tmp_path / "r").replace(loss="bernoulli:0.06")
    found = differences(numbers(config), GOLDEN["gpt2-ring-zero-bernoulli"])
    assert any("packets_lost_fwd" in line for line in found)
    assert any(line.startswith("summary packets_by_site") for line in found)


@pytest.mark.parametrize("change", [dict(lr=1.01e-3), dict(recovery="rescale")], ids=["lr+1%", "rescale"])
def test_a_changed_training_rule_is_caught(change, tmp_path, one_torch_thread):
    """A change to what training does with the packets, not to which are lost, moves only fp32 figures:
    it must move them beyond FLOAT_RTOL (a 1% larger learning rate, or rescaling instead of zeroing
    what was lost)."""
    config = config_for("gpt2-ring-zero-bernoulli", tmp_path / "r").replace(**change)
    found = differences(numbers(config), GOLDEN["gpt2-ring-zero-bernoulli"])
    assert found
    assert all(line.split(":")[0].split()[-1] in FLOAT_KEYS for line in found), found
