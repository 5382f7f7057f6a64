"""Pipeline stages in a run (``pp_size``): the layout, loss-free training equal to one stage's, loss on
the boundaries alone, the step's clock against its schedule, exact resume, and bad input in one line.

The models are the tiny GPT-2 with 4 blocks (so middle stages exist) and the tiny Llama (grouped-query
attention). Dropout is off where runs are compared across layouts: each stage draws its replicated
dropout from a stream of its own (as Megatron seeds each stage), so with dropout the masks differ."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from scipy.stats import binomtest
from transformers import GPT2Config

from lossysim.config import PP_SCHEDULES, ExperimentConfig
from lossysim.data import train_batches
from lossysim.io import read_jsonl
from lossysim.models import NAMED_SHAPES, cost
from lossysim.pp import SCHEDULES, pipeline_time
from lossysim.pp.stages import stage_layout, stage_parameters
from lossysim.run import checkpoint
from lossysim.run.build import build
from lossysim.run.experiment import run_experiment
from test_resume import assert_same_run
from tiny_runs import assert_train_refuses, tiny_run, train_steps

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("private_cache")


@pytest.fixture
def four_blocks(monkeypatch):
    """The tiny GPT-2 with 4 blocks instead of 2."""
    model_type, shape = NAMED_SHAPES["tiny"]
    monkeypatch.setitem(NAMED_SHAPES, "tiny", (model_type, {**shape, "n_layer": 4}))


def _config(tmp_path, name="run", steps=3, **changes) -> ExperimentConfig:
    return tiny_run(tmp_path / name, **{**dict(max_train_samples=96, max_eval_samples=32, steps=steps, warmup_steps=1,
                                               dropout=0.0, lr=1e-3, eval_every=steps, log_every=1), **changes})


def _train(config: ExperimentConfig, steps: int = 3):
    return train_steps(config, steps)[:2]


def test_the_schedules_the_config_takes_are_the_clocks():
    assert PP_SCHEDULES == SCHEDULES


def test_layouts():
    assert stage_layout(None, 2, 4) == (2, 2) and stage_layout(None, 4, 4) == (1, 1, 1, 1)
    assert stage_layout("1,3", 2, 4) == (1, 3) and stage_layout(" 2, 1,1", 3, 4) == (2, 1, 1)
    with pytest.raises(ValueError, match=r"^pp_size=3 does not divide the model's 4 layers"):
        stage_layout(None, 3, 4)
    with pytest.raises(ValueError, match=r"^pp_layout='1,2' holds 3 blocks, the model has 4 layers"):
        stage_layout("1,2", 2, 4)
    for bad in ("1", "0,4", "1,x", "1,1,2"):
        with pytest.raises(ValueError, match=r"^pp_layout=.* must be pp_size=2 block counts >= 1"):
            stage_layout(bad, 2, 4)


@pytest.mark.parametrize("model", ["tiny", "tiny-llama"])
def test_stage_parameters_sum_to_the_model_and_sit_where_megatron_puts_them(model, tmp_path, four_blocks):
    parts = build(_config(tmp_path, model=model, tp_size=1), CPU, 0, True, None)
    full = parts.model.model
    base = full.base_model
    blocks = base.h if model == "tiny" else base.layers
    counts = stage_parameters(full, (1, len(blocks) - 1))
    assert sum(counts) == parts.parameters
    block = sum(p.numel() for p in blocks[0].parameters())
    norm = sum(p.numel() for p in (base.ln_f if model == "tiny" else base.norm).parameters())
    head = sum(p.numel() for p in full.score.parameters())
    embeddings = sum(p.numel() for name, p in base.named_parameters() if not name.startswith(("h.", "layers.",
                                                                                                "ln_f.", "norm.")))
    assert counts == [embeddings + block, block * (len(blocks) - 1) + norm + head]


# Loss-free, the stages compute what one stage computes, op for op: a boundary hands the receiver the
# sender's tensor, so the parameters after a few steps are the same bits.
@pytest.mark.parametrize("layout", [dict(pp_size=2), dict(pp_size=4), dict(pp_size=2, pp_layout="1,3"),
                                    dict(pp_size=2, tp_size=2), dict(pp_size=2, pp_schedule="gpipe")])
def test_loss_free_stages_train_bit_for_bit_as_one(layout, tmp_path, four_blocks, one_torch_thread):
    microbatches = 4
    one, _ = _train(_config(tmp_path, "one", tp_size=layout.get("tp_size", 1), microbatches=microbatches))
    staged, state = _train(_config(tmp_path, "staged", **{"tp_size": 1, "microbatches": microbatches, **layout}))
    moved = False
    for (name, expected), got in zip(one.model.named_parameters(), staged.model.parameters()):
        assert torch.equal(got, expected), name
    start = build(_config(tmp_path, "start", tp_size=layout.get("tp_size", 1)), CPU, 0, True, None).model
    moved = any(not torch.equal(p, q) for p, q in zip(start.parameters(), staged.model.parameters()))
    assert moved
    assert staged.pipeline.layout == stage_layout(layout.get("pp_layout"), layout["pp_size"], 4)
    sent = sum(b.network.totals()["sent"] for b in staged.pipeline.boundaries)
    assert sent > 0 and state.pipeline_s > 0


def test_loss_free_stages_train_as_one_with_grouped_query_attention(tmp_path, one_torch_thread):
    one, _ = _train(_config(tmp_path, "one", model="tiny-llama", tp_size=2, microbatches=2))
    staged, _ = _train(_config(tmp_path, "staged", model="tiny-llama", tp_size=2, pp_size=2))
    for (name, expected), got in zip(one.model.named_parameters(), staged.model.parameters()):
        assert torch.equal(got, expected), name


def _lossy(parts):
    return [network.totals() for network in parts.pipeline.networks], \
        [b.network.summary() for b in parts.pipeline.boundaries]


def test_loss_on_the_boundaries_alone(tmp_path, four_blocks, one_torch_thread):
    rate = 0.05
    config = _config(tmp_path, tp_size=2, pp_size=4, loss=f"bernoulli:{rate}", recovery="zero",
                     lossy_traffic="pp_forward,pp_backward")
    parts, _ = _train(config)
    stages, boundaries = _lossy(parts)
    assert all(totals["sent"] > 0 and totals["lost"] == 0 for totals in stages)
    sent = sum(entry["sent"] for summary in boundaries for entry in summary)
    lost = sum(entry["lost"] for summary in boundaries for entry in summary)
    assert {entry["direction"] for summary in boundaries for entry in summary} == {"fwd", "bwd"}
    assert binomtest(lost, sent, rate).pvalue > 1e-3, (lost, sent)


def test_lost_activations_only_leave_their_gradients_exact(tmp_path, one_torch_thread):
    config = _config(tmp_path, tp_size=1, pp_size=2, loss="bernoulli:0.05", lossy_traffic="pp_forward")
    parts, _ = _train(config)
    (summary,) = [b.network.summary() for b in parts.pipeline.boundaries]
    by = {entry["direction"]: entry for entry in summary}
    assert by["fwd"]["lost"] > 0 and by["bwd"]["sent"] == by["fwd"]["sent"] and by["bwd"]["lost"] == 0
    assert all(network.totals()["lost"] == 0 for network in parts.pipeline.networks)


def test_same_seed_same_run(tmp_path, one_torch_thread):
    def run(name):
        config = _config(tmp_path, name, tp_size=2, pp_size=2, loss="ge:rate=0.05,burst=4", dropout=0.1)
        summary = run_experiment(config, config.out, progress=False)
        assert summary["status"] == "completed", summary.get("error")
        return [{k: v for k, v in row.items() if k not in ("time_s", "tokens_per_s")}
                for row in read_jsonl(Path(config.out) / "metrics.jsonl")], summary
    rows_a, summary_a = run("a")
    rows_b, _ = run("b")
    assert rows_a == rows_b
    train = [row for row in rows_a if row["split"] == "train"]
    assert all(row["packets_sent_pp_fwd"] > 0 and 0.0 <= row["pp_bubble"] < 1.0 for row in train)
    pipeline = summary_a["pipeline"]
    assert (pipeline["pp_size"], pipeline["pp_schedule"], pipeline["microbatches"], pipeline["stage_layers"]) == \
        (2, "1f1b", 2, [1, 1])
    assert summary_a["mesh"] == {"order": "tp-cp-ep-dp-pp", "axes": {"tp": 2, "cp": 1, "ep": 1, "dp": 1, "pp": 2},
                                 "world": 4, "ranks_per_node": 2, "nodes": 2}


def test_loss_free_step_is_the_schedule_of_its_stages(tmp_path, four_blocks, one_torch_thread):
    """tp 1: a stage's forward is its FLOP share of a third of the micro-batch's modelled compute, its
    backward two thirds; each boundary send is one loss-free p2p message of a micro-batch's hidden states."""
    p, m = 4, 4
    config = _config(tmp_path, tp_size=1, pp_size=p, microbatches=m, steps=1, max_length=32)
    parts, state = _train(config, steps=1)
    batch = next(iter(train_batches(parts.data, config.batch_size, config.seed)))
    rows, seq = batch["input_ids"].shape[0] // m, batch["input_ids"].shape[1]
    seconds = parts.compute.step_time(parts.parameters, rows * seq, 1,
                                      attention_flops=cost.step_flops(0, rows * seq, parts.layers, parts.hidden, seq),
                                      kernels=parts.kernels)
    flops = [cost.step_flops(n, rows * seq, layers, parts.hidden, seq)
             for n, layers in zip(stage_parameters(build(config, CPU, 0, True, None).model.model, (1,) * p),
                                  (1,) * p)]
    share = [f / sum(flops) for f in flops]
    # One boundary message: the network's loss-free time of one send of [rows, seq, hidden] fp32.
    probe = parts.pipeline.boundaries[0].network
    before = probe.clock()["ideal_comm_s"]
    probe.send("probe", "fwd", torch.zeros(rows, seq, parts.hidden), 0, 1)
    message = probe.clock()["ideal_comm_s"] - before
    expected = pipeline_time("1f1b", p, m, [seconds * s / 3 for s in share], [seconds * s * 2 / 3 for s in share],
                             message, message)
    assert state.pipeline_s == pytest.approx(expected.step_s, rel=1e-12)
    assert state.pipeline_s == pytest.approx(state.pipeline_s_ideal_nic, rel=1e-12)
    free = pipeline_time("1f1b", p, m, [seconds * s / 3 for s in share], [seconds * s * 2 / 3 for s in share])
    assert state.pp_s == pytest.approx(expected.step_s - free.step_s, rel=1e-9) and state.pp_s > 0
    assert state.compute_s == pytest.approx(m * seconds, rel=1e-12)


