"""Model shapes for estimates: published configs shipped as data, local configs, and the runner's shapes.

An estimate needs a model's shape, never its weights: the sharding plan (which sites all-reduce),
the hidden size (every TP message is tokens x hidden), the layers, and the parameter count for the
compute time. The model is built on the meta device, so even 70B costs no memory; a published shape's counts
are kept as data (``shape_counts``) and its parameters one by one derived from its numbers (``shape_params``:
DDP's buckets, a pipeline's stages), so its estimate imports no modeling code.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Optional

import torch

from ..axes import AXES
from ..models import cost
from ..models.shapes import NAMED_SHAPES, named_config
from ..tp.parallelize import head_counts
from ..tp.plans import PLANS, ShardingPlan, plan_for
from .shape_counts import COUNTS, READ

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "high_freq_factor": 4.0,
                "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}

# The published configs (huggingface.co/<org>/<model>/config.json): only what shapes the model.
PUBLISHED = {
    "gpt2": ("gpt2", dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)),
    "gpt2-medium": ("gpt2", dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, n_positions=1024)),
    "gpt2-large": ("gpt2", dict(n_embd=1280, n_layer=36, n_head=20, vocab_size=50257, n_positions=1024)),
    "gpt2-xl": ("gpt2", dict(n_embd=1600, n_layer=48, n_head=25, vocab_size=50257, n_positions=1024)),
    "llama-3.2-1b": ("llama", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                                   num_key_value_heads=8, intermediate_size=8192, head_dim=64, vocab_size=128256,
                                   tie_word_embeddings=True, max_position_embeddings=131072,
                                   rms_norm_eps=1e-5, rope_parameters=_LLAMA3_ROPE)),
    "llama-3.2-3b": ("llama", dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                                   num_key_value_heads=8, intermediate_size=8192, head_dim=128, vocab_size=128256,
                                   tie_word_embeddings=True, max_position_embeddings=131072,
                                   rms_norm_eps=1e-5, rope_parameters=_LLAMA3_ROPE)),
    "llama-3.1-8b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                                   tie_word_embeddings=False, max_position_embeddings=131072,
                                   rms_norm_eps=1e-5, rope_parameters={**_LLAMA3_ROPE, "factor": 8.0})),
    "llama-3.1-70b": ("llama", dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                                    num_key_value_heads=8, intermediate_size=28672, vocab_size=128256,
                                    tie_word_embeddings=False, max_position_embeddings=131072,
                                    rms_norm_eps=1e-5, rope_parameters={**_LLAMA3_ROPE, "factor": 8.0})),
    "llama-3.1-405b": ("llama", dict(hidden_size=16384, num_hidden_layers=126, num_attention_heads=128,
                                     num_key_value_heads=8, intermediate_size=53248, vocab_size=128256,
                                     tie_word_embeddings=False, max_position_embeddings=131072,
                                     rms_norm_eps=1e-5, rope_parameters={**_LLAMA3_ROPE, "factor": 8.0})),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                                 num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                                 tie_word_embeddings=False, max_position_embeddings=131072, rms_norm_eps=1e-6,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "mistral-7b": ("mistral", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                   num_key_value_heads=8, intermediate_size=14336, vocab_size=32000,
                                   tie_word_embeddings=False, max_position_embeddings=32768, rms_norm_eps=1e-5,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Mixtures of experts (transformers' config classes default to the flagship's shape; the figures below are
    # the model cards' config.json, spelled out).
    # mistralai/Mixtral-8x7B-v0.1: 46.7B parameters, 12.9B active (2 of 8 experts a token)
    "mixtral-8x7b": ("mixtral", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                     num_key_value_heads=8, intermediate_size=14336, num_local_experts=8,
                                     num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=32768,
                                     rms_norm_eps=1e-5, tie_word_embeddings=False,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # mistralai/Mixtral-8x22B-Instruct-v0.1: 141B parameters, 39B active
    "mixtral-8x22b": ("mixtral", dict(hidden_size=6144, num_hidden_layers=56, num_attention_heads=48,
                                      num_key_value_heads=8, intermediate_size=16384, num_local_experts=8,
                                      num_experts_per_tok=2, vocab_size=32768, max_position_embeddings=65536,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Qwen/Qwen3-30B-A3B: 30.5B parameters, 3.3B active (8 of 128 experts, each 768 wide)
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                                        num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                                        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                        norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960,
                                        rms_norm_eps=1e-6, tie_word_embeddings=False,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Qwen/Qwen3-235B-A22B: 235B parameters, 22B active
    "qwen3-235b-a22b": ("qwen3_moe", dict(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                                          num_key_value_heads=4, head_dim=128, intermediate_size=12288,
                                          moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8,
                                          norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960,
                                          rms_norm_eps=1e-6, tie_word_embeddings=False,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # deepseek-ai/DeepSeek-V3: 671B parameters, 37B active; MLA attention, the first 3 blocks dense, then 256
    # routed experts (8 a token, from at most 4 of 8 groups) and one shared expert per block
    "deepseek-v3": ("deepseek_v3", dict(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
                                        num_key_value_heads=128, intermediate_size=18432,
                                        moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
                                        num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
                                        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=1536,
                                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                        v_head_dim=128, vocab_size=129280, max_position_embeddings=163840,
                                        rms_norm_eps=1e-6, tie_word_embeddings=False,
                                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                                         "original_max_position_embeddings": 4096,
                                                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                                         "mscale_all_dim": 1.0})),
}
# The config.json fields a shape is made of (Llama's names, GPT-2's): whole numbers >= 1 where present.
SIZE_FIELDS = ("num_hidden_layers", "n_layer", "hidden_size", "n_embd", "num_attention_heads", "n_head",
               "num_key_value_heads", "intermediate_size", "n_inner", "head_dim", "vocab_size",
               "max_position_embeddings", "n_positions")
# The runner's random-weight CPU shapes, so an estimate can be held against a training run.
RUNNER = tuple(NAMED_SHAPES)
NAMES = tuple(PUBLISHED) + RUNNER


@dataclass(frozen=True)
class Experts:
    """A mixture of experts' routed experts: which blocks have them, how many, how many a token goes to,
    and their parameters (every block's, all experts)."""
    blocks: tuple[int, ...]
    count: int
    top_k: int
    parameters: int


@dataclass(frozen=True)
class Shape:
    """What an estimate needs of a model."""
    name: str
    config: "PretrainedConfig"   # or, for a published shape, what of it an estimate reads (``Published``)
    plan: ShardingPlan
    parameters: int      # the whole model's (a causal LM), before sharding
    layers: int
    hidden: int
    kernels: int         # kernel launches of one training step on one rank (``models.cost``)
    active: int = 0      # the parameters a token's step multiplies (a mixture of experts': its experts' alone)
    experts: Optional[Experts] = None

    def meta_model(self):
        """The causal LM on the meta device: transformers' modeling code loads here, and only here."""
        from transformers import AutoModelForCausalLM
        config = self.config.full() if isinstance(self.config, Published) else self.config
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)

    def check_axes(self, config) -> None:
        """A one-line ValueError when an axis's size in ``config`` cannot shard this model (``Axis.fits``)."""
        for axis in AXES:
            if axis.fits is not None:
                axis.fits(self, getattr(config, axis.size))

    def check_tp(self, tp_size: int) -> None:
        """A one-line ValueError when ``tp_size`` cannot shard this model as ``parallelize`` would."""
        head_counts(self.plan, self.config, tp_size)
        width = getattr(self.config, "intermediate_size", None) or getattr(self.config, "n_inner", None) \
            or 4 * self.hidden
        if width % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide the MLP width {width} of {self.name}")

    def check_seq(self, seq: int) -> None:
        """A one-line ValueError when ``seq`` is longer than the model's positions (training refuses
        the same max_length)."""
        if self.name in RUNNER:   # the runner's shapes embed as many positions as training allows
            from ..models import max_positions
            limit = max_positions(self.name)
        else:
            limit = getattr(self.config, "n_positions", None) or getattr(self.config, "max_position_embeddings", None)
        if limit and int(seq) > int(limit):
            raise ValueError(f"seq={seq} exceeds model {self.name!r}'s {limit} positions "
                             f"(n_positions / max_position_embeddings); use --seq <= {limit}")


