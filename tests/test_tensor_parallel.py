"""Tensor-parallel GPT-2 in the ``sim`` backend (all ranks in one process), and every architecture
family's loss-free exactness against HF (the Llama family's other checks are in test_llama.py).

Tolerances: "relative error" is ||a - b|| / ||b|| per tensor. Without loss the
TP model must match HF to 1e-5 (the all-reduce sums partial products in another
order than HF's single matmul, so bitwise equality is not expected). Whatever
runs the same operations on the same values (two TP models, a TP model and its
re-sharded copy) must be bitwise equal (torch.equal).
"""
from __future__ import annotations

import copy
import math
import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from scipy import stats as scipy_stats

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tp_common import (ATTENTION, BATCH, EXACT_CASES, SEQ, TOL, assert_matches_hf, build, grads,  # noqa: E402
                        inputs as _inputs, make_batch, params, rel_err, sharded_names, tp_step)

from lossysim import LossyNetwork, gather_full_model, parallelize  # noqa: E402
from lossysim.tp.groups import SimGroup
from lossysim.tp.mappings import copy_to_tp, gather_from_tp, reduce_from_tp  # noqa: E402
from lossysim.tp.layers import ColumnParallel, RowParallel, unshard_columns  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _sites(n_layer: int) -> set:
    return {(f"h.{i}.{part}.{kind}", direction) for i in range(n_layer) for part in ("attn", "mlp")
            for kind, direction in (("reduce", "fwd"), ("copy", "bwd"))}


# -- no loss: the TP model is the HF model, for every architecture family ------------

@pytest.mark.parametrize("family, kind, attn, tp, kv_heads", EXACT_CASES)
def test_matches_hf_without_loss(family, kind, attn, tp, kv_heads):
    ref = build(kind, attn, family=family, **({} if kv_heads is None else {"kv_heads": kv_heads}))
    tpm = parallelize(copy.deepcopy(ref), tp)
    assert tpm.config._attn_implementation == attn
    assert_matches_hf(ref, tpm, kind, tp)


@pytest.mark.parametrize("attn", ATTENTION)
def test_dropout_without_loss_keeps_ranks_identical(attn):
    tpm = parallelize(build("cls", attn, dropout=0.1), 4, seed=5)
    tpm.train()
    batch = make_batch("cls")
    logits, losses = tp_step(tpm, "cls", batch)
    for r in range(1, 4):
        assert torch.equal(logits[r], logits[0])
        assert torch.equal(tpm.rank_hidden[r], tpm.rank_hidden[0])
        assert torch.equal(losses[r], losses[0])
    assert tpm.disagreement() == {"prediction": 0.0, "hidden_rel_diff": 0.0}
    assert all(torch.isfinite(g).all() for g in grads(tpm).values())
    # Dropout is really on: the eval forward and a second training forward differ.
    with torch.no_grad():
        again = tpm(**_inputs(batch)).logits
        tpm.eval()
        evaluated = tpm(**_inputs(batch)).logits
    assert rel_err(logits[0], evaluated) > 1e-3
    assert rel_err(again, logits[0]) > 1e-3


# -- statistics -------------------------------------------------------------------

@pytest.mark.parametrize("payload", [1450, 64])
@pytest.mark.parametrize("spec", ["none", "bernoulli:0.2", "ge:rate=0.2,burst=3"])
@pytest.mark.parametrize("tp", [2, 4])
def test_statistics_count_every_packet(tp, spec, payload):
    ref = build("cls")
    network = LossyNetwork(tp, spec, seed=3, payload_bytes=payload, algorithm="direct")  # every link, once
    tpm = parallelize(ref, tp, network)
    numel = BATCH * SEQ * ref.config.n_embd  # one rank's activation (or its gradient) per message
    per_packet, n_packets = network.packets(numel, torch.float32)
    assert per_packet == payload // 4 and n_packets == math.ceil(numel / (payload // 4))
    links = {(s, d) for s in range(tp) for d in range(tp) if s != d}
    sites = _sites(ref.config.n_layer)
    for calls in (1, 2):
        tp_step(tpm, "cls", make_batch("cls"))
        rows = network.stats()
        assert len(rows) == len(sites) * len(links)
        assert {(row["site"], row["direction"]) for row in rows} == sites
        for site, direction in sites:
            mine = [row for row in rows if (row["site"], row["direction"]) == (site, direction)]
            assert {(row["src"], row["dst"]) for row in mine} == links
        for row in rows:
            assert row["calls"] == calls
            assert row["sent"] == calls * n_packets
            assert 0 <= row["lost"] <= row["sent"]
        total_sent = sum(row["sent"] for row in rows)
        assert total_sent == calls * len(sites) * len(links) * n_packets
    lost = sum(row["lost"] for row in rows)
    if spec == "none":
        assert lost == 0
    else:
        assert lost > 0
        if total_sent > 2000:
            assert 0.1 < lost / total_sent < 0.3


