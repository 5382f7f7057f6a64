"""A published shape's parameters one by one, as its HF causal LM registers them, from the shape's numbers
alone (``shapes.PUBLISHED``): what DDP's buckets and a pipeline's stages read of the model, without building
it (transformers' modeling code was 3-9 s of a 70B estimate's start-up).

Each parameter is its HF name, its element count, where it sits (embeddings, a block, the final norm, the
head), how the shape's plan splits it (``tp.plans``: column-, row-parallel or replicated) and whether it is a
routed expert's. The order is the model's ``parameters()`` order (a tied head is the embeddings', so not
listed), and ``parallelize`` keeps it: it swaps each planned layer in its own slot. A shape not published
(the runner's, a local config) gets None, and its estimate builds the model on the meta device as before;
tests/test_shape_params.py holds every published shape's list to the meta model's, bucket by bucket.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..tp.parallelize import head_counts
from ..tp.plans import Column, Row
from .shapes import PUBLISHED, Shape


@dataclass(frozen=True)
class Param:
    name: str                 # relative to the base model ("layers.3.mlp.up_proj.weight"), or "lm_head.weight"
    numel: int                # whole, before sharding
    place: str                # "embed" | "block" | "norm" | "head"
    block: int = -1
    split: Optional[Union[Column, Row]] = None   # how the plan splits its layer, None: replicated
    expert: bool = False


def parameters(shape: Shape) -> Optional[list[Param]]:
    """The causal LM's parameters in registration order, None for a shape that is not published."""
    if shape.name not in PUBLISHED:
        return None
    family, values = PUBLISHED[shape.name]
    build = _FAMILIES.get(family)
    if build is None or shape.plan.name != family:
        return None
    built = build(values)
    if built is None:
        return None
    base, blocks, head = built
    plan = shape.plan
    params = [Param(name, numel, "norm" if name.startswith(f"{plan.final_norm}.") else "embed")
              for name, numel in base]
    for i, block in enumerate(blocks):
        for path, numel in block:
            layer, _, leaf = path.rpartition(".")
            split = plan.layers.get(layer)
            if isinstance(split, Row) and leaf == "bias":
                split = None   # a row-parallel layer's bias is added once, whole on every rank
            expert = plan.experts is not None and path.startswith(f"{plan.experts}.")
            params.append(Param(f"{plan.blocks}.{i}.{path}", numel, "block", i, split, expert))
    # the final norm is registered after the blocks (GPT-2's ln_f, Llama's norm)
    params = [p for p in params if p.place != "norm"] + [p for p in params if p.place == "norm"]
    return params + [Param(name, numel, "head") for name, numel in head]


def stage_of(param: Param, layout: tuple[int, ...]) -> int:
    """The pipeline stage holding ``param`` (``pp.stages.parameter_stages``)."""
    if param.place == "block":
        return next(s for s in range(len(layout)) if param.block < sum(layout[:s + 1]))
    return 0 if param.place == "embed" else len(layout) - 1


def stage_parameters(params: list[Param], layout: tuple[int, ...], expert_weight: float = 1.0) -> list[float]:
    """Each stage's parameters, whole, a routed expert's counted ``expert_weight`` times (top-k / experts
    times a scale: ``pp.stages.stage_parameters``)."""
    counts = [0] * len(layout)
    for param in params:
        counts[stage_of(param, layout)] += param.numel * (expert_weight if param.expert else 1)
    return counts


