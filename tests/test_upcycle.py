"""Sparse upcycling (``model: upcycled:<base>:<experts>``): a pretrained dense model's MLPs copied into
experts beside a fresh router computes what the dense model computes, and trains sharded by
expert parallelism. The base here is a tiny SmolLM2-shaped Llama saved to a local directory, as a
pretrained model is (weights and tokenizer): the real model is the budget profile's."""
from __future__ import annotations

import pytest
import torch

from lossysim.data import train_batches
from lossysim.models import build_model
from lossysim.models.upcycle import parse, upcycle
from lossysim.run.build import build
from tiny_pretrained import save_tiny_pretrained
from tiny_runs import tiny_run

pytestmark = pytest.mark.usefixtures("private_cache", "one_torch_thread")
CPU = torch.device("cpu")
LOGIT_TOL = dict(rtol=1e-5, atol=1e-6)   # ep's rows apart and the gate after the combine: fp32 rounding


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return save_tiny_pretrained(tmp_path_factory.mktemp("dense"))


def _dense(folder, **kw):
    return build_model(str(folder), vocab_size=kw.get("vocab", 300), pad_token_id=0, num_labels=2,
                       max_length=64, task="lm").eval()


@pytest.mark.parametrize("experts", [2, 4, 8])
def test_the_upcycled_model_computes_the_dense_models_logits(dense_dir, experts):
    """The same function to float32's rounding: every expert's weight is exactly 1 and every expert the
    MLP; what differs is how the products are grouped (Mixtral's fused gate/up projection, one matrix
    product where Llama has two, and its experts' grouped products over their tokens: an ulp apart on
    some elements). A wrong copy (an expert's transposed or swapped half) is off by 1e-1."""
    dense = _dense(dense_dir)
    moe = build_model(f"upcycled:{dense_dir}:{experts}", vocab_size=300, pad_token_id=0, num_labels=2,
                      max_length=64, task="lm").eval()
    assert type(moe).__name__ == "MixtralForCausalLM" and moe.config.num_local_experts == experts
    ids = torch.randint(0, 300, (4, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense(ids).logits, **LOGIT_TOL)


def test_the_router_spreads_tokens_over_every_expert(dense_dir):
    """A near-uniform router at start: each of 4 experts gets a share of 2,000 tokens' first-layer
    routing within a wide band around 1/4 (its share is decided by small random logits)."""
    moe = upcycle(_dense(dense_dir), 4, seed=1)
    ids = torch.randint(0, 300, (20, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = moe.model.embed_tokens(ids).reshape(-1, 48)
        chosen = moe.model.layers[0].mlp.gate(moe.model.layers[0].input_layernorm(hidden))[2].flatten()
    shares = torch.bincount(chosen, minlength=4) / chosen.numel()
    assert shares.min() > 0.05, shares


def test_loss_free_expert_parallel_upcycled_model_is_the_dense_model(dense_dir, tmp_path):
    """ep 2 over dp 2: every replica's logits on its rows are the dense model's (the same base weights), in
    training mode (evaluating, an expert-parallel group routes its first member's tokens alone)."""
    config = tiny_run(tmp_path, model=f"upcycled:{dense_dir}:4", dataset="pydoc", task="lm", tokenizer="auto",
                      max_length=32, batch_size=4, tp_size=1, dp_size=2, ep_size=2, max_train_samples=16, max_eval_samples=8)
    parts = build(config, CPU, 0, True, None)
    dense = _dense(dense_dir, vocab=parts.data.vocab_size)
    batch = {k: v for k, v in next(train_batches(parts.data, 4, 0)).items() if k != "labels"}
    assert batch["input_ids"].shape == (4, 32)
    with torch.no_grad():
        want = dense(**batch).logits

    def forward(r: int):
        with torch.no_grad():
            return parts.dp.replicas[r].model.train()(**{k: v[r * 2:(r + 1) * 2] for k, v in batch.items()}).logits
    for r, logits in enumerate(parts.ep.run([lambda r=r: forward(r) for r in range(2)])):
        torch.testing.assert_close(logits, want[r * 2:(r + 1) * 2], **LOGIT_TOL)


@pytest.mark.parametrize("name", ["upcycled:smollm2-135m", "upcycled:smollm2-135m:1", "upcycled::4",
                                  "upcycled:smollm2-135m:four"])
def test_a_malformed_upcycled_name_is_one_line(name):
    with pytest.raises(ValueError, match="upcycled:<base model>:<experts >= 2>"):
        parse(name)
