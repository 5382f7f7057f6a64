"""Named model shapes, as data: random-weight configurations the runner builds without a download.

Each is a transformers model type and its sizes; ``named_config`` makes the config, so reading the names (a
command's help, an estimate) loads none of transformers."""
from __future__ import annotations

# Random-weight shapes: `tiny` and `tiny-llama` for CPU tests and demos, `small` = GPT-2 124M,
# `llama-1b-shape` = Llama 3.2 1B (grouped-query attention, 32 query and 8 kv heads, tied embeddings),
# `smollm2-135m-shape` = SmolLM2-135M (9 query and 3 kv heads: tp 3 or 9), the pretrained
# `smollm2-135m`'s shape with random weights, to set fresh weights beside trained ones; `tiny-moe` a
# Mixtral-like mixture of experts (8 experts, 2 per token: ep 1, 2, 4 or 8); `tiny-deepseek-v3` DeepSeek-V3's
# architecture (MLA attention, a dense first block, then 8 routed experts in 2 groups, 2 a token from 1 group,
# and a shared expert).
# The vocabulary is the data's tokenizer's.
NAMED_SHAPES = {
    "tiny": ("gpt2", dict(n_layer=2, n_head=4, n_embd=128)),
    "small": ("gpt2", dict(n_layer=12, n_head=12, n_embd=768)),
    "tiny-moe": ("mixtral", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 hidden_size=64, intermediate_size=96, num_local_experts=8,
                                 num_experts_per_tok=2, tie_word_embeddings=True)),
    "tiny-deepseek-v3": ("deepseek_v3", dict(
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, hidden_size=64,
        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "tiny-llama": ("llama", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 hidden_size=128, intermediate_size=352, tie_word_embeddings=True)),
    "llama-1b-shape": ("llama", dict(
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, hidden_size=2048,
        intermediate_size=8192, head_dim=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                         "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192})),
    "smollm2-135m-shape": ("llama", dict(
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
        intermediate_size=1536, head_dim=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
        max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
}


def named_config(name: str, **values):
    """Named shape ``name``'s HF config, ``values`` over its own sizes (transformers loads here)."""
    from transformers import AutoConfig
    model_type, shape = NAMED_SHAPES[name]
    return AutoConfig.for_model(model_type, **{**shape, **values})


# Named shapes size their position table to max_length, up to GPT-2's own 1024 positions.
NAMED_MAX_POSITIONS = 1024
