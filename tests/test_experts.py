"""Expert parallelism on the tiny Mixtral-like MoE (``tiny-moe``) and the synthetic task: loss-free, every
replica's logits, loss and gradients are the unsharded HF model's on its shard of the batch (its experts'
gradients after their expert-data-parallel average); under loss, dispatch and combine packets are lost at
the configured rate where the mesh puts their groups, and what a lost packet means is checked row by row.
(``dist`` against ``sim`` and resume: tests/test_experts_dist.py.)"""
from __future__ import annotations

import pytest
import torch
from scipy import stats

from lossysim.data import train_batches
from lossysim.ep import ExpertParallel
from lossysim.models import build_model
from lossysim.run.build import build
from lossysim.tp.layers import ColumnParallel, RowParallel
from safetensors.torch import load_file
from test_data_parallel import GRAD_TOL, tiny
from tiny_runs import assert_train_refuses, train_steps

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("private_cache", "one_torch_thread")
# Logits and losses: the same sums in another order (experts one after another, gate weights after the
# combine, the ranks' rows apart): fp32 rounding.
LOGIT_TOL = dict(rtol=1e-5, atol=1e-6)


def moe(tmp_path, **changes):
    return tiny(tmp_path, **{"model": "tiny-moe", **changes})


def _hf(config, parts):
    """The unsharded HF model as the run built it (the same seed, the same weights)."""
    data = parts.data
    return build_model(config.model, vocab_size=data.vocab_size, pad_token_id=data.pad_token_id,
                       num_labels=data.num_labels, max_length=config.max_length, dropout=config.dropout,
                       seed=config.seed, task=config.task)


def averaged_against_hf(config):
    """One forward and backward of the unsharded HF model on a batch and of every replica on its rows (each
    replica's logits checked against HF's), then the dense buckets' and the experts' averages. Returns the
    parts, the replicas' losses, HF's loss and HF's gradients by name."""
    parts = build(config, CPU, 0, True, None)
    hf = _hf(config, parts)
    batch = next(train_batches(parts.data, 8, 0))
    hf.train()
    out = hf(**batch)
    out.loss.backward()
    rows = 8 // config.dp_size

    def forward_backward(r: int):
        replica = parts.dp.replicas[r].model
        replica.train()
        got = replica(**{k: v[r * rows:(r + 1) * rows] for k, v in batch.items()})
        got.loss.backward()
        return got.logits.detach(), got.loss.detach()
    results = parts.ep.run([lambda r=r: forward_backward(r) for r in range(config.dp_size)])
    for r, (logits, _) in enumerate(results):
        torch.testing.assert_close(logits, out.logits[r * rows:(r + 1) * rows].detach(), **LOGIT_TOL)
    parts.dp.average_gradients()
    parts.ep.average_gradients(parts.dp.replicas)
    return parts, [loss for _, loss in results], out.loss.detach(), {n: p.grad for n, p in hf.named_parameters()}


def assert_gradients_are_hf(parts, hf_grads, expected=None) -> None:
    """Every replica's every parameter holds its part (``expected``: by default ``_expected_grad``) of HF's
    gradient, to GRAD_TOL."""
    expected = expected or _expected_grad
    for replica in parts.dp.replicas:
        for module_name, module in replica.model.model.named_modules():
            for leaf, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{leaf}"
                assert param.grad is not None, name
                torch.testing.assert_close(param.grad, expected(module, name, leaf, hf_grads), **GRAD_TOL, msg=name)


def _expected_grad(module, name: str, leaf: str, hf: dict, tp_rank=None) -> torch.Tensor:
    """What a run's parameter ``name`` (``leaf`` of ``module``) holds of the HF gradient: a TP shard, an
    expert's block, or the whole of it."""
    full = hf[name]
    if isinstance(module, (ColumnParallel, RowParallel)):
        shards = module.shard(leaf, full)
        return full if shards is None else shards
    if isinstance(module, ExpertParallel):
        return full[module.first:module.first + module.per_rank]
    return full


# Qwen3-MoE's architecture at tiny-moe's widths (it has no named shape of its own)
QWEN3_MOE = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64,
                 intermediate_size=96, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                 norm_topk_prob=True, tie_word_embeddings=True)


@pytest.fixture
def qwen3_moe(monkeypatch):
    from transformers import Qwen3MoeForSequenceClassification

    from lossysim.models import build as models_build
    from lossysim.models.shapes import NAMED_SHAPES
    monkeypatch.setitem(NAMED_SHAPES, "tiny-qwen3-moe", ("qwen3_moe", QWEN3_MOE))
    monkeypatch.setitem(models_build._CLASSES["classification"], "qwen3_moe", Qwen3MoeForSequenceClassification)


