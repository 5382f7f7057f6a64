"""What one training step of a model costs a GPU: its FLOPs and its kernel launches.

FLOPs: 6 N T for the weights (forward 2, backward 4 per parameter and token) plus attention's
12 L s^2 h per sequence of s tokens (its two matmuls, forward and backward). Kernels: counted, as
the ATen operators one forward, backward and optimizer step dispatches (views launch nothing), on
a narrow copy of the architecture: the same layers and ops, widths of a few elements (a width
changes no kernel count, and the copy runs in milliseconds on a CPU). A kernel launch costs a few
microseconds, so a small model's step is bound by its launches, not its FLOPs
(``lossysim.timing.compute``).
"""
from __future__ import annotations

import copy
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def step_flops(parameters: float, tokens: float, layers: int, hidden: int, seq_len: int) -> float:
    """FLOPs of one training step over ``tokens`` tokens in sequences of ``seq_len``: 6 N T for the
    weights plus 12 L s^2 h per sequence for attention."""
    sequences = tokens / max(seq_len, 1)
    return 6.0 * parameters * tokens + 12.0 * layers * seq_len ** 2 * hidden * sequences


def routed_experts(model: torch.nn.Module) -> dict[int, float]:
    """Each routed expert parameter's id -> the fraction of tokens it multiplies (top-k / experts); the
    other parameters multiply every token."""
    top_k = getattr(model.config, "num_experts_per_tok", None)
    return {id(p): top_k / module.num_experts for module in model.modules()
            if top_k and hasattr(module, "gate_up_proj") and getattr(module, "num_experts", None)
            for p in module.parameters(recurse=False)}


def active_parameters(model: torch.nn.Module, tp_size: int = 1) -> int:
    """The parameters one token's step multiplies: every one, less the routed experts it is not sent to
    (an MoE block's experts times top-k / experts, ``routed_experts``). ``tp_size``: the compute model
    divides a step's FLOPs by it, but every TP rank runs its experts whole (expert-tensor parallelism 1,
    ``lossysim.ep``): their share counts tp_size times."""
    routed = routed_experts(model)
    return int(round(sum(p.numel() * (routed[id(p)] * tp_size if id(p) in routed else 1)
                         for p in model.parameters())))


def dims(config) -> tuple[int, int]:
    """(layers, hidden size) of an HF config."""
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer")
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd")
    return int(layers), int(hidden)


class _Launches(TorchDispatchMode):
    """Counts the operators dispatched to kernels (views and aliases launch none)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def kernels_per_step(model: torch.nn.Module, task: str = "classification") -> int:
    """Kernel launches of one training step (forward, backward, AdamW) of ``model``'s architecture."""
    return _count(type(model), model.config.to_json_string(use_diff=False), task)


def collective_kernels(layers: int, tp_size: int) -> int:
    """Kernel launches a step's tensor-parallel collectives add: 2 all-reduces a block each way."""
    return 4 * layers if tp_size > 1 else 0


@functools.lru_cache(maxsize=32)
def _count(cls, config_json: str, task: str) -> int:
    import json
    config = cls.config_class.from_dict(_narrow(json.loads(config_json)))
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):  # the run's own random streams must not move
        torch.manual_seed(0)
        model = cls(config)
        if model.loss_type is None and task == "lm":
            # GPT2LMHeadModel's name does not say ForCausalLM: transformers warns, then uses that loss anyway.
            model.loss_type = "ForCausalLM"
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        ids = torch.randint(1, config.vocab_size, (2, 8))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        batch["labels"] = ids if task == "lm" else torch.zeros(2, dtype=torch.long)
        launches = _Launches()
        with launches:
            model(**batch).loss.backward()
            optimizer.step()
    return launches.count


def _narrow(values: dict) -> dict:
    """The same architecture (layers, heads, kv heads, activation, tying) with tiny widths."""
    values = copy.deepcopy(values)
    heads = values.get("num_attention_heads") or values.get("n_head") or 1
    kv = values.get("num_key_value_heads") or heads
    width = 4 * heads
    for key, value in (("hidden_size", width), ("n_embd", width), ("intermediate_size", 2 * width),
                       ("n_inner", None), ("head_dim", 4), ("vocab_size", 64), ("max_position_embeddings", 64),
                       ("n_positions", 64), ("moe_intermediate_size", 8), ("q_lora_rank", 8), ("kv_lora_rank", 8),
                       ("qk_nope_head_dim", 4), ("qk_rope_head_dim", 4), ("v_head_dim", 4)):
        if key in values:
            values[key] = value
    values["num_key_value_heads"] = kv if "num_key_value_heads" in values else values.get("num_key_value_heads")
    values.pop("rope_scaling", None)
    if isinstance(values.get("rope_parameters"), dict):
        values["rope_parameters"] = {"rope_type": "default", "rope_theta": values["rope_parameters"].get("rope_theta",
                                                                                                          10000.0)}
    # Special tokens inside the narrowed vocabulary: transformers warns about any outside it.
    values.update(pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return values
