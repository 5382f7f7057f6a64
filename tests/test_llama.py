"""Tensor-parallel Llama, Qwen2 and Mistral (grouped-query attention, rotary, SwiGLU, RMSNorm) in ``sim``.

Tolerances as in test_tensor_parallel.py, which also holds every family's loss-free TP against HF
(``EXACT_CASES``): TP matches HF to 1e-5 relative error per tensor; the same operations on the same
values are bitwise equal. Grouped-query attention: 8 query heads with 8 (MHA), 2 or 1 kv heads,
so tp 2 splits 2 kv heads and tp 4 and 8 give ranks copies of one kv head.
"""
from __future__ import annotations

import copy
import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tp_common import (FAMILIES, TOL, build, grads, hf_step, inputs as _inputs, make_batch,  # noqa: E402
                        params, rel_err, sharded_names, tp_step)

from lossysim import LossyNetwork, gather_full_model, parallelize  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_plan_shards_what_it_says():
    """q/k/v, gate/up column-parallel, o/down row-parallel (their biases replicated), all else replicated;
    kv heads split when tp divides them, copied when tp is a multiple of them."""
    for tp, kv_heads, kv_rows in ((2, 2, 4), (4, 2, 4), (8, 2, 4), (4, 8, 8)):  # kv_rows: 4 per kv head
        tpm = parallelize(build("cls", family="llama", kv_heads=kv_heads), tp)
        layer = tpm.model.model.layers[1]
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.q_proj.weight.shape == (tp, 32 // tp, 32)  # 8 heads of 4, over tp ranks
        assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (tp, kv_rows, 32)
        assert attn.num_key_value_groups == (8 // tp) // max(kv_heads // tp, 1)
        assert attn.o_proj.weight.shape == (tp, 32, 32 // tp) and attn.o_proj.bias.shape == (32,)
        assert mlp.gate_proj.weight.shape == mlp.up_proj.weight.shape == (tp, 64 // tp, 32)
        assert mlp.down_proj.weight.shape == (tp, 32, 64 // tp) and mlp.down_proj.bias.shape == (32,)
        sharded = sharded_names(tpm)
        expected = {f"model.layers.{i}.{path}.{leaf}" for i in range(2)
                    for path in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                                 "mlp.up_proj")
                    for leaf in ("weight", "bias")} | \
                   {f"model.layers.{i}.{path}.weight" for i in range(2)
                    for path in ("self_attn.o_proj", "mlp.down_proj")}
        assert sharded == expected
        if kv_heads < tp:  # rank r holds kv head r // (tp / kv_heads)
            per = tp // kv_heads
            full = build("cls", family="llama", kv_heads=kv_heads).model.layers[1].self_attn.k_proj.weight
            for r in range(tp):
                head = r // per
                assert torch.equal(attn.k_proj.weight[r], full[head * 4:(head + 1) * 4]), r


def test_sites_and_traffic():
    """Two copy sites (bwd) and two reduce sites (fwd) per layer, each sending one [tokens, hidden] message."""
    tp = 4
    network = LossyNetwork(tp, "none", algorithm="direct")  # one whole message per link
    tpm = parallelize(build("cls", family="llama"), tp, network)
    tp_step(tpm, "cls", make_batch("cls"))
    sites = {(row["site"], row["direction"]) for row in network.stats()}
    assert sites == {(f"layers.{i}.{part}.{kind}", direction) for i in range(2) for part in ("self_attn", "mlp")
                     for kind, direction in (("copy", "bwd"), ("reduce", "fwd"))}
    _, n_packets = network.packets(3 * 10 * 32, torch.float32)
    assert all(row["sent"] == n_packets and row["calls"] == 1 for row in network.stats())


def test_loss_reaches_the_model_and_kv_copies_stay_equal():
    """Under loss the ranks diverge, yet ranks holding the same kv head keep equal weights after a step
    (their gradients are summed), and every gradient stays finite."""
    tp = 4
    ref = build("cls", family="llama", kv_heads=2)
    clean = parallelize(copy.deepcopy(ref), tp)
    lossy = parallelize(copy.deepcopy(ref), tp, LossyNetwork(tp, "bernoulli:0.2", seed=1))
    batch = make_batch("cls")
    clean_logits, _ = tp_step(clean, "cls", batch)
    logits, _ = tp_step(lossy, "cls", batch)
    assert rel_err(logits[0], clean_logits[0]) > 1e-3
    assert lossy.disagreement()["hidden_rel_diff"] > 1e-3
    optimizer = torch.optim.SGD(lossy.parameters(), lr=0.5)
    optimizer.step()
    for i in range(2):
        for proj in ("k_proj", "v_proj"):
            weight = lossy.model.model.layers[i].self_attn.get_submodule(proj).weight
            grad = weight.grad
            assert torch.isfinite(grad).all()
            for pair in ((0, 1), (2, 3)):  # the two holders of each kv head
                assert torch.equal(weight[pair[0]], weight[pair[1]]), (i, proj, pair)
                assert torch.equal(grad[pair[0]], grad[pair[1]]), (i, proj, pair)
            assert not torch.equal(weight[0], weight[2])


@pytest.mark.parametrize("tp, heads, kv_heads, named", [
    (3, 8, 2, 8),   # tp does not divide the query heads
    (6, 12, 4, 4),  # tp neither divides nor is a multiple of the kv heads
    (4, 12, 3, 3),
])
def test_head_counts_tp_cannot_shard_are_one_line_errors(tp, heads, kv_heads, named):
    with pytest.raises(ValueError) as info:
        parallelize(build("cls", family="llama", num_attention_heads=heads, num_key_value_heads=kv_heads,
                          hidden_size=4 * heads, intermediate_size=96), tp)
    message = str(info.value)
    assert "\n" not in message
    assert re.search(rf"\btp_size={tp}\b", message) and re.search(rf"={named}\b", message), message


def test_mlp_width_tp_cannot_split_is_an_error():
    with pytest.raises(ValueError, match=r"tp_size=4 does not divide the 30 output features"):
        parallelize(build("cls", family="llama", intermediate_size=30), 4)


# -- gather -> HF -> from_pretrained ---------------------------------------------------

def _trained(family: str, kind: str, tp: int, kv_heads: int, **overrides):
    """A TP model after two lossy SGD steps: every shard moved away from the initial weights."""
    tpm = parallelize(build(kind, family=family, kv_heads=kv_heads, **overrides), tp,
                      LossyNetwork(tp, "bernoulli:0.1", seed=4))
    optimizer = torch.optim.SGD(tpm.parameters(), lr=0.3)
    for _ in range(2):
        optimizer.zero_grad()
        tp_step(tpm, kind, make_batch(kind))
        optimizer.step()
    return tpm.eval()


@pytest.mark.parametrize("family, kind, tp, kv_heads, tie", [
    ("llama", "lm", 2, 2, True), ("llama", "cls", 4, 2, False), ("qwen2", "cls", 2, 1, False),
    ("mistral", "lm", 4, 8, False)])
def test_gathered_model_loads_with_from_pretrained(tmp_path, family, kind, tp, kv_heads, tie):
    """(Llama 3.2 1B ties its LM head to the embeddings: the tie survives sharding and gathering.)"""
    tpm = _trained(family, kind, tp, kv_heads, tie_word_embeddings=tie)
    if tie:
        assert tpm.model.lm_head.weight is tpm.model.model.embed_tokens.weight
    inputs = _inputs(make_batch(kind))
    # The lossless forward of the trained shards is what the gathered model must compute.
    tpm.group.network = LossyNetwork(tp)
    with torch.no_grad():
        tp_logits = tpm(**inputs).logits
    full = gather_full_model(tpm)
    assert type(full) is FAMILIES[family][2][kind]
    if tie:
        assert full.lm_head.weight is full.model.embed_tokens.weight
    full.save_pretrained(tmp_path)
    loaded = type(full).from_pretrained(tmp_path).eval()
    saved, restored = full.state_dict(), loaded.state_dict()
    assert saved.keys() == restored.keys()
    for name, value in saved.items():
        assert torch.equal(restored[name], value), name
    with torch.no_grad():
        assert rel_err(loaded(**inputs).logits, tp_logits) <= TOL
    # Sharded again, the reloaded model holds the same shards bit for bit.
    again = parallelize(loaded, tp)
    before, after = params(tpm), params(again)
    for name, value in before.items():
        assert torch.equal(after[name], value), name


# -- gather keeps the dtype -----------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_gather_keeps_the_dtype(tmp_path, family, dtype):
    ref = build("lm", family=family).to(dtype).eval()
    tpm = parallelize(copy.deepcopy(ref), 2).eval()
    full = gather_full_model(tpm)
    assert {p.dtype for p in full.parameters()} == {dtype}
    reference = dict(ref.named_parameters())
    for name, value in full.named_parameters():
        assert torch.equal(value, reference[name]), name  # no round trip through float32
    for name, value in ref.named_buffers():
        assert torch.equal(full.get_buffer(name), value), name
    inputs = _inputs(make_batch("lm"))
    with torch.no_grad():
        assert torch.equal(full(**inputs).logits, ref(**inputs).logits)
    full.save_pretrained(tmp_path)
    size = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    numel = sum(p.numel() for p in ref.parameters())
    assert numel * dtype.itemsize <= size < numel * dtype.itemsize + 65536


def test_runner_gradient_norm_counts_kv_copies_once():
    """The norm the runner clips by is HF's global gradient norm, kv copies or not."""
    from lossysim.run.step import _clip_grad_norm
    for tp, kv_heads in ((4, 2), (8, 1), (2, 2)):
        ref = build("cls", family="llama", kv_heads=kv_heads)
        tpm = parallelize(copy.deepcopy(ref), tp)
        hf_step(ref, "cls", make_batch("cls"))
        tp_step(tpm, "cls", make_batch("cls"))
        expected = torch.stack([p.grad.double().pow(2).sum() for p in ref.parameters()]).sum().sqrt()
        assert rel_err(_clip_grad_norm(tpm, 0.0), expected) <= TOL, (tp, kv_heads)


# -- the runner: named shapes and pretrained Llama-family directories ---------------------

def _runner_config(tmp_path, **changes):
    from lossysim.config import ExperimentConfig
    base = dict(model="tiny-llama", dataset="synthetic", max_length=32, max_train_samples=96,
                max_eval_samples=32, batch_size=8, eval_batch_size=32, steps=4, eval_every=4,
                log_every=2, warmup_steps=1, dropout=0.0, lr=1e-3, tp_size=2,
                loss="ge:rate=0.05,burst=4", out=str(tmp_path / "run"))
    return ExperimentConfig(**{**base, **changes}).validate()


def test_named_shapes_are_llama_3_2_1b_and_a_tiny_llama():
    from lossysim.models import build_model
    with torch.device("meta"):  # shapes only: no 5 GB of random weights
        big = build_model("llama-1b-shape", vocab_size=128256, pad_token_id=0, num_labels=3, max_length=128)
    config = big.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.hidden_size, config.intermediate_size) == (16, 32, 8, 2048, 8192)
    # Llama 3.2 1B has 1,235,814,400 parameters (tied embeddings); plus the 3-way score head.
    assert sum(p.numel() for p in big.parameters()) == 1_235_814_400 + 3 * 2048
    small = build_model("tiny-llama", vocab_size=500, pad_token_id=0, num_labels=3, max_length=32, dropout=0.1)
    assert type(small).__name__ == "LlamaForSequenceClassification"
    assert small.config.attention_dropout == 0.1 and small.config.num_key_value_heads == 2


@pytest.mark.usefixtures("private_cache")
def test_runner_trains_tiny_llama_under_loss(tmp_path):
    import json
    from pathlib import Path

    from lossysim.run.experiment import run_experiment
    config = _runner_config(tmp_path, tp_size=4, save_checkpoint=True)  # 2 kv heads on 4 ranks: copies
    summary = run_experiment(config, config.out, progress=False)
    assert summary["status"] == "completed", summary.get("error")
    sites = {p["site"] for p in summary["packets_by_site"]["train"]}
    assert sites == {f"layers.{i}.{m}.{k}" for i in range(2) for m in ("self_attn", "mlp")
                     for k in ("copy", "reduce")}
    assert sum(p["lost"] for p in summary["packets"]["train"]) > 0
    assert json.loads((Path(config.out) / "summary.json").read_text())["steps"] == 4
    from transformers import LlamaForSequenceClassification
    reloaded = LlamaForSequenceClassification.from_pretrained(Path(config.out) / "checkpoint")
    assert reloaded.config.num_key_value_heads == 2


@pytest.mark.usefixtures("private_cache")
def test_runner_loads_a_pretrained_llama_directory_with_its_tokenizer(tmp_path):
    """A local Llama checkpoint whose tokenizer has no pad token (as Llama 3's): the runner pads with
    EOS, which the texts never contain, and fine-tunes the classifier."""
    from lossysim.data.tokenizers import _wrap, train_bpe
    from lossysim.run.experiment import run_experiment
    from transformers import LlamaConfig, LlamaForCausalLM
    texts = [f"the {w} sat on {v} mats" for w in ("cat", "dog", "bird") for v in range(30)]
    trained = train_bpe(texts, vocab_size=300)
    tokenizer = _wrap(trained.backend_tokenizer, eos_token="<|endoftext|>")  # no pad token
    assert tokenizer.pad_token is None
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, tie_word_embeddings=True))
    directory = tmp_path / "pretrained"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    config = _runner_config(tmp_path, model=str(directory), tp_size=2, save_checkpoint=True)
    summary = run_experiment(config, config.out, progress=False)
    assert summary["status"] == "completed", summary.get("error")
    from transformers import AutoTokenizer, LlamaForSequenceClassification
    saved = tmp_path / "run" / "checkpoint"
    used = AutoTokenizer.from_pretrained(saved)
    assert used.pad_token == "<|endoftext|>" and len(used) == len(tokenizer)
    finetuned = LlamaForSequenceClassification.from_pretrained(saved)
    assert finetuned.config.pad_token_id == used.pad_token_id
    # Started from the pretrained weights: the embeddings moved a little, not to a fresh init.
    moved = rel_err(finetuned.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert 0 < moved < 0.5


@pytest.mark.usefixtures("private_cache")
@pytest.mark.parametrize("model", ["tiny-llama", "tiny"])
def test_runner_fine_tunes_a_causal_lm(tmp_path, model):
    """task: lm trains the causal LM on the texts under loss; the loss-free evaluation's loss and
    accuracy are what the saved HF model computes on every real next token of the split."""
    from pathlib import Path

    from lossysim.data import eval_batches, prepare_data
    from lossysim.io import read_jsonl
    from lossysim.run.experiment import run_experiment
    from transformers import AutoModelForCausalLM
    config = _runner_config(tmp_path, model=model, task="lm", eval_lossy=False, save_checkpoint=True,
                            loss="bernoulli:0.05", lr=3e-3)
    summary = run_experiment(config, config.out, progress=False)
    assert summary["status"] == "completed", summary.get("error")
    rows = read_jsonl(Path(config.out) / "metrics.jsonl")
    train = [r for r in rows if r["split"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"]  # it learns the texts
    assert all(0 <= r["disagreement"] <= 1 for r in rows)
    assert any(r["disagreement"] > 0 for r in train)  # lossy training: the ranks' predictions differ
    saved = AutoModelForCausalLM.from_pretrained(Path(config.out) / "checkpoint").eval()
    data = prepare_data(config, Path(os.environ["LOSSYSIM_CACHE"]) / "data")
    for split in ("validation_matched", "validation_mismatched"):
        total = correct = tokens = 0
        with torch.no_grad():
            for batch in eval_batches(data.splits[split], 32):
                logits = saved(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                valid = batch["attention_mask"][:, 1:].bool()
                target = batch["input_ids"][:, 1:][valid]
                total += float(torch.nn.functional.cross_entropy(logits[:, :-1][valid], target, reduction="sum"))
                correct += int((logits[:, :-1][valid].argmax(-1) == target).sum())
                tokens += int(valid.sum())
        final = summary["final"][split]
        assert final["loss"] == pytest.approx(total / tokens, rel=1e-5)
        assert final["accuracy"] == pytest.approx(correct / tokens, abs=1e-6)
        assert final["disagreement"] == 0.0  # a loss-free evaluation: every rank predicts alike


@pytest.mark.usefixtures("private_cache")
def test_runner_dist_agrees_with_sim_on_tiny_llama_lm(tmp_path):
    """torchrun, 2 gloo ranks: a loss-free causal-LM run of tiny-llama ends as the sim run does."""
    import json

    import yaml
    from torchrun_launch import torchrun

    from lossysim.run.experiment import run_experiment
    config = _runner_config(tmp_path / "sim", task="lm", loss="none")
    sim = run_experiment(config, config.out, progress=False)
    assert sim["status"] == "completed", sim.get("error")
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config.to_dict()))
    proc = torchrun(["train", "--config", str(config_path), "--backend", "dist", "--out", str(tmp_path / "dist"),
                     "--no-progress"], env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    dist = json.loads((tmp_path / "dist" / "summary.json").read_text())
    assert dist["status"] == "completed"
    for split in ("validation_matched", "validation_mismatched"):
        assert dist["final"][split]["loss"] == pytest.approx(sim["final"][split]["loss"], rel=1e-4)
        assert dist["final"][split]["accuracy"] == pytest.approx(sim["final"][split]["accuracy"], abs=1e-3)
        assert dist["final"][split]["disagreement"] == 0.0
    drop = ("time_s", "tokens_per_s", "wall_time_s")
    strip = [[{k: v for k, v in row.items() if k not in drop} for row in rows]
             for rows in (dist["packets"]["train"], sim["packets"]["train"])]
    assert strip[0] == strip[1]


def test_activation_checkpointing_replays_masks_on_llama():
    """Recomputed Llama layers see the original forward's packet masks: the same gradients and counts."""
    results = []
    for checkpointing in (False, True):
        network = LossyNetwork(2, "ge:rate=0.1,burst=4", seed=3)
        tpm = parallelize(build("cls", family="llama"), 2, network)
        if checkpointing:
            tpm.model.activation_checkpointing_enable(
                {"use_reentrant": False, "context_fn": tpm.group.checkpoint_contexts})
        tpm.train()
        tp_step(tpm, "cls", make_batch("cls"))
        results.append((grads(tpm), network.stats()))
    (plain, plain_stats), (recomputed, recomputed_stats) = results
    assert plain_stats == recomputed_stats and sum(row["lost"] for row in plain_stats) > 0
    for name, grad in plain.items():
        assert torch.equal(recomputed[name], grad), name


def test_unsupported_model_is_a_type_error_naming_the_supported_classes():
    with pytest.raises(TypeError, match=r"LlamaForCausalLM.*Qwen2Model.*not Linear"):
        parallelize(torch.nn.Linear(2, 2), 2)
