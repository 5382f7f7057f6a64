"""Sparse upcycling (Komatsuzaki et al., 2022): a pretrained dense Llama-family causal LM turned into a
Mixtral-style mixture of experts, each MLP copied into every expert beside a fresh router.

A model name ``upcycled:<base>:<experts>`` (``upcycled:smollm2-135m:4``) builds it from ``<base>``
(any name ``build_model`` loads: a packaged model, a local directory). Routing is top-1: Mixtral's
router renormalises the chosen weights, so one expert's weight is exactly 1 and, every expert being
the same MLP, the upcycled model computes what the dense one does (a test holds it to that) until
training moves the experts apart. The router starts from N(0, ``ROUTER_STD``) at the run's seed:
near-uniform, so tokens spread over every expert and its expert-parallel rank from the first step.
"""
from __future__ import annotations

import torch

PREFIX = "upcycled:"
ROUTER_STD = 0.02   # the dense model's own initializer_range: a router no stronger than its layers' init


def parse(name: str) -> tuple[str, int]:
    """``upcycled:<base>:<experts>`` -> (base, experts); a one-line ValueError otherwise."""
    body = name[len(PREFIX):]
    base, _, experts = body.rpartition(":")
    if not base or not experts.isdigit() or int(experts) < 2:
        raise ValueError(f"model {name!r} must read upcycled:<base model>:<experts >= 2>, "
                         "e.g. upcycled:smollm2-135m:4")
    return base, int(experts)


def is_upcycled(name: str) -> bool:
    return str(name).startswith(PREFIX)


def base(name: str) -> str:
    """The dense model an upcycled name starts from (its weights, tokenizer and positions); else ``name``."""
    return parse(name)[0] if is_upcycled(name) else name


def mixtral_config(dense, experts: int):
    """The dense model's ``LlamaConfig`` as a ``MixtralConfig`` with ``experts`` experts of its MLP's width, top-1."""
    from transformers import MixtralConfig  # here: resolving a name (``base``) needs no modeling code
    if dense.model_type != "llama" or getattr(dense, "mlp_bias", False) or getattr(dense, "attention_bias", False):
        raise ValueError(f"upcycling needs a Llama-family model without biases (got {dense.model_type})")
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings", "rope_parameters", "attention_dropout", "pad_token_id", "bos_token_id",
            "eos_token_id", "initializer_range", "num_labels")
    config = MixtralConfig(**{key: getattr(dense, key) for key in keep if hasattr(dense, key)},
                           num_local_experts=experts, num_experts_per_tok=1, sliding_window=None,
                           router_jitter_noise=0.0, output_router_logits=False)
    config._attn_implementation = dense._attn_implementation
    return config


@torch.no_grad()
def upcycle(dense, experts: int, seed: int = 0):
    """A ``MixtralForCausalLM`` computing what the Llama ``dense`` computes: its weights, each MLP copied into
    ``experts`` experts."""
    from transformers import MixtralForCausalLM
    config = mixtral_config(dense.config, experts)
    moe = MixtralForCausalLM(config).to(next(dense.parameters()).dtype)
    state = dense.state_dict()
    missing, unexpected = moe.load_state_dict(
        {k: v for k, v in state.items() if ".mlp." not in k}, strict=False)
    generator = torch.Generator().manual_seed(seed)
    for index, (layer, source) in enumerate(zip(moe.model.layers, dense.model.layers)):
        mlp = source.mlp
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0)
        layer.mlp.experts.gate_up_proj.copy_(gate_up.expand(experts, *gate_up.shape))
        layer.mlp.experts.down_proj.copy_(mlp.down_proj.weight.expand(experts, *mlp.down_proj.weight.shape))
        router = layer.mlp.gate.weight
        router.copy_(torch.randn(router.shape, generator=generator, dtype=torch.float64).to(router.dtype) * ROUTER_STD)
    left = [k for k in missing if ".mlp." not in k and not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if left or unexpected:
        raise ValueError(f"upcycling left weights unmatched: {(left + list(unexpected))[:3]}")
    if config.tie_word_embeddings:
        moe.tie_weights()
    return moe