def config_of(name: str) -> "PretrainedConfig":
    """The HF config of a named shape, a config.json file or a model directory holding one."""
    from transformers import AutoConfig
    if name in PUBLISHED:
        model_type, values = PUBLISHED[name]
        return AutoConfig.for_model(model_type, **values)
    if name in RUNNER:
        return named_config(name)
    path = Path(name)
    if not path.exists():
        raise ValueError(f"unknown model {name!r}: name one of {', '.join(NAMES)}, or a config.json or "
                         "model directory")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"{path} holds no config.json")
    _check_sizes(path / "config.json" if path.is_dir() else path)
    try:
        return AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, TypeError, ArithmeticError, json.JSONDecodeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{path} is not a model config: {first}") from None


def _check_sizes(file: Path) -> None:
    """A one-line ValueError naming the field when a size in ``file`` is not a whole number >= 1
    (transformers divides by some of them, and a negative depth would count negative kernels)."""
    try:
        values = json.loads(file.read_text())
    except (OSError, ValueError):
        return   # AutoConfig says why
    for key in SIZE_FIELDS if isinstance(values, dict) else ():
        value = values.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{file}: {key}={value!r} must be a whole number >= 1")


class Published(SimpleNamespace):
    """What an estimate reads of a published shape's config (``shape_counts.READ``, as its transformers config
    answers them), without loading transformers; ``full()`` is the config itself, for the model."""

    def full(self) -> "PretrainedConfig":
        config = config_of(self._name)
        config._attn_implementation = "sdpa"
        return config


