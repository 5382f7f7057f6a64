"""Shared helpers for the tensor-parallel tests, and the worker of the ``dist`` tests.

Not collected by pytest (no ``test_`` prefix). The ``dist`` worker runs in
processes started by ``torch.multiprocessing.spawn``: it rebuilds the same tiny
models from the same seeds as the test process, runs them tensor-parallel on
gloo (one rank per process) and ``torch.save``s what it saw, one file per rank;
the test process computes the references (HF, ``sim``) and compares.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
from transformers import (GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, GPT2Model, LlamaConfig,
                          LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel, MistralConfig,
                          MistralForCausalLM, MistralForSequenceClassification, MistralModel, Qwen2Config,
                          Qwen2ForCausalLM, Qwen2ForSequenceClassification, Qwen2Model)

from lossysim import LossyNetwork, gather_full_model, parallelize
from lossysim.tp.layers import ColumnParallel, RowParallel

CLASSES = {"model": GPT2Model, "lm": GPT2LMHeadModel, "cls": GPT2ForSequenceClassification}
# The Llama family: (config class, family-specific settings, classes by kind). 8 query heads.
FAMILIES = {
    # Llama with every optional bias on: o_proj's and down_proj's must be added once, after the reduction.
    "llama": (LlamaConfig, dict(attention_bias=True, mlp_bias=True),
              {"model": LlamaModel, "lm": LlamaForCausalLM, "cls": LlamaForSequenceClassification}),
    "qwen2": (Qwen2Config, {},  # biases on q/k/v, none on o_proj
              {"model": Qwen2Model, "lm": Qwen2ForCausalLM, "cls": Qwen2ForSequenceClassification}),
    "mistral": (MistralConfig, dict(sliding_window=4),  # a window shorter than the batch's sequences
                {"model": MistralModel, "lm": MistralForCausalLM, "cls": MistralForSequenceClassification}),
}
ATTENTION = ("sdpa", "eager")
# Loss-free TP against HF, per tensor: the all-reduce sums partial products in another order than
# HF's single matmul, so bitwise equality is not expected.
TOL = 1e-5
# The loss-free exactness cases, (family, kind, attention, tp, kv heads), one list for every family.
# GPT-2: 4 heads. The Llama family: 8 query heads with 8 (MHA), 2 or 1 kv heads, so tp 2 splits 2 kv
# heads and tp 4 and 8 give ranks copies of one; Qwen2 and Mistral differ from Llama in biases and
# the sliding window only, so fewer cases.
EXACT_CASES = (
    [("gpt2", kind, attn, tp, None) for kind in ("model", "lm", "cls") for attn in ATTENTION for tp in (1, 2, 4)]
    + [("llama", kind, attn, tp, kv) for kind in ("model", "lm", "cls") for attn in ATTENTION
       for tp in (1, 2, 4, 8) for kv in (8, 2)]
    + [(family, kind, attn, tp, kv) for family in ("qwen2", "mistral") for kind in ("lm", "cls")
       for attn in ATTENTION for tp, kv in ((2, 2), (4, 2), (8, 1))])
VOCAB, PAD, BOS, EOS = 100, 0, 1, 2
BATCH, SEQ = 3, 10
LOSSY_SPECS = {"bernoulli": "bernoulli:0.2", "ge": "ge:rate=0.2,burst=3"}
# Beside the default (ring, drop): every other algorithm, and the transports that repair.
ALGORITHM_CASES = [{"algorithm": "tree"}, {"algorithm": "direct"}, {"transport": "deadline"},
                   {"transport": "retransmit"}]
# The recovery policies beside zero and rescale, each through every algorithm (block: the tiny
# model's messages hold a few blocks and a remainder).
POLICY_CASES = ("hadamard", "hadamard+rescale", "stale", "error_feedback", "outliers", "outliers+hadamard")
POLICY_BLOCK = 64
# (kind, attention, kv heads) of the dist Llama checks: 1 kv head gives both ranks a copy.
LLAMA_DIST_CASES = (("cls", "sdpa", 1), ("cls", "eager", 1), ("lm", "sdpa", 2))


def tiny_config(attn: str = "sdpa", dropout: float = 0.0, **overrides) -> GPT2Config:
    kwargs = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=32,
                  bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, num_labels=3,
                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    kwargs.update(overrides)
    config = GPT2Config(**kwargs)
    config._attn_implementation = attn
    return config


def llama_config(family: str = "llama", attn: str = "sdpa", kv_heads: int = 2, dropout: float = 0.0,
                 **overrides):
    config_class, specific, _ = FAMILIES[family]
    kwargs = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=kv_heads, vocab_size=VOCAB, max_position_embeddings=32,
                  bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, num_labels=3,
                  tie_word_embeddings=False, attention_dropout=dropout, **specific)
    kwargs.update(overrides)
    config = config_class(**kwargs)
    config._attn_implementation = attn
    return config


def build(kind: str, attn: str = "sdpa", dropout: float = 0.0, seed: int = 1, family: str = "gpt2",
          **overrides):
    """The same randomly initialised HF model in every process (GPT-2, or a Llama-family ``family``)."""
    torch.manual_seed(seed)
    if family == "gpt2":
        model = CLASSES[kind](tiny_config(attn, dropout, **overrides))
    else:
        model = FAMILIES[family][2][kind](llama_config(family, attn, dropout=dropout, **overrides))
    # HF initialises biases to 0 and layer norms to (1, 0): perturb every parameter, or a bias
    # added on the wrong side of an all-reduce (summed tp_size times) would go unnoticed.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def make_batch(kind: str, seed: int = 2) -> dict:
    """A right-padded batch (lengths 7, 10, 4) with its attention mask and labels."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    lengths = torch.tensor([7, SEQ, 4])
    mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, PAD)
    batch = {"input_ids": ids, "attention_mask": mask}
    if kind == "lm":
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    elif kind == "cls":
        batch["labels"] = torch.tensor([0, 2, 1])
    return batch