def test_equal_stages_leave_the_textbook_bubble():
    p, m, f, b = 4, 8, 1.0, 2.0
    timing = pipeline_time("1f1b", p, m, f, b)
    assert timing.step_s == pytest.approx((m + p - 1) * (f + b))
    from lossysim.pp.record import bubble
    assert bubble(p * m * (f + b), timing.step_s, p) == pytest.approx((p - 1) / (m + p - 1))


def test_resume_is_exact(tmp_path, one_torch_thread):
    settings = dict(tp_size=2, pp_size=2, loss="ge:rate=0.05,burst=4", dropout=0.1, checkpoint_every=3,
                    keep_checkpoints=0, save_checkpoint=True, steps=6, eval_every=3, log_every=2)
    reference = _config(tmp_path, "reference", **settings)
    assert run_experiment(reference, reference.out, progress=False)["status"] == "completed"
    resumed = _config(tmp_path, "resumed", **settings)
    assert run_experiment(resumed, resumed.out, progress=False)["status"] == "completed"
    # As if it had died after step 3's checkpoint: later checkpoints and files gone, rows after it cut on resume.
    for later in checkpoint.complete(resumed.out)[1:]:
        shutil.rmtree(later)
    for name in ("summary.json", "checkpoint"):
        path = Path(resumed.out) / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    summary = run_experiment(resumed, resumed.out, progress=False, resume=True)
    assert summary["status"] == "completed", summary.get("error")
    assert_same_run(Path(reference.out), Path(resumed.out))
    assert "pp" in torch.load(checkpoint.latest(resumed.out) / "rank0.pt", weights_only=True)


