"""The experiment runner end to end, on the tiny model and the synthetic task."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from lossysim import LossyNetwork, parallelize
from lossysim.cli import main
from lossysim.config import ExperimentConfig, load_config
from lossysim.data import eval_batches, prepare_data, train_batches
from lossysim.io import read_jsonl
from lossysim.models import build_model
from lossysim.run import experiment
from lossysim.run.experiment import run_experiment
from torchrun_launch import torchrun
from tiny_runs import dp_group_spec, tiny_run

ROOT = Path(__file__).resolve().parents[1]
TIMINGS = ("time_s", "tokens_per_s", "wall_time_s")


pytestmark = pytest.mark.usefixtures("private_cache")


def tiny(tmp_path, **changes) -> ExperimentConfig:
    sizes = dict(max_train_samples=160, max_eval_samples=64, steps=8, eval_every=4, log_every=2, warmup_steps=2,
                 dropout=0.0, lr=1e-3)
    return tiny_run(tmp_path / "run", **{**sizes, **changes})


def _drop_timings(value):
    if isinstance(value, dict):
        return {k: _drop_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [_drop_timings(v) for v in value]
    return value


def test_run_directory_contract(tmp_path):
    config = tiny(tmp_path, loss="ge:rate=0.05,burst=4")
    summary = run_experiment(config, config.out, progress=False)
    run_dir = Path(config.out)
    assert summary["status"] == "completed", summary.get("error")
    assert load_config(run_dir / "config.yaml") == config
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in rows if r["split"] == "train"]
    evals = [r for r in rows if r["split"] != "train"]
    assert [r["step"] for r in train] == [2, 4, 6, 8]
    assert {(r["step"], r["split"]) for r in evals} == {
        (s, split) for s in (4, 8) for split in ("validation_matched", "validation_mismatched")}
    for row in train:
        for key in ("loss", "accuracy", "lr", "tokens_per_s", "packets_sent_fwd", "packets_lost_fwd",
                    "packets_sent_bwd", "packets_lost_bwd", "disagreement", "hidden_rel_diff"):
            assert key in row
    # Counters grow monotonically; eval traffic is forward only.
    assert all(a["packets_sent_fwd"] < b["packets_sent_fwd"] for a, b in zip(train, train[1:]))
    assert all(r["packets_sent_bwd"] == 0 and r["packets_sent_fwd"] > 0 for r in evals)
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["status"] == "completed" and on_disk["steps"] == 8
    assert on_disk["dataset"].startswith("synthetic")
    assert set(on_disk["final"]) == {"validation_matched", "validation_mismatched"}
    assert set(on_disk["versions"]) >= {"lossysim", "torch", "transformers"}
    train_fwd = next(p for p in on_disk["packets"]["train"] if p["direction"] == "fwd")
    assert train_fwd["sent"] == train[-1]["packets_sent_fwd"]
    assert train_fwd["configured_loss_rate"] == pytest.approx(0.05)
    assert 0 < train_fwd["observed_loss_rate"] < 0.2
    sites = {p["site"] for p in on_disk["packets_by_site"]["train"]}
    assert sites == {f"h.{i}.{m}.{k}" for i in range(2) for m in ("attn", "mlp") for k in ("copy", "reduce")}


def test_same_seed_same_metrics_and_different_seed_differs(tmp_path):
    first = tiny(tmp_path / "a", loss="bernoulli:0.05")
    second = first.replace(out=str(tmp_path / "b"))
    third = first.replace(out=str(tmp_path / "c"), seed=1)
    for config in (first, second, third):
        assert run_experiment(config, config.out, progress=False)["status"] == "completed"
    rows = [_drop_timings(read_jsonl(Path(c.out) / "metrics.jsonl")) for c in (first, second, third)]
    assert rows[0] == rows[1]
    assert rows[0] != rows[2]




def test_loss_free_sim_and_dist_agree(tmp_path):
    config = tiny(tmp_path / "sim", loss="none")
    sim = run_experiment(config, config.out, progress=False)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config.to_dict()))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = torchrun(["train", "--config", str(config_path), "--backend", "dist", "--out", str(tmp_path / "dist"),
                     "--no-progress"], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dist = json.loads((tmp_path / "dist" / "summary.json").read_text())
    assert dist["status"] == "completed"
    for split in ("validation_matched", "validation_mismatched"):
        assert dist["final"][split]["accuracy"] == sim["final"][split]["accuracy"]
        assert dist["final"][split]["loss"] == pytest.approx(sim["final"][split]["loss"], rel=1e-4)
        assert dist["final"][split]["disagreement"] == 0.0
    assert _drop_timings(dist["packets"]) == _drop_timings(sim["packets"])


def test_checkpoint_reloads_with_identical_predictions(tmp_path, capfd):
    """The exported model predicts as the trained one; exporting it draws no transformers progress bar
    of its own (shards written, weights loaded back) in a run without progress bars."""
    from transformers import GPT2ForSequenceClassification
    config = tiny(tmp_path, loss="none", save_checkpoint=True)
    summary = run_experiment(config, config.out, progress=False)
    assert summary["status"] == "completed", summary.get("error")
    err = capfd.readouterr().err
    assert "Writing model shards" not in err and "Loading weights" not in err, err[-500:]
    checkpoint = Path(config.out) / "checkpoint"
    model = GPT2ForSequenceClassification.from_pretrained(checkpoint).eval()
    data = prepare_data(config, Path(os.environ["LOSSYSIM_CACHE"]) / "data")
    for split in ("validation_matched", "validation_mismatched"):
        correct = 0
        with torch.no_grad():
            for batch in eval_batches(data.splits[split], 32):
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                correct += int((logits.argmax(-1) == batch["labels"]).sum())
        assert correct / len(data.splits[split]["labels"]) == pytest.approx(
            summary["final"][split]["accuracy"], abs=1e-6)
    assert (checkpoint / "tokenizer.json").exists() or (checkpoint / "vocab.json").exists()


def _tp_step(config, data, checkpointing: bool):
    model = build_model("tiny", vocab_size=data.vocab_size, pad_token_id=data.pad_token_id, num_labels=3,
                        max_length=config.max_length, dropout=0.1, seed=0)
    network = LossyNetwork(2, "ge:rate=0.1,burst=4", seed=3)
    tp = parallelize(model, 2, network, seed=5)
    if checkpointing:
        tp.model.activation_checkpointing_enable(
            {"use_reentrant": False, "context_fn": tp.group.checkpoint_contexts})
    tp.train()
    torch.manual_seed(7)  # attention dropout (sharded region) uses the global stream
    batch = next(train_batches(data, 8, 0))
    tp(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in tp.named_parameters()}, network.stats(), network.clock(), batch


def test_activation_checkpointing_replays_masks_and_counts_once(tmp_path):
    """A replay redraws nothing and counts no packet twice, but its forward all-reduces take time again."""
    config = tiny(tmp_path)
    data = prepare_data(config, Path(os.environ["LOSSYSIM_CACHE"]) / "data")
    plain_grads, plain_stats, plain_clock, batch = _tp_step(config, data, checkpointing=False)
    ckpt_grads, ckpt_stats, ckpt_clock, _ = _tp_step(config, data, checkpointing=True)
    assert ckpt_stats == plain_stats
    # every block's two forward all-reduces (attention and MLP outputs, [batch, seq, hidden]) again
    model = build_model("tiny", vocab_size=data.vocab_size, pad_token_id=data.pad_token_id, num_labels=3,
                        max_length=config.max_length)
    one = LossyNetwork(2, "none")
    one.all_reduce("s", "fwd", torch.zeros(2, *batch["input_ids"].shape, model.config.n_embd), range(2))
    replays = 2 * model.config.n_layer * one.clock()["comm_s"]
    assert ckpt_clock["comm_s"] - plain_clock["comm_s"] == pytest.approx(replays, rel=1e-9)
    assert sum(r["lost"] for r in plain_stats) > 0
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_non_finite_loss_marks_run_diverged(tmp_path):
    config = tiny(tmp_path, lr=1e30, grad_clip=0.0, warmup_steps=0, steps=20)
    summary = run_experiment(config, config.out, progress=False)
    assert summary["status"] == "diverged"
    assert 1 <= summary["diverged_at"]["step"] <= 20
    # After one step at lr=1e30 every weight is huge: the first all-reduce of the next forward overflows.
    assert summary["diverged_at"]["site"] == "h.0.attn.reduce"
    assert summary["diverged_at"]["direction"] == "fwd"
    on_disk = json.loads((Path(config.out) / "summary.json").read_text())
    assert on_disk["status"] == "diverged"


def _cli_error(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err and len(err.splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, cache_root) -> Path:
    """A completed run with a sealed training checkpoint: what a refused run must leave as it was."""
    root = tmp_path_factory.mktemp("finished")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOSSYSIM_CACHE", str(cache_root))
        config = tiny(root, steps=2, eval_every=2, log_every=1, checkpoint_every=2, max_train_samples=32,
                      max_eval_samples=16)
        assert run_experiment(config, config.out, progress=False)["status"] == "completed"
    return Path(config.out)


def _files(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _copy(run: Path, tmp_path: Path) -> tuple[Path, dict]:
    out = tmp_path / "r"
    shutil.copytree(run, out)
    before = _files(out)
    assert {"metrics.jsonl", "summary.json", "config.yaml"} <= set(before)
    assert any(name.startswith("checkpoints/step-") for name in before)
    return out, before


@pytest.mark.parametrize("argv, needle", [
    (["--config", "missing.yaml"], "missing.yaml"),
    (["--loss", "bernoulli:2"], "p=2"),
    (["--loss", "ge:rate=0.9,burst=2"], "not reachable"),
    (["--set", "nonsense=1"], "nonsense"),
    (["--tp-size", "3"], "n_head=4"),
    (["--dataset", "no-such-dataset"], "no-such-dataset"),
    (["--model", "no-such-model"], "no-such-model"),
    (["--backend", "dist"], "torchrun"),
    (["--loss", "bernoulli:0.1", "--set", "lossy_traffic=dp"], "no traffic can lose packets"),
    (["--set", "dp_sync_every=2"], "dp_sync_every=2 needs dp_size > 1"),
])
def test_bad_input_gives_one_line_error_and_touches_nothing(finished_run, tmp_path, capsys, argv, needle):
    """--resume gets past the folder's own check: what is caught only once the model is built (tp, model,
    data) or the processes started (dist) must still leave a finished run byte for byte as it was."""
    out, before = _copy(finished_run, tmp_path)
    err = _cli_error(capsys, ["train", "--no-progress", "--resume", "--steps", "2", "--out", str(out),
                              "--set", "max_train_samples=32", "--set", "max_eval_samples=16", *argv])
    assert needle in err
    assert _files(out) == before


def test_a_new_run_never_replaces_a_finished_one_or_its_checkpoints(finished_run, tmp_path, capsys):
    out, before = _copy(finished_run, tmp_path)
    argv = ["train", "--no-progress", "--config", str(out / "config.yaml"), "--out", str(out)]
    assert "holds a finished run (status completed)" in _cli_error(capsys, argv)
    assert _files(out) == before
    (out / "summary.json").unlink()          # killed after its checkpoint: only --resume may go on
    before = _files(out)
    assert "add --resume" in _cli_error(capsys, argv)
    assert _files(out) == before


def test_a_training_failure_is_recorded_in_the_folder_the_run_took_over(tmp_path, monkeypatch):
    """Only settings are refused without a trace: a run that fails while training leaves its summary
    (how a sweep learns it failed), in a folder where an earlier failed attempt was replaced."""
    config = tiny(tmp_path, steps=2, max_train_samples=32, max_eval_samples=16)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text(json.dumps({"status": "failed", "error": "earlier"}))
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 9, "split": "train"}\n')

    def broken_step(*args):
        raise RuntimeError("step broke")
    monkeypatch.setattr(experiment, "train_step", broken_step)
    summary = run_experiment(config, config.out, progress=False)
    assert summary["status"] == "failed" and "step broke" in summary["error"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text()) == config.to_dict()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()   # the earlier attempt's rows are gone


def test_malformed_config_names_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("steps: 3\nloss: [unclosed\n")
    err = _cli_error(capsys, ["train", "--config", str(path)])
    assert "line" in err and "bad.yaml" in err


def test_unwritable_output_folder(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    err = _cli_error(capsys, ["train", "--no-progress", "--out", str(blocker / "run")])
    assert f"--out {blocker / 'run'} cannot be created: {blocker} is not a folder" in err
    assert [p.name for p in tmp_path.iterdir()] == ["file"] and blocker.read_text() == "not a directory"


def test_full_disk_is_refused_before_training(tmp_path, capsys, monkeypatch):
    import shutil as shutil_module
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: usage(10 << 20, 9 << 20, 1 << 20))
    err = _cli_error(capsys, ["train", "--no-progress", "--out", str(tmp_path / "r"), "--steps", "4",
                              "--set", "checkpoint_every=2", "--set", "max_train_samples=32",
                              "--set", "max_eval_samples=16", "--set", "max_length=32"])
    assert "not enough free space" in err
    assert not (tmp_path / "r").exists()


def test_a_transport_that_gives_up_costs_a_restart_or_ends_the_run(tmp_path):
    """Bursty loss outlasts IRN's seven retries: each failure is charged restart_s plus restart_lost_steps
    steps once, the clock never runs backwards, and max_failures ends the run as gave_up."""
    lossy = dict(loss="ge:rate=0.1,burst=8", transport="retransmit", nic="irn", restart_s=10.0,
                 restart_lost_steps=5, steps=12, log_every=2, eval_every=6)
    summary = run_experiment(tiny(tmp_path / "a", **lossy), tmp_path / "a" / "run", progress=False)
    rows = [r for r in read_jsonl(tmp_path / "a" / "run" / "metrics.jsonl") if r["split"] == "train"]
    failures, time = summary["sim_time"]["failures"], summary["sim_time"]
    assert summary["status"] == "completed" and failures > 0
    assert all(a["sim_time_s"] <= b["sim_time_s"] for a, b in zip(rows, rows[1:]))
    assert [r["failures"] for r in rows] == sorted(r["failures"] for r in rows)
    per_step = time["compute_s_per_step"] + time["comm_s_per_step"]
    assert failures * 10.0 < time["restart_s"] < failures * (10.0 + 5 * 2 * per_step)
    assert time["total_s"] == pytest.approx(12 * per_step + time["restart_s"], rel=1e-9)
    assert time["total_s_ideal_nic"] < 12 * per_step

    ended = run_experiment(tiny(tmp_path / "b", max_failures=1, **lossy), tmp_path / "b" / "run", progress=False)
    assert ended["status"] == "gave_up" and ended["sim_time"]["failures"] >= 1
    assert ended["steps"] < 12


def _replayed(spec, record: dict) -> dict:
    """``record``'s call again on a fresh network of ``spec``: the choice NCCL's model makes for its size."""
    net = LossyNetwork(spec)
    pair = (0, 1) if record["collective"] == "send" else None
    net.simulate(record["site"], record["direction"], record["bytes"] // 4, torch.float32, record["collective"],
                 pair=pair)
    row, = net.choices()
    return row


def test_summary_records_every_training_networks_nccl_choices(tmp_path):
    """summary.json's collectives: one record per (network, site, direction, collective, bytes), for the TP
    network, every DP group and (with stages) every stage and boundary; each the choice a fresh network of
    the same spec makes for that message."""
    config = tiny(tmp_path / "dp", algorithm="auto", dp_size=2, steps=2, eval_every=2, log_every=1)
    summary = run_experiment(config, config.out, progress=False)
    on_disk = json.loads((Path(config.out) / "summary.json").read_text())
    assert on_disk["collectives"] == summary["collectives"]
    records = summary["collectives"]
    assert {r["network"] for r in records} == {"tp", "dp.tp0", "dp.tp1"}
    assert {(r["site"], r["direction"]) for r in records if r["network"] == "tp"} == \
        {(p["site"], p["direction"]) for p in summary["packets_by_site"]["train"]}
    buckets = summary["data_parallel"]["buckets"]
    for t in (0, 1):
        assert sorted(r["site"] for r in records if r["network"] == f"dp.tp{t}") == \
            sorted(f"dp.bucket{b}" for b in range(buckets))
    settings, mesh = config.network_settings(), config.mesh()
    specs = {"tp": mesh.network_spec("tp", 0, settings), "dp.tp0": dp_group_spec(config, 0),
             "dp.tp1": dp_group_spec(config, 1)}
    for record in records:
        assert {k: v for k, v in record.items() if k != "network"} == _replayed(specs[record["network"]], record)

    config = tiny(tmp_path / "pp", pp_size=2, steps=2, eval_every=2, log_every=1)
    records = run_experiment(config, config.out, progress=False)["collectives"]
    assert {r["network"] for r in records} == {"tp.stage0", "tp.stage1", "pp.boundary0"}
    for s in (0, 1):
        assert {r["site"].split(".")[1] for r in records if r["network"] == f"tp.stage{s}"} == {str(s)}
    sends = [r for r in records if r["network"] == "pp.boundary0"]
    assert {(r["direction"], r["collective"], r["algorithm"]) for r in sends} == \
        {("fwd", "send", "p2p"), ("bwd", "send", "p2p")}