def _probe(width: int) -> torch.Tensor:
    """Fixed weights turning a GPT2Model's hidden states into a scalar to backpropagate."""
    return torch.randn(BATCH, SEQ, width, generator=torch.Generator().manual_seed(3))


def hf_step(model, kind: str, batch: dict):
    """Forward + backward of an unmodified HF model: (output, loss)."""
    out = model(**batch)
    if kind == "model":
        output = out.last_hidden_state
        loss = (output * _probe(output.shape[-1])).sum()
    else:
        output, loss = out.logits, out.loss
    loss.backward()
    return output.detach(), loss.detach()


def tp_step(tpm, kind: str, batch: dict):
    """Forward + backward of a TensorParallelModel: (rank_logits, rank_losses), each rank on its own loss."""
    out = tpm(**batch)
    if kind == "model":
        # Every local rank backpropagates its own scalar, as each Megatron rank does.
        rank_losses = (tpm.rank_logits * _probe(tpm.rank_logits.shape[-1])).flatten(1).sum(1)
        rank_losses.sum().backward()
    else:
        rank_losses = tpm.rank_losses
        out.loss.backward()
    return tpm.rank_logits.detach().clone(), rank_losses.detach().clone()


def inputs(batch: dict) -> dict:
    """A batch without its labels: what a forward-only call takes."""
    return {k: v for k, v in batch.items() if k != "labels"}


def assert_matches_hf(ref, tpm, kind: str, tp: int) -> None:
    """One forward and backward of ``ref`` (HF) and of ``tpm`` (its TP copy) on the same batch: every
    rank's outputs and loss, and every gradient in TP layout, within TOL of HF's; no gradient is 0."""
    batch = make_batch(kind)
    out, loss = hf_step(ref, kind, batch)
    rank_logits, rank_losses = tp_step(tpm, kind, batch)
    assert rank_logits.shape == (tp, *out.shape)
    for r in range(tp):
        assert rel_err(rank_logits[r], out) <= TOL, r
        assert rel_err(rank_losses[r], loss) <= TOL, r
    ref_grads, tp_grads = grads(ref), grads(tpm)
    assert tp_grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        assert grad.norm() > 0, name
        assert rel_err(tp_grads[name], tp_layout(tpm, name, grad)) <= TOL, name


def tp_layout(tpm, name: str, full: torch.Tensor, ranks=None) -> torch.Tensor:
    """A full HF tensor (parameter or gradient) cut as the TP model stores ``name`` for ``ranks``
    (default: its local ranks)."""
    module_name, leaf = name.rsplit(".", 1)
    module = tpm.model.get_submodule(module_name)
    ranks = tpm.group.ranks if ranks is None else list(ranks)
    if isinstance(module, (ColumnParallel, RowParallel)):
        cut = module.shard(leaf, full)
        if cut is not None:
            return cut[ranks]
    return full


def grads(model) -> dict:
    """name -> gradient (as stored: TP layout for a TP model), for every parameter."""
    module = model.model if hasattr(model, "group") else model
    return {name: p.grad.detach().clone() for name, p in module.named_parameters()}


