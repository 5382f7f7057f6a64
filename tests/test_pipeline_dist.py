"""Pipeline stages on ``backend: dist`` (one gloo process per rank) against ``sim``, bit for bit.

One spawn of 4 processes for the module (spawn, imports and teardown cost seconds): the worker runs
every dist case below as torchrun would (``run_experiment`` from torchrun's environment variables), a
case on as many of the 4 processes as its world needs, two 2-process cases side by side. The tests
run the same settings on ``sim`` here and compare what the runs wrote: every metrics row (losses,
accuracies, packets sent and lost per kind of traffic, the clock and the pipeline's step, bubble and
send time) and every saved weight, bit for bit. The model is the tiny GPT-2 with 4 blocks (so
pp 4 has middle stages that receive and send), dropout off (``sim``'s sharded-region dropout draws
for every rank at once; that is TP's matter, not the pipeline's).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_workers import assert_keeps_first_rows, spawn_runs, written
from lossysim.io import read_jsonl
from lossysim.models import NAMED_SHAPES
from lossysim.run.experiment import run_experiment
from test_data_parallel import assert_dist_is_sim
from tiny_runs import tiny_run

PROCESSES = 4
DEADLINE_S = 240
BASE = dict(max_train_samples=96, max_eval_samples=32, steps=3, eval_every=3, log_every=1, warmup_steps=1,
            dropout=0.0, lr=1e-3, save_checkpoint=True)
LOSSY = dict(loss="bernoulli:0.05", recovery="zero", ranks_per_node=1, grad_clip=0.1)  # every link crosses nodes
CASES = {
    "tp2-exact": dict(tp_size=2, pp_size=2),
    "tp2-lossy": dict(tp_size=2, pp_size=2, microbatches=4, **LOSSY),
    "pp4-lossy": dict(tp_size=1, pp_size=4, pp_schedule="gpipe", **LOSSY),
    "tp1-exact": dict(tp_size=1, pp_size=2),
    "tp1-lossy": dict(tp_size=1, pp_size=2, pp_layout="1,3", **LOSSY),
    "tp1-retransmit": dict(tp_size=1, pp_size=2, **{**LOSSY, "transport": "retransmit", "loss": "bernoulli:0.2"}),
    "tp1-resumed": dict(tp_size=1, pp_size=2, steps=4, eval_every=2, checkpoint_every=2, keep_checkpoints=0,
                        **LOSSY),
    # 3-D: tp 1 x pp 2 x dp 2, every stage's buckets over its own data-parallel groups, losing with the rest
    "3d-lossy": dict(tp_size=1, pp_size=2, dp_size=2, dp_bucket_mb=0.05, **LOSSY),
    "3d-resumed": dict(tp_size=1, pp_size=2, dp_size=2, dp_bucket_mb=0.05, steps=4, eval_every=2,
                       checkpoint_every=2, keep_checkpoints=0, **LOSSY),
    # a recomputed stage gets again what it received: no second receive, draw or time
    "3d-checkpointed": dict(tp_size=1, pp_size=2, dp_size=2, dp_bucket_mb=0.05, activation_checkpointing=True,
                            **LOSSY),
}
# Each phase's cases run one after another on their processes (first, world); phases start together.
PHASES = [[("tp2-exact", 0, 4), ("tp2-lossy", 0, 4), ("pp4-lossy", 0, 4), ("3d-lossy", 0, 4), ("3d-resumed", 0, 4),
           ("3d-checkpointed", 0, 4)],
          [("tp1-exact", 0, 2), ("tp1-lossy", 0, 2)],
          [("tp1-retransmit", 2, 2), ("tp1-resumed", 2, 2)]]


def _four_blocks() -> None:
    model_type, shape = NAMED_SHAPES["tiny"]
    NAMED_SHAPES["tiny"] = (model_type, {**shape, "n_layer": 4})


def _settings(name: str) -> dict:
    return {**BASE, **CASES[name]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case's run directory on dist (``dist``), and on sim (``sim``), by name."""
    return spawn_runs(tmp_path_factory, "pp-dist",
                      [case for phase in PHASES for case in phase], {name: _settings(name) for name in CASES},
                      PROCESSES, DEADLINE_S, setup=_four_blocks)


@pytest.fixture(scope="module")
def four_blocks_here():
    model_type, shape = NAMED_SHAPES["tiny"]
    _four_blocks()
    yield
    NAMED_SHAPES["tiny"] = (model_type, shape)


