"""Per-architecture tensor-parallel plans: what ``parallelize`` does to each HF model family, as data.

A plan names, inside every block of the model, where activations enter the
tensor-parallel region (a ``copy`` site on a module's input), which linear
layers are column-parallel (split by outputs, by heads for attention), which
are row-parallel (a ``reduce`` site on their output, any bias added once after
it), which dropouts sit in the replicated region, and which attributes of the
attention module count heads, so HF's own attention forward runs unchanged on
each rank's heads. Everything a plan does not name stays replicated. Call sites
are ``{blocks}.{i}.{site}``: GPT-2's ``h.3.attn.copy``, Llama's
``layers.3.self_attn.copy``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union



@dataclass(frozen=True)
class Column:
    """Split along the outputs. ``heads``: "query" or "kv" (outputs are whole heads; kv heads may be
    held by several ranks under grouped-query attention), None for a plain width; ``packed``: packed
    output blocks split alike (GPT-2's Q|K|V is 3)."""
    heads: Optional[str] = None
    packed: int = 1


@dataclass(frozen=True)
class Row:
    """Split along the inputs; the partial outputs are all-reduced at call site ``site``."""
    site: str


@dataclass(frozen=True)
class ShardingPlan:
    """How one architecture is sharded (paths are relative to the base model or to one block)."""
    name: str
    classes: dict  # HF class name -> "model" (no head), "lm" or "cls" (names: no model family is imported)
    blocks: str  # the ModuleList of blocks
    final_norm: str  # whose output is ``rank_hidden``
    attention: str  # the attention module in a block
    inputs: dict  # module in a block -> the copy site on its input
    layers: dict[str, Union[Column, Row]]  # linear layer in a block -> its split
    local: dict  # attention attribute -> "heads" | "kv_heads" | "groups" | "width" (per-rank values)
    heads: str = "num_attention_heads"  # config attribute
    kv_heads: Optional[str] = None  # config attribute; None: as many as query heads
    dropouts: dict = field(default_factory=dict)  # module -> config attribute of its p (in a block)
    base_dropouts: dict = field(default_factory=dict)  # the same, in the base model
    check: Optional[Callable] = None  # config -> an error message for what the plan cannot shard


def _gpt2_check(config) -> Optional[str]:
    if getattr(config, "add_cross_attention", False):
        return "cross-attention GPT-2 is not supported"
    if config.reorder_and_upcast_attn and config._attn_implementation == "eager":
        return "reorder_and_upcast_attn is not supported; use the default attention"
    return None


GPT2 = ShardingPlan(
    name="gpt2",
    classes={"GPT2Model": "model", "GPT2LMHeadModel": "lm", "GPT2ForSequenceClassification": "cls"},
    blocks="h", final_norm="ln_f", attention="attn",
    inputs={"attn": "attn.copy", "mlp": "mlp.copy"},
    layers={"attn.c_attn": Column(heads="query", packed=3), "attn.c_proj": Row("attn.reduce"),
            "mlp.c_fc": Column(), "mlp.c_proj": Row("mlp.reduce")},
    local={"num_heads": "heads", "split_size": "width"},
    heads="n_head",
    dropouts={"attn.resid_dropout": "resid_pdrop", "mlp.dropout": "resid_pdrop"},
    base_dropouts={"drop": "embd_pdrop"},
    check=_gpt2_check,
)

# Llama, Qwen2 (biases on q/k/v) and Mistral (sliding window) share one block layout.
_LLAMA_LAYOUT = dict(
    blocks="layers", final_norm="norm", attention="self_attn",
    inputs={"self_attn": "self_attn.copy", "mlp": "mlp.copy"},
    layers={"self_attn.q_proj": Column(heads="query"), "self_attn.k_proj": Column(heads="kv"),
            "self_attn.v_proj": Column(heads="kv"), "self_attn.o_proj": Row("self_attn.reduce"),
            "mlp.gate_proj": Column(), "mlp.up_proj": Column(), "mlp.down_proj": Row("mlp.reduce")},
    local={"num_key_value_groups": "groups"},
    kv_heads="num_key_value_heads",
)
def _classes(family: str) -> dict:
    """HF's three classes of a family: no head, causal LM, sequence classification."""
    return {f"{family}Model": "model", f"{family}ForCausalLM": "lm", f"{family}ForSequenceClassification": "cls"}


LLAMA = ShardingPlan(name="llama", classes=_classes("Llama"), **_LLAMA_LAYOUT)
QWEN2 = ShardingPlan(name="qwen2", classes=_classes("Qwen2"), **_LLAMA_LAYOUT)
MISTRAL = ShardingPlan(name="mistral", classes=_classes("Mistral"), **_LLAMA_LAYOUT)

PLANS = (GPT2, LLAMA, QWEN2, MISTRAL)


def plan_for(model) -> tuple[ShardingPlan, str]:
    """(plan, head kind) of an HF model instance (its class or a base class named in a plan), or a
    TypeError naming the supported classes."""
    for cls in type(model).__mro__:
        for plan in PLANS:
            if cls.__name__ in plan.classes:
                return plan, plan.classes[cls.__name__]
    names = ", ".join(name for plan in PLANS for name in plan.classes)
    raise TypeError(f"parallelize supports {names}, not {type(model).__name__}")