def params(model) -> dict:
    module = model.model if hasattr(model, "group") else model
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def sharded_names(tpm) -> set:
    ids = {id(p) for p in tpm.sharded_parameters()}
    return {name for name, p in tpm.model.named_parameters() if id(p) in ids}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both are zero)."""
    a, b = a.double(), b.double()
    scale = b.norm().item()
    diff = (a - b).norm().item()
    return diff / scale if scale > 0 else diff


# -- the dist worker ---------------------------------------------------------------

def lossy_network(spec: str, tp: int = 2, seed: int = 8, **kwargs) -> LossyNetwork:
    return LossyNetwork(tp, spec, seed=seed, **kwargs)


def lossy_run(tpm, batch: dict, steps: int = 2) -> list:
    """``steps`` forward/backward passes (streams and chains advance between them)."""
    results = []
    for _ in range(steps):
        tpm.zero_grad(set_to_none=True)
        logits, losses = tp_step(tpm, "cls", batch)
        results.append({"logits": logits, "losses": losses, "grads": grads(tpm)})
    return results


def two_steps(network: LossyNetwork, recompute: bool = False) -> tuple:
    """Two training steps of the tiny TP GPT-2 classifier over ``network`` (with activation
    checkpointing if ``recompute``): (the two losses, the gradients, the network's stats)."""
    batch = make_batch("cls")
    tpm = parallelize(build("cls"), network.ranks, network)
    if recompute:
        tpm.model.activation_checkpointing_enable({"use_reentrant": False, "context_fn": tpm.group.checkpoint_contexts})
    tpm.train()
    losses = []
    for _ in range(2):
        tpm.zero_grad(set_to_none=True)
        losses.append(tp_step(tpm, "cls", batch)[1])
    return torch.stack(losses), grads(tpm), network.stats()


def dist_worker(rank: int, world: int, out_dir: str) -> None:
    """Every dist check in one process group: results to ``out_dir/rank{rank}.pt``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(out_dir, "init"),
                            rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        results = {}
        # 1. No loss: every model class and attention kernel, against HF in the test process.
        for kind in CLASSES:
            for attn in ATTENTION:
                tpm = parallelize(build(kind, attn), world, backend="dist")
                logits, losses = tp_step(tpm, kind, make_batch(kind))
                results[("exact", kind, attn)] = {"logits": logits, "losses": losses, "grads": grads(tpm),
                                                  "stats": tpm.network.stats()}
        # 2. Dropout on, no loss: both ranks must produce the same outputs.
        for attn in ATTENTION:
            tpm = parallelize(build("cls", attn, dropout=0.1), world, backend="dist", seed=5)
            tpm.train()
            logits, losses = tp_step(tpm, "cls", make_batch("cls"))
            results[("dropout", attn)] = {"logits": logits, "losses": losses}
        # 3. Lossy: the same masks as sim, so the same numbers (two passes each).
        batch = make_batch("cls")
        for name, spec in LOSSY_SPECS.items():
            for recovery in ("zero", "rescale"):
                network = lossy_network(spec, world, recovery=recovery)
                tpm = parallelize(build("cls"), world, network, backend="dist")
                runs = lossy_run(tpm, batch)
                results[("lossy", name, recovery)] = {"runs": runs, "stats": network.stats(),
                                                      "disagreement": tpm.disagreement()}
        # 3b. The other algorithms and the repairing transports: the same masks, deliveries and clock.
        for extra in ALGORITHM_CASES:
            network = lossy_network(LOSSY_SPECS["ge"], world, **extra)
            tpm = parallelize(build("cls"), world, network, backend="dist")
            results[("algorithm", *sorted(extra.items()))] = {"runs": lossy_run(tpm, batch), "stats": network.stats(),
                                                              "clock": network.clock()}
        # 3c. The recovery policies: the same masks, signs and per-send buffers as sim.
        for policy in POLICY_CASES:
            for algorithm in ("ring", "tree", "direct"):
                network = lossy_network(LOSSY_SPECS["ge"], world, recovery=policy, algorithm=algorithm,
                                        hadamard_block=POLICY_BLOCK)
                tpm = parallelize(build("cls"), world, network, backend="dist")
                results[("policy", policy, algorithm)] = {"runs": lossy_run(tpm, batch), "stats": network.stats(),
                                                          "clock": network.clock()}
        # 4. Lossy, replicated gradients left unsynchronised: each rank's own.
        tpm = parallelize(build("cls"), world, lossy_network(LOSSY_SPECS["bernoulli"], world),
                          backend="dist", sync_replicated=False)
        results[("unsynced",)] = lossy_run(tpm, batch, steps=1)[0]
        # 5. Gather over the reliable channel: every rank gets the full model.
        tpm = parallelize(build("lm"), world, backend="dist")
        with torch.no_grad():
            for p in tpm.sharded_parameters():
                p.add_(0.01 * (rank + 1))  # rank-distinct shards
        full = gather_full_model(tpm)
        results[("gather",)] = {"shards": params(tpm), "full": params(full)}
        # 6. Llama: MHA-free cases only (kv heads 1: both ranks hold a copy; 2: split), exact and lossy.
        for kind, attn, kv_heads in LLAMA_DIST_CASES:
            tpm = parallelize(build(kind, attn, family="llama", kv_heads=kv_heads), world, backend="dist")
            logits, losses = tp_step(tpm, kind, make_batch(kind))
            results[("llama-exact", kind, attn, kv_heads)] = {"logits": logits, "losses": losses,
                                                               "grads": grads(tpm)}
        network = lossy_network(LOSSY_SPECS["ge"], world)
        tpm = parallelize(build("cls", family="llama", kv_heads=1), world, network, backend="dist")
        results[("llama-lossy",)] = {"runs": lossy_run(tpm, batch), "stats": network.stats()}
        tpm = parallelize(build("lm", family="llama"), world, backend="dist")
        with torch.no_grad():
            for p in tpm.sharded_parameters():
                p.add_(0.01 * (rank + 1))
        results[("llama-gather",)] = params(gather_full_model(tpm))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