@pytest.mark.parametrize("model,tp,dp,ep", [
    ("tiny-moe", 2, 2, 1), ("tiny-moe", 1, 2, 2), ("tiny-moe", 2, 2, 2), ("tiny-moe", 1, 4, 4), ("tiny-moe", 1, 4, 2),
    ("tiny-qwen3-moe", 2, 2, 1), ("tiny-qwen3-moe", 2, 4, 2), ("tiny-qwen3-moe", 1, 4, 4),
    ("tiny-deepseek-v3", 2, 2, 1), ("tiny-deepseek-v3", 2, 4, 2), ("tiny-deepseek-v3", 1, 4, 4)])
def test_loss_free_ep_is_the_unsharded_model(model, tp, dp, ep, tmp_path, qwen3_moe):
    """One forward and backward: logits and loss of every replica are HF's on its rows; after the dense
    buckets' average and the experts' (over their expert-data-parallel groups, divided by ep) every
    gradient is HF's on the whole batch (its shard or expert block of it), to GRAD_TOL. Mixtral's,
    Qwen3-MoE's and DeepSeek-V3's (MLA attention by heads, its down-projections summed over TP ranks; a
    dense first block; group-limited routing; a shared expert)."""
    config = moe(tmp_path, model=model, tp_size=tp, dp_size=dp, ep_size=ep)
    parts, losses, hf_loss, hf_grads = averaged_against_hf(config)
    torch.testing.assert_close(torch.stack(losses).mean(), hf_loss, **LOGIT_TOL)
    for replica in parts.dp.replicas:
        experts = [m for m in replica.model.modules() if isinstance(m, ExpertParallel)]
        assert len(experts) == 2 and all(m.per_rank == 8 // ep for m in experts)   # (DeepSeek: 1 dense of 3)
    assert_gradients_are_hf(parts, hf_grads)


def test_dist_equals_sim_under_loss(tmp_path):
    """dp 2 with ep 2 as 2 gloo processes (a real all-to-all per dispatch and combine) against sim,
    Gilbert-Elliott loss on every kind of traffic (dispatch and combine both ways, TP, DP), drop_token,
    the gradient clipped at each step (the experts' squares summed over the ep group), each replica's
    shard in two micro-batches, evaluation through the experts: bit for bit (``assert_dist_is_sim``). (tp 2 x
    dp 2 on 4 processes holds too; it takes twice as long.)"""
    from test_data_parallel import assert_dist_is_sim, sim_and_dist
    rows, weights = sim_and_dist(tmp_path, model="tiny-moe", tp_size=1, dp_size=2, ep_size=2,
                                 loss="ge:rate=0.05,burst=4", recovery="drop_token", grad_clip=0.1, steps=4,
                                 eval_every=4, microbatches=2)
    assert_dist_is_sim(rows, weights)
    last = [r for r in rows["sim"] if r["split"] == "train"][-1]
    assert last["packets_lost_ep_dispatch"] > 0 and last["packets_lost_ep_combine"] > 0 and last["drift"] > 0


def test_resume_is_exact(tmp_path):
    """A run resumed from its step-2 checkpoint ends as the uninterrupted one: metrics, summary, exported
    weights (every expert gathered) and the last checkpoint (every replica, every ep group's networks) bit
    for bit."""
    from test_resume import assert_resumes_exactly
    settings = dict(dp_size=2, ep_size=2, loss="ge:rate=0.05,burst=4", checkpoint_every=2, keep_checkpoints=0,
                    save_checkpoint=True, steps=4, eval_every=2, log_every=1)
    summary = assert_resumes_exactly(moe(tmp_path / "reference", **settings), tmp_path / "resumed")
    assert summary["expert_parallel"]["packets_lost_ep_dispatch"] > 0
    exported = load_file(tmp_path / "resumed" / "checkpoint" / "model.safetensors")
    # every expert gathered (transformers writes Mixtral's published layout: one tensor per expert)
    assert {k.split(".")[5] for k in exported if k.startswith("model.layers.0.block_sparse_moe.experts.")} == \
        {str(e) for e in range(8)}


def test_dispatch_and_combine_lose_at_the_configured_rate_where_the_mesh_puts_them(tmp_path):
    """ep 4 over two nodes (two replicas to a node), loss on inter-node links, only dispatch (both ways) and
    combine's forward lossy: those lose at 5% between nodes (binomial tests, every packet a trial), nothing
    inside a node; combine's gradients and the dense data-parallel buckets lose nothing."""
    p = 0.05
    config = moe(tmp_path, dp_size=4, ep_size=4, ranks_per_node=2, lossy_links="inter_node", loss=f"bernoulli:{p}",
                 lossy_traffic="ep_dispatch,ep_dispatch_backward,ep_combine")
    parts, _, _ = train_steps(config, 2)
    summaries = parts.ep.summaries(by=("direction", "link_class"))
    lossy = {("ep_dispatch", "fwd"), ("ep_dispatch", "bwd"), ("ep_combine", "fwd")}
    for name, rows in summaries.items():
        for row in rows:
            assert row["sent"] > 0
            if (name, row["direction"]) in lossy and row["link_class"] == "inter":
                assert stats.binomtest(row["lost"], row["sent"], p).pvalue > 1e-3, (name, row)
            else:
                assert row["lost"] == 0, (name, row)
    assert {(n, r["direction"], r["link_class"]) for n, rows in summaries.items() for r in rows} >= \
        {(n, d, c) for n, d in lossy for c in ("intra", "inter")}
    assert all(n.totals()["lost"] == 0 and n.totals()["sent"] > 0 for n in parts.dp.networks)


@pytest.mark.parametrize("recovery", ["drop_token", "zero"])
def test_a_lost_dispatch_packet_skips_the_token_at_its_expert_under_drop_token(recovery, tmp_path):
    """Block 0's experts at 10% loss on dispatch and combine: under drop_token every token gets the weighted
    outputs of a subset of its experts (a lost row is a token the expert skipped, as one over its capacity:
    gate weight's share gone, the others kept), some tokens fewer than all; under zero some token gets
    something else (a hole in a row the expert computed on, or in its output)."""
    config = moe(tmp_path, dp_size=2, ep_size=2, ranks_per_node=1, loss="bernoulli:0.1", recovery=recovery,
                 lossy_traffic="ep_dispatch,ep_combine")
    parts = build(config, CPU, 0, True, None)
    seen = []
    for replica in parts.dp.replicas:
        block = replica.model.model.model.layers[0].mlp.experts
        block.register_forward_hook(lambda m, args, out: seen.append((args, out.detach())))
    batch = next(train_batches(parts.data, 8, 0))
    parts.ep.run([lambda r=r: parts.dp.replicas[r].model(**{k: v[r * 4:(r + 1) * 4] for k, v in batch.items()})
                  for r in range(2)])
    block = parts.dp.replicas[0].model.model.model.layers[0].mlp.experts
    weights = block.gathered()
    fewer = other = 0
    for (x, index, gate), out in seen[:2]:
        gate_up = torch.stack([weights["gate_up_proj"][e] for e in index.reshape(-1)]).view(*index.shape, -1, x.shape[-1])
        h = torch.einsum("tkoh,th->tko", gate_up, x)
        a, b = h.chunk(2, -1)
        down = torch.stack([weights["down_proj"][e] for e in index.reshape(-1)]).view(*index.shape, x.shape[-1], -1)
        y = torch.einsum("tkhi,tki->tkh", down, block.act_fn(a) * b) * gate.unsqueeze(-1)   # [tokens, k, hidden]
        subsets = torch.stack([y[:, 0] + y[:, 1], y[:, 0], y[:, 1], torch.zeros_like(y[:, 0])], 1)
        error = (subsets - out.unsqueeze(1)).abs().amax(-1)                                   # [tokens, 4]
        best = error.min(1)
        matched = best.values <= 1e-5 * out.abs().amax().clamp_min(1)
        fewer += int((matched & (best.indices > 0)).sum())
        other += int((~matched).sum())
    if recovery == "drop_token":
        assert other == 0 and fewer > 0
    else:
        assert other > 0


@pytest.mark.parametrize("settings, message", [
    (["--dp-size", "2", "--ep-size", "2"], "ep_size=2 needs a mixture-of-experts model"),
    (["--model", "tiny-moe", "--dp-size", "2", "--ep-size", "4"], "ep_size=4 must divide dp_size x cp_size = 2"),
    (["--model", "tiny-moe", "--recovery", "drop_token"],
     "ep_size=1: recovery=drop_token acts on all-to-alls only (elsewhere it is zero), and the run has none"),
    (["--model", "tiny-moe", "--dp-size", "2", "--ep-size", "2", "--recovery", "rescale"],
     "ep_size=2: recovery=rescale does not act on all-to-alls: use one of zero, drop_token"),
    (["--model", "tiny-moe", "--ep-size", "2", "--cp-size", "4", "--set", "max_length=32"],
     "ep_size=2 with cp_size=4: experts beside context parallelism need ep_size a multiple of cp_size"),
])
def test_bad_expert_settings_are_one_line_and_exit_2(settings, message, tmp_path, capsys):
    assert_train_refuses(settings, message, tmp_path / "o", capsys)