def stage_locals(shape: Shape, params: list[Param], tp: int, layout: tuple[int, ...], skip_experts: bool,
                 dtype: torch.dtype) -> list[tuple[list[torch.Tensor], set[int]]]:
    """Per stage, a TP rank's local gradients as ``dp.buckets.plan_buckets`` reads them (meta tensors:
    [tp, shard] for a sharded one, as ``parallelize`` stores it) and the ids of the sharded; routed experts
    left out when ``skip_experts`` (they are averaged over their own groups)."""
    _, _, kv_parts = head_counts(shape.plan, shape.config, tp)
    stages = [([], set()) for _ in layout]
    for param in params:
        if skip_experts and param.expert:
            continue
        tensors, sharded = stages[stage_of(param, layout)]
        if param.split is None:
            tensors.append(torch.empty(param.numel, device="meta", dtype=dtype, requires_grad=True))
            continue
        parts = kv_parts if isinstance(param.split, Column) and param.split.heads == "kv" else tp
        tensor = torch.empty(tp, param.numel // parts, device="meta", dtype=dtype, requires_grad=True)
        tensors.append(tensor)
        sharded.add(id(tensor))
    return stages


def _head(values: dict, vocab: int, hidden: int) -> list:
    return [] if values.get("tie_word_embeddings", True) else [("lm_head.weight", vocab * hidden)]


def _gpt2(v: dict):
    h, inner, vocab = v["n_embd"], v.get("n_inner") or 4 * v["n_embd"], v["vocab_size"]
    block = [("ln_1.weight", h), ("ln_1.bias", h), ("attn.c_attn.weight", h * 3 * h), ("attn.c_attn.bias", 3 * h),
             ("attn.c_proj.weight", h * h), ("attn.c_proj.bias", h), ("ln_2.weight", h), ("ln_2.bias", h),
             ("mlp.c_fc.weight", h * inner), ("mlp.c_fc.bias", inner), ("mlp.c_proj.weight", inner * h),
             ("mlp.c_proj.bias", h)]
    base = [("wte.weight", vocab * h), ("wpe.weight", v["n_positions"] * h), ("ln_f.weight", h), ("ln_f.bias", h)]
    return base, [block] * v["n_layer"], []   # GPT-2's head is always tied to wte


def _attention(v: dict, bias: bool = False, qk_norm: bool = False) -> list:
    h, heads = v["hidden_size"], v["num_attention_heads"]
    kv, dim = v.get("num_key_value_heads") or heads, v.get("head_dim") or h // heads
    out = []
    for name, width in (("q_proj", heads * dim), ("k_proj", kv * dim), ("v_proj", kv * dim)):
        out += [(f"self_attn.{name}.weight", width * h)] + ([(f"self_attn.{name}.bias", width)] if bias else [])
    out.append(("self_attn.o_proj.weight", h * heads * dim))
    if qk_norm:
        out += [("self_attn.q_norm.weight", dim), ("self_attn.k_norm.weight", dim)]
    return out


def _mlp(prefix: str, h: int, width: int) -> list:
    return [(f"{prefix}.gate_proj.weight", width * h), (f"{prefix}.up_proj.weight", width * h),
            (f"{prefix}.down_proj.weight", h * width)]


def _experts(count: int, h: int, width: int) -> list:
    return [("mlp.experts.gate_up_proj", count * 2 * width * h), ("mlp.experts.down_proj", count * h * width)]


def _norms(h: int) -> list:
    return [("input_layernorm.weight", h), ("post_attention_layernorm.weight", h)]


def _llama_like(v: dict, mlp: list, bias: bool = False, qk_norm: bool = False):
    h, vocab = v["hidden_size"], v["vocab_size"]
    block = _attention(v, bias, qk_norm) + mlp + _norms(h)
    return [("embed_tokens.weight", vocab * h), ("norm.weight", h)], [block] * v["num_hidden_layers"], \
        _head(v, vocab, h)


def _llama(v: dict):
    return _llama_like(v, _mlp("mlp", v["hidden_size"], v["intermediate_size"]))


def _qwen2(v: dict):
    return _llama_like(v, _mlp("mlp", v["hidden_size"], v["intermediate_size"]), bias=True)


def _mixtral(v: dict):
    h, count = v["hidden_size"], v["num_local_experts"]
    return _llama_like(v, [("mlp.gate.weight", count * h)] + _experts(count, h, v["intermediate_size"]))


def _qwen3_moe(v: dict):
    h, count = v["hidden_size"], v["num_experts"]
    if v.get("mlp_only_layers") or v.get("decoder_sparse_step", 1) != 1:
        return None   # dense blocks among the sparse ones: the meta model says where
    return _llama_like(v, _experts(count, h, v["moe_intermediate_size"]) + [("mlp.gate.weight", count * h)],
                       qk_norm=True)


def _deepseek_v3(v: dict):
    h, heads, vocab = v["hidden_size"], v["num_attention_heads"], v["vocab_size"]
    q, kv, rope = v["q_lora_rank"], v["kv_lora_rank"], v["qk_rope_head_dim"]
    nope, dim_v, width = v["qk_nope_head_dim"], v["v_head_dim"], v["moe_intermediate_size"]
    attention = [("self_attn.q_a_proj.weight", q * h), ("self_attn.q_a_layernorm.weight", q),
                 ("self_attn.q_b_proj.weight", heads * (nope + rope) * q),
                 ("self_attn.kv_a_proj_with_mqa.weight", (kv + rope) * h), ("self_attn.kv_a_layernorm.weight", kv),
                 ("self_attn.kv_b_proj.weight", heads * (nope + dim_v) * kv),
                 ("self_attn.o_proj.weight", h * heads * dim_v)]
    count = v["n_routed_experts"]
    dense = attention + _mlp("mlp", h, v["intermediate_size"]) + _norms(h)
    moe = attention + _experts(count, h, width) + [("mlp.gate.weight", count * h)] + \
        _mlp("mlp.shared_experts", h, width * v["n_shared_experts"]) + _norms(h)
    first = v["first_k_dense_replace"]
    blocks = [dense] * first + [moe] * (v["num_hidden_layers"] - first)
    return [("embed_tokens.weight", vocab * h), ("norm.weight", h)], blocks, _head(v, vocab, h)


_FAMILIES = {"gpt2": _gpt2, "llama": _llama, "mistral": _llama, "qwen2": _qwen2, "mixtral": _mixtral,
             "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3}