def load(name: str) -> Shape:
    """The Shape of a named model or a local config (ValueError, one line, when it is not one): a published
    shape from its counts kept as data, any other built."""
    if name not in COUNTS:
        config = config_of(name)
        config._attn_implementation = "sdpa"
        return count(name, config)
    kept = COUNTS[name]
    config = Published(_name=name, **kept["config"])
    layers, hidden = cost.dims(config)
    experts = Experts(*kept["experts"]) if kept["experts"] else None
    return Shape(name, config, _plan_named(kept["plan"]), kept["parameters"], layers, hidden, kept["kernels"],
                 kept["active"], experts)


def count(name: str, config: Optional["PretrainedConfig"] = None) -> Shape:
    """The Shape of ``name`` counted on its model, built on the meta device (what ``COUNTS`` keeps)."""
    from transformers import AutoModelForCausalLM
    if config is None:
        config = config_of(name)
        config._attn_implementation = "sdpa"
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as err:
        raise ValueError(f"{name}: {str(err).strip().splitlines()[0]}") from None
    try:
        plan, _ = plan_for(model)
    except TypeError as err:
        raise ValueError(f"{name}: {err}") from None
    layers, hidden = cost.dims(config)
    return Shape(name, config, plan, sum(p.numel() for p in model.parameters()), layers, hidden,
                 _kernels(config, layers), cost.active_parameters(model), _experts(model, plan))


def counted(name: str) -> dict:
    """``COUNTS[name]`` as ``count`` finds it on the model (how shape_counts.py was written, and is checked)."""
    shape = count(name)
    read = (*READ, shape.plan.heads, *([shape.plan.kv_heads] if shape.plan.kv_heads else []),
            *shape.plan.dropouts.values())
    experts = shape.experts
    return {"plan": shape.plan.name, "parameters": shape.parameters, "kernels": shape.kernels, "active": shape.active,
            "experts": None if experts is None else (experts.blocks, experts.count, experts.top_k, experts.parameters),
            "config": {key: getattr(shape.config, key) for key in dict.fromkeys(read) if hasattr(shape.config, key)}}


def _plan_named(name: str) -> ShardingPlan:
    return next(plan for plan in PLANS if plan.name == name)


def _experts(model, plan: ShardingPlan) -> Optional[Experts]:
    """The routed experts of ``model`` (a meta one), None without."""
    if plan.experts is None:
        return None
    parent, _, leaf = plan.experts.rpartition(".")
    found = {i: getattr(block.get_submodule(parent), leaf) for i, block in
             enumerate(model.base_model.get_submodule(plan.blocks)) if hasattr(block.get_submodule(parent), leaf)}
    first = next(iter(found.values()))
    return Experts(tuple(found), int(first.num_experts), int(model.config.num_experts_per_tok),
                   sum(p.numel() for module in found.values() for p in module.parameters()))


def _kernels(config: "PretrainedConfig", layers: int) -> int:
    """Kernel launches of a training step, from copies of one and two blocks: every block launches the
    same kernels, and counting 80 of them takes half a minute (a mixture of experts' copies are its MoE
    blocks: DeepSeek-V3's first dense blocks count as those)."""
    key = "n_layer" if hasattr(config, "n_layer") else "num_hidden_layers"
    from transformers import AutoModelForCausalLM
    counts = []
    for depth in (1, 2):
        values = {**config.to_dict(), key: depth}
        if "first_k_dense_replace" in values:
            values["first_k_dense_replace"] = 0
        values.pop("layer_types", None)  # one entry per layer: rebuilt for the copy's depth
        with torch.device("meta"):
            copy = AutoModelForCausalLM.from_config(type(config).from_dict(values))
        counts.append(cost.kernels_per_step(copy, "lm"))
    return counts[0] + (counts[1] - counts[0]) * (layers - 1)