# -- shard -> gather -> HF -> shard ---------------------------------------------------

def _distinct_shards(tpm, seed: int = 11) -> None:
    """Give every rank's shard its own values (an offset per rank on top of fresh noise)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tpm.sharded_parameters():
            for r in range(p.shape[0]):
                p[r] = 0.02 * torch.randn(p[r].shape, generator=gen) + 0.01 * r
    for p in tpm.sharded_parameters():
        for r in range(1, p.shape[0]):
            assert not torch.equal(p[r], p[0])


def _hf_with(tpm, column, row):
    """An HF model assembled from the TP shards by the given (possibly wrong) column/row gathers."""
    state = {k: v.clone() for k, v in gather_full_model(tpm).state_dict().items()}
    for name, module in tpm.model.named_modules():
        if isinstance(module, ColumnParallel):
            state[f"{name}.weight"] = column(module.weight.detach(), module.chunks)
            state[f"{name}.bias"] = column(module.bias.detach()[:, None], module.chunks)[0]
        elif isinstance(module, RowParallel):
            state[f"{name}.weight"] = row(module.weight.detach())
    model = type(tpm.model)(copy.deepcopy(tpm.config))
    model.load_state_dict(state)
    return model.eval()


@pytest.mark.parametrize("kind", ["lm", "cls"])
@pytest.mark.parametrize("tp", [2, 4])
def test_shard_gather_reshard_is_exact(tp, kind):
    tpm = parallelize(build(kind), tp)
    _distinct_shards(tpm)
    inputs = _inputs(make_batch(kind))
    tpm.eval()
    with torch.no_grad():
        tp_logits = tpm(**inputs).logits
    full = gather_full_model(tpm).eval()
    assert type(full) is type(tpm.model)
    with torch.no_grad():
        assert rel_err(full(**inputs).logits, tp_logits) <= TOL
    # Re-sharding the gathered model reproduces every shard and replicated tensor bit for bit.
    again = parallelize(copy.deepcopy(full), tp)
    before, after = params(tpm), params(again)
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    again.eval()
    with torch.no_grad():
        assert torch.equal(again(**inputs).logits, tp_logits)

    # The forward check catches wrong gathers: rank 0's shard everywhere, or Q|K|V blocks mis-ordered.
    def rank0_only_column(w, chunks):
        return unshard_columns(w[:1].expand_as(w).contiguous(), chunks)

    def rank0_only_row(w):
        return w[:1].expand_as(w).reshape(-1, w.shape[-1])

    def rank_major_column(w, chunks):
        return unshard_columns(w, 1)  # concatenates whole shards: [Q0 K0 V0 | Q1 K1 V1 ...]

    def good_row(w):
        return w.reshape(-1, w.shape[-1])

    for column, row in ((rank0_only_column, rank0_only_row), (unshard_columns, rank0_only_row),
                        (rank_major_column, good_row)):
        with torch.no_grad():
            assert rel_err(_hf_with(tpm, column, row)(**inputs).logits, tp_logits) > 1e-3
    with torch.no_grad():  # and the correct reassembly passes the same check
        assert rel_err(_hf_with(tpm, unshard_columns, good_row)(**inputs).logits, tp_logits) <= TOL


@pytest.mark.parametrize("kind", ["lm", "cls"])
def test_save_pretrained_round_trip(tmp_path, kind):
    tpm = parallelize(build(kind), 2)
    _distinct_shards(tpm, seed=12)
    inputs = _inputs(make_batch(kind))
    tpm.eval()
    with torch.no_grad():
        tp_logits = tpm(**inputs).logits
    full = gather_full_model(tpm)
    full.save_pretrained(tmp_path)
    loaded = type(full).from_pretrained(tmp_path).eval()
    saved, restored = full.state_dict(), loaded.state_dict()
    assert saved.keys() == restored.keys()
    for name, value in saved.items():
        assert torch.equal(restored[name], value), name
    with torch.no_grad():
        assert rel_err(loaded(**inputs).logits, tp_logits) <= TOL
        # Sharded again, the reloaded model computes the TP model's logits bit for bit.
        again = parallelize(loaded, 2).eval()
        assert torch.equal(again(**inputs).logits, tp_logits)


# -- loss reaches the model ---------------------------------------------------------

def _pair(network, tp=4, kind="cls"):
    """(loss-free TP model, TP model on ``network``) from the same HF weights."""
    ref = build(kind)
    return parallelize(copy.deepcopy(ref), tp), parallelize(copy.deepcopy(ref), tp, network)


def test_forward_loss_changes_outputs_and_ranks_disagree():
    network = LossyNetwork(4, "bernoulli:0.2", seed=1)
    clean, lossy = _pair(network)
    batch = make_batch("cls")
    clean_logits, clean_losses = tp_step(clean, "cls", batch)
    logits, losses = tp_step(lossy, "cls", batch)
    assert rel_err(logits[0], clean_logits[0]) > 1e-3
    assert not torch.equal(losses, clean_losses)
    for r in range(1, 4):
        assert not torch.equal(lossy.rank_hidden[r], lossy.rank_hidden[0])
    assert lossy.disagreement()["hidden_rel_diff"] > 1e-3
    assert clean.disagreement()["hidden_rel_diff"] == 0.0
    clean_grads, lossy_grads = grads(clean), grads(lossy)
    assert all(not torch.equal(lossy_grads[n], g) for n, g in clean_grads.items())
    assert all(torch.isfinite(g).all() for g in lossy_grads.values())
    lost = {d: sum(s["lost"] for s in network.stats() if s["direction"] == d) for d in ("fwd", "bwd")}
    assert lost["fwd"] > 0 and lost["bwd"] > 0


def test_backward_only_loss_changes_gradients_not_outputs():
    network = LossyNetwork(4, "bernoulli:0.2", seed=1, lossy=("bwd",))
    clean, lossy = _pair(network)
    batch = make_batch("cls")
    clean_logits, clean_losses = tp_step(clean, "cls", batch)
    logits, losses = tp_step(lossy, "cls", batch)
    assert torch.equal(logits, clean_logits) and torch.equal(losses, clean_losses)
    assert lossy.disagreement()["hidden_rel_diff"] == 0.0
    lost = {d: sum(s["lost"] for s in network.stats() if s["direction"] == d) for d in ("fwd", "bwd")}
    assert lost["fwd"] == 0 and lost["bwd"] > 0
    clean_grads, lossy_grads = grads(clean), grads(lossy)
    # Downstream of the last copy site (h.1.mlp.copy) nothing crosses the network.
    downstream = {n for n in clean_grads
                  if n.startswith(("transformer.ln_f.", "score.", "transformer.h.1.mlp."))}
    assert len(downstream) == 7
    for name, grad in clean_grads.items():
        if name in downstream:
            assert torch.equal(lossy_grads[name], grad), name
        else:
            assert rel_err(lossy_grads[name], grad) > 1e-6, name


def test_rescale_and_zero_recovery_differ():
    batch = make_batch("cls")
    results = {}
    for recovery in ("zero", "rescale"):
        network = LossyNetwork(4, "bernoulli:0.2", seed=1, recovery=recovery)
        clean, lossy = _pair(network)
        results[recovery] = tp_step(lossy, "cls", batch)[0], network.stats()
    clean_logits = tp_step(clean, "cls", batch)[0]
    (zero, zero_stats), (rescale, rescale_stats) = results["zero"], results["rescale"]
    assert zero_stats == rescale_stats  # the same seed: the same packets lost
    assert rel_err(rescale, zero) > 1e-3
    assert rel_err(zero, clean_logits) > 1e-3 and rel_err(rescale, clean_logits) > 1e-3


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("spec", ["bernoulli:0.2", "ge:rate=0.2,burst=4"])
def test_rescale_is_unbiased_for_the_sum_zero_is_not(spec, direction):
    """Mean over many draws of a lossy all-reduce (a reduce site forward, a copy site backward)."""
    tp, draws = 4, 300
    x = torch.rand(tp, 1000, generator=torch.Generator().manual_seed(0)) + 0.5
    true = x.sum(0)
    own_share = (x / true).mean(1)  # receiver r's own contribution, relative to the sum
    mean_error = {}
    for recovery in ("zero", "rescale"):
        # The direct exchange, whose zero-policy bias has the closed form below (ring, tree: test_algorithms.py).
        group = SimGroup(LossyNetwork(tp, spec, seed=4, recovery=recovery, payload_bytes=64, algorithm="direct"))
        errors = []
        for _ in range(draws):
            if direction == "fwd":
                y = reduce_from_tp(x, group, "h.0.attn.reduce")
            else:
                leaf = torch.zeros_like(x, requires_grad=True)
                copy_to_tp(leaf, group, "h.0.attn.copy").backward(x)
                y = leaf.grad
            errors.append(((y - true) / true).mean(1))  # [tp] relative error, per receiver
        errors = torch.stack(errors).double()  # [draws, tp]
        per_draw = errors.mean(1).numpy()
        se = per_draw.std(ddof=1) / math.sqrt(draws)
        mean_error[recovery] = (per_draw.mean(), se, scipy_stats.ttest_1samp(per_draw, 0.0).pvalue)
        stats = group.network.summary()
        assert 0.17 < stats[0]["observed_loss_rate"] < 0.23
    mean, se, pvalue = mean_error["rescale"]
    assert abs(mean) < 4 * se and abs(mean) < 0.005 and pvalue > 1e-4, mean_error
    mean, se, pvalue = mean_error["zero"]
    expected = -0.2 * float((1 - own_share).mean())  # the lost fraction of the peers' share
    assert abs(mean - expected) < 5 * se and pvalue < 1e-20, (mean, expected, mean_error)


# -- configuration errors -------------------------------------------------------------

@pytest.mark.parametrize("tp, overrides, other", [
    (3, {}, 4),                                 # n_head=4
    (4, {"n_head": 6, "n_embd": 48}, 6),        # n_head=6
    (4, {"n_inner": 30}, 30),                   # MLP width 30
])
def test_tp_size_must_divide_heads_and_mlp_width(tp, overrides, other):
    with pytest.raises(ValueError) as info:
        parallelize(build("cls", **overrides), tp)
    message = str(info.value)
    assert re.search(rf"\b{tp}\b", message) and re.search(rf"\b{other}\b", message), message


# -- gather_from_tp -------------------------------------------------------------------

def test_gather_from_tp_forward_gathers_backward_splits():
    tp, width = 4, 5
    group = SimGroup(LossyNetwork(tp))
    x = torch.randn(tp, 3, width, dtype=torch.float64, requires_grad=True)
    y = gather_from_tp(x, group, "test.gather")
    assert y.shape == (tp, 3, tp * width)
    whole = torch.cat(x.detach().unbind(0), dim=-1)
    for r in range(tp):
        assert torch.equal(y[r].detach(), whole)
    upstream = torch.randn_like(y)
    y.backward(upstream)
    for r in range(tp):
        assert torch.equal(x.grad[r], upstream[r, ..., r * width:(r + 1) * width])
    # (No gradcheck: Megatron's split backward keeps only each rank's own slice on purpose; the
    # stacked ranks' cross terms are the other ranks' copies of the same gradient.)
    # Column-parallel matmul -> gather -> every rank's copy of a loss: the shards' gradients are the
    # full matmul's, neither lost nor counted tp_size times.
    inp = torch.randn(6, 7, dtype=torch.float64)
    full_w = torch.randn(7, tp * width, dtype=torch.float64, requires_grad=True)
    target = torch.randn(6, tp * width, dtype=torch.float64)
    ((inp @ full_w - target) ** 2).sum().backward()
    shards = full_w.detach().reshape(7, tp, width).permute(1, 0, 2).clone().requires_grad_(True)
    gathered = gather_from_tp(inp.expand(tp, 6, 7) @ shards, group, "test.gather")
    for r in range(tp):
        assert torch.allclose(gathered[r], inp @ full_w.detach())
    ((gathered - target) ** 2).flatten(1).sum(1).sum().backward()
    expected = full_w.grad.reshape(7, tp, width).permute(1, 0, 2)
    assert torch.allclose(shards.grad, expected, rtol=1e-12, atol=1e-12)
    rows = group.network.stats()
    assert {(row["site"], row["direction"]) for row in rows} == {("test.gather", "fwd")}
    assert all(row["calls"] == 2 for row in rows)
    # Under loss, a lost packet of a peer's shard arrives as zeros, never rescaled.
    for spec, recovery in (("bernoulli:1", "zero"), ("bernoulli:0.5", "rescale")):
        lossy = SimGroup(LossyNetwork(tp, spec, seed=2, recovery=recovery, payload_bytes=16))
        out = gather_from_tp(x, lossy, "test.gather").detach()
        for r in range(tp):
            blocks = out[r].split(width, dim=-1)
            assert torch.equal(blocks[r], x[r].detach())
            for s in range(tp):
                if s != r:
                    kept = blocks[s] == x[s].detach()
                    assert (kept | (blocks[s] == 0)).all()
                    if spec == "bernoulli:1":
                        assert not kept.any()


# -- gradients of replicated and sharded parameters ----------------------------------

def test_replicated_gradients_are_the_mean_of_the_ranks():
    tp = 4
    ref = build("cls")
    tpm = parallelize(copy.deepcopy(ref), tp, LossyNetwork(tp, "bernoulli:0.2", seed=6))
    captured = {}
    tpm.model.transformer.ln_f.register_forward_hook(
        lambda module, args, output: captured.__setitem__("x", args[0].detach().clone()))
    batch = make_batch("cls")
    logits, _ = tp_step(tpm, "cls", batch)
    x = captured["x"].reshape(tp, BATCH, SEQ, -1)
    # Each rank's own gradient of the replicated head, computed outside the TP machinery.
    last = batch["attention_mask"].sum(1) - 1  # right padding: HF pools the last non-pad token
    per_rank = []
    for r in range(tp):
        ln_f, score = copy.deepcopy(ref.transformer.ln_f), copy.deepcopy(ref.score)
        pooled = score(ln_f(x[r]))[torch.arange(BATCH), last]
        assert rel_err(pooled.detach(), logits[r]) <= 1e-6
        F.cross_entropy(pooled, batch["labels"]).backward()
        per_rank.append({"transformer.ln_f.weight": ln_f.weight.grad, "transformer.ln_f.bias": ln_f.bias.grad,
                         "score.weight": score.weight.grad})
    tp_grads = grads(tpm)
    for name in per_rank[0]:
        stacked = torch.stack([g[name] for g in per_rank])
        assert rel_err(stacked[1], stacked[0]) > 1e-3, name  # loss made the ranks' gradients differ
        assert rel_err(tp_grads[name], stacked.mean(0)) <= 1e-6, name
        assert rel_err(tp_grads[name], stacked[0]) > 1e-4, name
    assert all(torch.isfinite(g).all() for g in tp_grads.values())


def test_sharded_parameters_get_their_own_ranks_gradient():
    """Per-rank backward passes: the last row-parallel shard r is reached by rank r's loss only,
    and sharded gradients are not averaged (unlike replicated ones)."""
    tp = 4
    ref = build("cls")
    tpm = parallelize(copy.deepcopy(ref), tp, LossyNetwork(tp, "bernoulli:0.2", seed=6, lossy=("fwd",)))
    tpm(**make_batch("cls"))
    sharded = sharded_names(tpm)
    assert sharded and all(tpm.model.get_parameter(n).shape[0] == tp for n in sharded)
    per_rank = []
    for r in range(tp):
        tpm.zero_grad(set_to_none=True)
        tpm.rank_losses[r].backward(retain_graph=True)
        per_rank.append(grads(tpm))
    tpm.zero_grad(set_to_none=True)
    tpm.rank_losses.sum().backward()
    total = grads(tpm)
    last = "transformer.h.1.mlp.c_proj.weight"
    for r in range(tp):
        for s in range(tp):
            assert (per_rank[r][last][s].abs().sum() > 0) == (r == s), (r, s)
        assert torch.equal(total[last][r], per_rank[r][last][r])
    for name in total:
        assert rel_err(total[name], sum(g[name] for g in per_rank)) <= TOL, name