@pytest.fixture
def sim(runs, tmp_path_factory, four_blocks_here, one_torch_thread, monkeypatch):
    """A case's run on sim (its uninterrupted run, for the resumed case), in this process."""
    monkeypatch.setenv("LOSSYSIM_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))

    def run(name: str, **changes) -> Path:
        run_dir = runs / name / ("sim" if not changes else "sim-" + "-".join(f"{k}{v}" for k, v in changes.items()))
        config = tiny_run(run_dir, backend="sim", **{**_settings(name), **changes})
        assert run_experiment(config, run_dir, progress=False)["status"] == "completed"
        return run_dir
    return run


def _assert_same(sim_dir: Path, dist_dir: Path) -> list[dict]:
    (sim_rows, sim_weights), (dist_rows, dist_weights) = written(sim_dir), written(dist_dir)
    assert len(sim_rows) == len(dist_rows)
    assert_dist_is_sim({"sim": sim_rows, "dist": dist_rows}, [sim_weights, dist_weights])
    return sim_rows


@pytest.mark.parametrize("name", ["tp1-exact", "tp2-exact"])
def test_loss_free_dist_stages_train_as_sim_and_as_one_stage(runs, sim, name):
    """Loss-free, dist's stages are sim's bit for bit, and so (``test_pipeline``) one stage's training
    with the same micro-batches: the weights equal an unpipelined sim run's."""
    rows = _assert_same(sim(name), runs / name / "dist")
    train = [r for r in rows if r["split"] == "train"]
    assert train[-1]["packets_sent_pp_fwd"] > 0 and train[-1]["pipeline_s_per_step"] > 0
    _, staged = written(runs / name / "dist")
    _, one = written(sim(name, pp_size=1, microbatches=2))
    assert staged.keys() == one.keys()
    for key in one:
        assert torch.equal(staged[key], one[key]), key


@pytest.mark.parametrize("name", ["tp2-lossy", "pp4-lossy", "tp1-lossy", "tp1-retransmit", "3d-lossy",
                                  "3d-checkpointed"])
def test_lossy_dist_stages_are_sims_bit_for_bit(runs, sim, name):
    """Bernoulli loss on every link (TP and pipeline traffic, both directions), the gradient clipped:
    the same masks on the same numbers, so the same losses, packets, clock and weights."""
    rows = _assert_same(sim(name), runs / name / "dist")
    last = [r for r in rows if r["split"] == "train"][-1]
    assert last["packets_lost_pp_fwd"] > 0 and last["packets_lost_pp_bwd"] > 0
    if CASES[name]["tp_size"] > 1:
        assert last["packets_lost_fwd"] > 0
    if CASES[name].get("transport") == "retransmit":
        assert last["retransmit_s_per_step"] > 0 and last["pp_s_per_step"] > 0
    if CASES[name].get("dp_size", 1) > 1:
        assert last["packets_lost_dp"] > 0 and last["drift"] > 0 and last["dp_s_per_step"] > 0


@pytest.mark.parametrize("name", ["tp1-resumed", "3d-resumed"])
def test_a_dist_pipeline_resumes_exactly(runs, sim, name):
    """Stopped after its step-2 checkpoint and resumed, a dist pipeline (and a 3-D job) ends as sim's
    uninterrupted run; the rows up to the checkpoint are the first run's (their wall-clock times), the
    rest the resumed one's."""
    _assert_same(sim(name), runs / name / "dist")
    resumed = read_jsonl(runs / name / "dist" / "metrics.jsonl")
    first, kept = assert_keeps_first_rows(runs / name, resumed)
    assert [r["time_s"] for r in resumed[len(kept):]] != [r["time_s"] for r in first[len(kept):]]


def test_a_head_tied_to_the_embeddings_is_refused_in_one_line(tmp_path, four_blocks_here, monkeypatch):
    """The first and the last stage would each hold a copy of the tied weight (Megatron all-reduces their
    gradients; not modelled): refused before anything is sent."""
    from lossysim.run.build import build
    monkeypatch.setenv("LOSSYSIM_CACHE", str(tmp_path / "cache"))
    config = tiny_run(tmp_path / "run", **{**BASE, "backend": "dist", "pp_size": 2, "task": "lm"})
    with pytest.raises(ValueError, match=r"^pp_size=2 with backend=dist: the model's head is tied to its "
                                         r"embeddings \(first and last stage\); use backend=sim$"):
        build(config, torch.device("cpu"), 0, True, None)
