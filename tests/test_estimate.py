"""lossysim estimate: the closed forms at zero loss, the very counts and clock of a training run, the
published shapes, and one-line errors."""
import json

import pytest
import torch

from lossysim.cli import main
from lossysim.config import ExperimentConfig
from lossysim.estimate import Workload, estimate, job_config, load
from lossysim.estimate.grid import grid, run_grid, write
from lossysim.estimate.shapes import PUBLISHED
from lossysim.net.transfer import packets
from lossysim.run.experiment import run_experiment
from lossysim.timing import direct_all_reduce_time, nccl

# Published parameter counts (model cards; ../shared/REFERENCE.md), rounded as published: 3 digits.
PUBLISHED_PARAMETERS = {"gpt2": 124e6, "gpt2-medium": 355e6, "gpt2-large": 774e6, "gpt2-xl": 1.56e9,
                        "llama-3.2-1b": 1.24e9, "llama-3.2-3b": 3.21e9, "llama-3.1-8b": 8.03e9,
                        "llama-3.1-70b": 70.6e9, "llama-3.1-405b": 406e9, "qwen2.5-7b": 7.62e9, "mistral-7b": 7.24e9,
                        "mixtral-8x7b": 46.7e9, "mixtral-8x22b": 141e9, "qwen3-30b-a3b": 30.5e9,
                        "qwen3-235b-a22b": 235e9, "deepseek-v3": 671e9}
# ... and the mixtures of experts' active ones, published to two digits (whether the embeddings count
# differs between cards: 3% covers it)
PUBLISHED_ACTIVE = {"mixtral-8x7b": 12.9e9, "mixtral-8x22b": 39e9, "qwen3-30b-a3b": 3.3e9, "qwen3-235b-a22b": 22e9,
                    "deepseek-v3": 37e9}


pytestmark = pytest.mark.usefixtures("private_cache")


@pytest.mark.parametrize("algorithm, tp, nodes, checkpointing", [
    ("ring", 4, 2, False), ("tree", 4, 2, True), ("ring", 2, 1, True), ("direct", 4, 1, False)])
def test_zero_loss_step_is_the_closed_forms_summed_over_its_collectives(algorithm, tp, nodes, checkpointing):
    config = job_config("tiny-llama", micro_batch=3, tp_size=tp, algorithm=algorithm, ranks_per_node=tp // nodes,
                        link_inter="roce-400g", activation_checkpointing=checkpointing)
    spec = config.network_spec()
    row = estimate("tiny-llama", config, Workload(seq=24), steps=2)
    per_packet, n = packets(spec.payload_bytes, 24 * 3 * 128, torch.bfloat16)
    M = 24 * 3 * 128 * 2
    if algorithm == "direct":
        one = direct_all_reduce_time(tp, M, spec.link_intra, per_packet * 2)
    else:
        one = nccl.collective_time("all_reduce", algorithm, tp, nodes, M, per_packet * 2, spec.link_intra,
                                   spec.link_inter, spec.bus_bandwidth())
    layers = 2
    # per block 2 fwd and 2 bwd; a recompute replays the attention's (Llama has no dropout after the MLP)
    calls = layers * (2 + 2) + (layers if checkpointing else 0)
    assert row["loss_free_comm_s"] == pytest.approx(calls * one, rel=1e-12)
    assert row["step_mean_s"] == pytest.approx(row["compute_s"] + calls * one, rel=1e-12)
    assert row["slowdown"] == pytest.approx(1.0) and row["packets_lost"] == 0 and row["elements_lost_fwd"] == 0
    assert row["collectives_per_step"] == 4 * layers and row["message_bytes"] == M