@pytest.mark.parametrize("settings, message", [
    (["--pp-size", "3", "--microbatches", "2"], "pp_size=3 does not divide the model's 2 layers"),
    (["--pp-size", "2", "--pp-layout", "1,2"], "pp_layout='1,2' holds 3 blocks, the model has 2 layers"),
    (["--pp-size", "2", "--pp-layout", "2"], "pp_layout='2' must be pp_size=2 block counts"),
    (["--microbatches", "0"], "microbatches=0 must be >= 1"),
    (["--pp-size", "2", "--microbatches", "3"], "batch_size=8 must be a multiple of dp_size=1 x microbatches=3"),
    (["--pp-size", "2", "--pp-schedule", "interleaved"], "pp_schedule='interleaved' must be one of gpipe, 1f1b"),
    (["--pp-size", "2", "--dp-size", "2", "--set", "dp_sync_every=2"], "dp_sync_every with pp_size=2"),
    # the mesh's one layout rule, whatever the axes (it was skipped with one replica)
    (["--pp-size", "2", "--set", "ranks_per_node=3"], "ranks_per_node=3 is more GPUs than the layout's tp1 x pp2"),
    (["--pp-size", "2", "--dp-size", "2", "--set", "ranks_per_node=3"], "ranks_per_node=3 must divide tp_size=1"),
])
def test_bad_pipeline_settings_are_one_line_and_exit_2(settings, message, tmp_path, capsys):
    assert_train_refuses(settings, message, tmp_path / "o", capsys)


def test_identity_of_runs_without_pipeline_keys_is_unchanged():
    from lossysim.config import upgrade
    from lossysim.run.sweep import config_key
    old = {k: v for k, v in ExperimentConfig().to_dict().items() if not k.startswith("pp_")}
    old["microbatches"] = 1                      # how a config saved before pipeline stages says it
    assert ExperimentConfig(**upgrade(old)).validate() == ExperimentConfig().validate()
    assert config_key(ExperimentConfig(**upgrade(old)).validate()) == config_key(ExperimentConfig().validate())
    assert json.dumps(ExperimentConfig(microbatches=2).validate().microbatches) == "2"
    assert ExperimentConfig(pp_size=2, microbatches=2, tp_size=1).validate().microbatches is None
