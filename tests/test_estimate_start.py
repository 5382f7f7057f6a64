"""A quick start: an estimate of a published shape loads no transformers modeling code (its counts are kept as
data, shape_counts.py, counted here again on the model), and records the threads it ran on."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lossysim.estimate import shapes
from lossysim.models.shapes import NAMED_SHAPES

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import json, sys
from lossysim import cli
code = cli.main(sys.argv[1:])
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def _modeling(modules) -> list:
    """transformers' model code: a family's modeling_* module, or the base every one of them imports."""
    return [m for m in modules if m == "transformers.modeling_utils"
            or (m.startswith("transformers.models.") and ".modeling_" in m)]


# tensor parallelism alone; DDP's buckets (planned parameter by parameter, estimate/shape_params.py); a
# pipeline's stages with DDP and a mixture of experts' buckets apart (ep 2)
LAYOUTS = {"tp": ["llama-3.1-70b", "--tp-size", "8"],
           "ddp": ["llama-3.1-70b", "--tp-size", "8", "--dp-size", "2"],
           "pipeline": ["mixtral-8x7b", "--tp-size", "2", "--pp-size", "2", "--dp-size", "2", "--ep-size", "2"]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_estimate_of_a_named_shape_imports_no_modeling_code(tmp_path, layout):
    out = tmp_path / "est"
    argv = ["estimate", *LAYOUTS[layout], "--seq", "256", "--steps", "1", "--loss",
            "bernoulli:0.01", "--transport", "retransmit", "--threads", "1", "--no-progress", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", _PROBE, *argv], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["code"] == 0
    assert "torch" in probe["modules"] and "lossysim.estimate.simulate" in probe["modules"]   # it did run
    assert _modeling(probe["modules"]) == []
    rows = json.loads((out / "estimate.json").read_text())
    assert [row["threads"] for row in rows] == [1]
    if layout != "tp":   # it did plan buckets: DDP's class ran
        assert rows[0]["dp_packets_sent"] > 0


def test_a_layout_that_needs_the_models_parameters_still_builds_it():
    shape = shapes.load("gpt2")
    model = shape.meta_model()   # DDP's buckets and a pipeline's stages read it parameter by parameter
    assert sum(p.numel() for p in model.parameters()) == shape.parameters


@pytest.mark.parametrize("name", shapes.PUBLISHED)
def test_the_counts_kept_are_the_models(name):
    assert shapes.counted(name) == shapes.COUNTS[name]
    kept, built = shapes.load(name), shapes.count(name)
    for field in ("plan", "parameters", "layers", "hidden", "kernels", "active", "experts"):
        assert getattr(kept, field) == getattr(built, field), field
    for key, value in kept.config.__dict__.items():
        if key != "_name":
            assert getattr(built.config, key) == value, key


def test_the_runner_shapes_are_named_without_transformers():
    probe = "import sys, lossysim.models.shapes; print(any(m.startswith('transformers') for m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False"], done.stderr[-2000:]
    assert shapes.RUNNER == tuple(NAMED_SHAPES) and set(shapes.COUNTS) == set(shapes.PUBLISHED)