@pytest.mark.parametrize("model, changes", [
    ("tiny", dict(loss="bernoulli:0.05", transport="drop")),
    ("tiny", dict(loss="ge:rate=0.03,burst=4", transport="retransmit", nic="roce-gbn", tp_size=4,
                  activation_checkpointing=True, dropout=None)),   # GPT-2's own residual dropout, 0.1
    ("tiny-llama", dict(loss="bernoulli:0.05", transport="retransmit", nic="srd", activation_checkpointing=True)),
    ("tiny-llama", dict(loss="bernoulli:0.05", transport="deadline", algorithm="tree", tp_size=2)),
    ("tiny-llama", dict(loss="bernoulli:0.02", transport="retransmit", nic="irn", ranks_per_node=1)),
])
def test_an_estimate_counts_and_times_what_a_training_run_does(tmp_path, model, changes):
    """One loss process, two uses: the same seed and settings give a training run's packets and clock."""
    # max_length 16 cuts every synthetic example, so every batch is 8 x 16 tokens.
    config = ExperimentConfig(model=model, dataset="synthetic", max_length=16, max_train_samples=64,
                              max_eval_samples=8, batch_size=8, eval_batch_size=8, steps=3, eval_every=3,
                              log_every=3, seed=5, out=str(tmp_path / "run"), **{"dropout": 0.0, **changes}).validate()
    summary = run_experiment(config, config.out, progress=False)
    assert summary["status"] == "completed", summary.get("error")
    row = estimate(model, config, Workload(seq=16), steps=3)     # the run's own config: 8 rows of fp32
    trained = summary["packets"]["train"]
    for name in ("sent", "lost", "resent"):
        assert row[f"packets_{name}"] * 3 == sum(entry[name] for entry in trained), name
    assert row["packets_lost"] > 0
    assert row["step_mean_s"] - row["compute_s"] == pytest.approx(summary["sim_time"]["comm_s_per_step"], rel=1e-12)
    assert row["loss_free_comm_s"] == pytest.approx(summary["sim_time"]["ideal_comm_s_per_step"], rel=1e-12)


def test_published_shapes_have_their_published_parameter_counts(one_torch_thread):
    assert set(PUBLISHED) == set(PUBLISHED_PARAMETERS)
    for name, published in PUBLISHED_PARAMETERS.items():
        shape = load(name)
        assert shape.parameters == pytest.approx(published, rel=0.005), name   # within the published rounding
        assert shape.active == pytest.approx(PUBLISHED_ACTIVE.get(name, shape.parameters), rel=0.03), name
    assert load("llama-3.1-70b").hidden == 8192 and load("llama-3.1-70b").layers == 80
    deepseek = load("deepseek-v3").experts
    assert deepseek.blocks == tuple(range(3, 61)) and (deepseek.count, deepseek.top_k) == (256, 8)


def test_a_config_file_or_model_directory_is_a_shape(tmp_path):
    from lossysim.estimate.shapes import config_of
    config_of("llama-3.2-1b").save_pretrained(tmp_path)   # a published shape's Shape keeps only what it reads
    for where in (tmp_path, tmp_path / "config.json"):
        shape = load(str(where))
        assert shape.parameters == load("llama-3.2-1b").parameters and shape.plan.name == "llama"


def _error(capsys, *argv) -> str:
    assert main(["estimate", *argv, "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err


def test_bad_input_is_a_one_line_error(tmp_path, capsys):
    assert "gpt2, gpt2-medium" in _error(capsys, "gpt-5")
    assert "tp_size=8 does not divide n_head=12" in _error(capsys, "gpt2", "--tp-size", "8")
    assert "num_attention_heads=28" in _error(capsys, "qwen2.5-7b", "--tp-size", "8")
    (tmp_path / "config.json").write_text(json.dumps({"learning_rate": 0.1}))
    assert "is not a model config" in _error(capsys, str(tmp_path / "config.json"))
    (tmp_path / "broken.json").write_text("{not json")
    assert "is not a model config" in _error(capsys, str(tmp_path / "broken.json"))
    (tmp_path / "empty").mkdir()
    assert "holds no config.json" in _error(capsys, str(tmp_path / "empty"))
    assert "loss" in _error(capsys, "tiny", "--tp-size", "2", "--loss", "bernoulli:7")
    assert main(["estimate", "tiny", "--steps", "0"]) == 2   # refused before its progress bar starts
    assert capsys.readouterr().err.strip() == "lossysim estimate: error: --steps 0 must be >= 1"


def test_the_grid_runs_every_setting_and_writes_its_files(tmp_path, capsys):
    specs = grid(job_config("tiny", micro_batch=2), {"loss": ["bernoulli:0.01", "bernoulli:0.05"],
                                                     "transport": ["drop,retransmit,deadline"], "nic": ["irn", "roce-gbn"]})
    # drop repairs nothing (one nic is enough); deadline with go-back-N is refused and skipped
    assert len(specs) == 2 * (1 + 2 + 1)
    assert "skipped" in capsys.readouterr().err
    rows = run_grid("tiny", specs, Workload(seq=8), steps=2, progress=False)
    paths = write(rows, tmp_path)
    assert [p.name for p in paths] == ["estimate.csv", "estimate.json", "slowdown.png", "time_by_class.png"]
    assert json.loads((tmp_path / "estimate.json").read_text()) == rows
    for row in rows:
        assert row["step_p50_s"] <= row["step_p99_s"] and 0 < row["comm_share"] < 1
        if row["transport"] == "retransmit":
            assert row["slowdown"] > 1 and row["elements_lost_fwd"] == 0
        if row["transport"] == "drop":
            assert row["slowdown"] == pytest.approx(1) and row["elements_lost_fwd"] > 0
    assert main(["estimate", "tiny", "--tp-size", "2", "--seq", "8", "--steps", "1", "--no-progress",
                 "--loss", "bernoulli:0.01", "--transport", "retransmit", "--nic", "irn,tcp"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 3


def test_every_recovery_policy_sees_the_same_losses_and_only_its_compute_costs_time(capsys):
    """A policy copes after the packets' fates are drawn: the same seed loses the same packets and elements
    under each, and a policy that computes (Hadamard) adds its compute to the step, nothing else does."""
    rows = {r: estimate("tiny", job_config("tiny", micro_batch=2, loss="bernoulli:0.05", recovery=r), Workload(seq=8),
                        steps=2)
            for r in ("zero", "rescale", "hadamard", "stale", "error_feedback")}
    for row in rows.values():
        assert row["packets_lost"] == rows["zero"]["packets_lost"] > 0
        assert row["elements_lost_fwd"] == rows["zero"]["elements_lost_fwd"] > 0
    assert rows["rescale"]["step_mean_s"] == rows["zero"]["step_mean_s"]
    assert rows["hadamard"]["step_mean_s"] > rows["zero"]["step_mean_s"]
    assert main(["estimate", "tiny", "--tp-size", "2", "--seq", "8", "--steps", "1", "--no-progress",
                 "--loss", "bernoulli:0.05", "--recovery", "zero,stale"]) == 0
    header, *lines = capsys.readouterr().out.strip().splitlines()
    assert "recovery" in header.split() and len(lines) == 2


def test_the_estimate_runs_what_nccls_tuner_picks_unless_told(tmp_path):
    """``lossysim estimate`` defaults to ``--algorithm auto`` (NCCL's pick per message: an engineer sizing a
    job expects what NCCL would run); ``--algorithm ring`` still runs the ring; training keeps ``ring``."""
    from lossysim.config import ExperimentConfig
    base = ["estimate", "tiny", "--tp-size", "2", "--seq", "8", "--steps", "1", "--no-progress"]
    assert main([*base, "--out", str(tmp_path / "auto")]) == 0
    assert main([*base, "--algorithm", "ring", "--out", str(tmp_path / "ring")]) == 0
    auto, ring = (json.loads((tmp_path / name / "estimate.json").read_text())[0] for name in ("auto", "ring"))
    assert (auto["algorithm"], ring["algorithm"]) == ("auto", "ring")
    assert auto["sockets"] == 1 and auto["congestion"] is None
    assert ExperimentConfig().algorithm == "ring"


def test_the_gpu_reaches_the_network_settings_as_in_training(capsys):
    """``--compute`` sets NCCL's tables and whether NVLS runs, as a training run's ``compute`` does: NVLS on
    an A100 is refused with training's own message, auto never picks it there, and the A100's loss-free
    collectives are NCCL's Ampere times, not the Hopper ones."""
    with pytest.raises(ValueError) as refused:
        ExperimentConfig(tp_size=2, compute="a100", algorithm="nvls").validate()
    for algorithms in ("nvls", "ring,nvls"):
        assert _error(capsys, "tiny", "--tp-size", "2", "--seq", "8", "--compute", "a100", "--algorithm",
                      algorithms).endswith(str(refused.value))
    shape = load("llama-3.2-1b")
    picks = {gpu: estimate(shape, job_config(shape.name, tp_size=8, algorithm="auto", ranks_per_node=8, compute=gpu),
                           Workload(seq=4096), steps=1)["collectives"] for gpu in ("h100", "a100")}
    assert "nvls" in picks["h100"] and "nvls" not in picks["a100"], picks
    # one node of 4: a 1 MiB all-reduce runs LL, whose ceiling NCCL sets per GPU generation
    config = job_config("tiny-llama", micro_batch=2, tp_size=4, algorithm="ring", ranks_per_node=4, compute="a100")
    spec = config.network_spec()
    row = estimate("tiny-llama", config, Workload(seq=2048), steps=1)
    per_packet, _ = packets(spec.payload_bytes, 2048 * 2 * 128, torch.bfloat16)
    one = {arch: nccl.collective_time("all_reduce", "ring", 4, 1, 2048 * 2 * 128 * 2, per_packet * 2,
                                      spec.link_intra, spec.link_inter, spec.bus_bandwidth(), arch)
           for arch in ("ampere", "hopper")}
    assert one["ampere"] > 1.2 * one["hopper"]
    assert row["compute"].startswith("a100") and row["loss_free_comm_s"] == pytest.approx(2 * 4 * one["ampere"],
                                                                                          rel=1e-12)


def test_a_name_no_setting_accepts_is_a_one_line_error(capsys):
    """An unknown name in a list is refused as training refuses it, not skipped; a combination that only
    some values refuse (deadline with a go-back-N nic) is still skipped with a note."""
    base = ("tiny", "--tp-size", "2", "--seq", "8")
    assert "nic='foo' must be one of" in _error(capsys, *base, "--transport", "retransmit", "--nic", "tcp,foo")
    assert "nic='foo'" in _error(capsys, *base, "--nic", "tcp,foo")   # drop: one nic runs, every one is checked
    assert "algorithm='bar' must be one of" in _error(capsys, *base, "--algorithm", "ring,bar")
    assert "recovery='baz'" in _error(capsys, *base, "--recovery", "baz,zero")
    specs = grid(job_config("tiny"), {"transport": ["drop,deadline"], "nic": ["roce-gbn,irn"]})
    assert {(s.transport, s.nic) for s in specs} == {("drop", "roce-gbn"), ("deadline", "irn")}
    assert "skipped transport=deadline, nic=roce-gbn" in capsys.readouterr().err


def test_a_config_size_that_is_not_a_whole_number_names_its_field(tmp_path, capsys):
    sizes = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128, "vocab_size": 100}
    for field, value in (("num_attention_heads", 0), ("num_hidden_layers", -2), ("head_dim", 0),
                         ("hidden_size", 64.5), ("num_key_value_heads", True)):
        (tmp_path / "config.json").write_text(json.dumps({**sizes, field: value}))
        err = _error(capsys, str(tmp_path), "--tp-size", "2", "--seq", "8")
        assert f"{field}={value!r} must be a whole number >= 1" in err, err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 0}))
    assert "n_head=0 must be" in _error(capsys, str(tmp_path), "--tp-size", "2", "--seq", "8")


def test_a_group_larger_than_an_estimate_holds_is_refused_before_any_work(tmp_path, capsys):
    """A group is simulated send by send (2R(R-1) sends an all-reduce): 100,000 replicas would grow until
    killed; the estimate says so at once, naming the limit, and writes nothing."""
    err = _error(capsys, "tiny", "--tp-size", "2", "--seq", "8", "--dp-size", "100000", "--out", str(tmp_path / "o"))
    assert "dp_size=100000" in err and "2e+10 sends" in err and "use dp_size <= 1024" in err, err
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="dp_size=1025"):
        estimate("tiny", job_config("tiny", dp_size=1025), Workload(seq=8), steps=1)
