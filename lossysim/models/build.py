"""The runner's models: named random-weight shapes, or pretrained weights by name or path (a
package-shipped model, see ``pretrained``, included), as a sequence classifier
(``task: classification``) or a causal LM (``task: lm``).

Every model built here is one ``lossysim.tp.plans`` can shard: GPT-2, Llama, Qwen2, Mistral, and the
mixtures of experts Mixtral, Qwen3-MoE and DeepSeek-V3 (their experts sharded by ``lossysim.ep``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          GPT2ForSequenceClassification, GPT2LMHeadModel, LlamaForCausalLM,
                          LlamaForSequenceClassification, MixtralForCausalLM, MixtralForSequenceClassification,
                          DeepseekV3ForCausalLM, DeepseekV3ForSequenceClassification)

from ..hub import hub_reachable, why_unavailable
from ..tp.plans import plan_for
from .pretrained import PACKAGED, is_packaged, quiet_transformers, resolve
from .shapes import NAMED_MAX_POSITIONS, NAMED_SHAPES, named_config
from .upcycle import base, is_upcycled, parse, upcycle

_CLASSES = {"classification": {"gpt2": GPT2ForSequenceClassification, "llama": LlamaForSequenceClassification,
                               "mixtral": MixtralForSequenceClassification,
                               "deepseek_v3": DeepseekV3ForSequenceClassification},
            "lm": {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM, "mixtral": MixtralForCausalLM,
                   "deepseek_v3": DeepseekV3ForCausalLM}}
_AUTO = {"classification": AutoModelForSequenceClassification, "lm": AutoModelForCausalLM}


def is_pretrained(name: str) -> bool:
    return name not in NAMED_SHAPES


def max_positions(name: str) -> Optional[int]:
    """How many positions model ``name`` can embed (n_positions / max_position_embeddings), read
    from its config alone; None when the config cannot be read here (build_model checks later)."""
    name = base(name)
    if not is_pretrained(name):
        if NAMED_SHAPES[name][0] == "gpt2":
            return NAMED_MAX_POSITIONS
        return named_config(name).max_position_embeddings
    _use_hub(name)
    path = resolve(name)  # a packaged model that is not installed says so here, before any data work
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception:  # offline and not cached, not a model directory: build_model says why
        return None
    value = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    return int(value) if value else None


def check_max_length(name: str, max_length: int) -> None:
    """Refuse, before any data is tokenised, a max_length the model has no positions for."""
    limit = max_positions(name)
    if limit is not None and max_length > limit:
        raise ValueError(f"max_length={max_length} exceeds model {name!r}'s {limit} positions "
                         f"(n_positions / max_position_embeddings); use max_length <= {limit}")


def _dropout_overrides(model_type: str, dropout: Optional[float]) -> dict:
    if dropout is None:
        return {}
    if model_type == "gpt2":
        return dict(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return dict(attention_dropout=dropout)  # the Llama family's only dropout


def build_model(name: str, *, vocab_size: int, pad_token_id: int, num_labels: int, max_length: int,
                attn_implementation: str = "sdpa", dropout: Optional[float] = None,
                seed: int = 0, task: str = "classification") -> torch.nn.Module:
    """A sequence classifier (or causal LM for ``task="lm"``): random weights for a named shape, else
    from_pretrained (HF name or local dir)."""
    torch.manual_seed(seed)
    if not is_pretrained(name):
        model_type, shape = NAMED_SHAPES[name]
        positions = "n_positions" if model_type == "gpt2" else "max_position_embeddings"
        config = named_config(name, **{positions: max(max_length, shape.get(positions, 64))}, vocab_size=vocab_size,
                              num_labels=num_labels, pad_token_id=pad_token_id, bos_token_id=pad_token_id,
                              eos_token_id=pad_token_id, **_dropout_overrides(model_type, dropout))
        config._attn_implementation = attn_implementation
        return _CLASSES[task][model_type](config)
    if is_upcycled(name):
        if task != "lm":
            raise ValueError(f"model {name!r}: an upcycled model is a causal LM; use task=lm")
        dense = build_model(base(name), vocab_size=vocab_size, pad_token_id=pad_token_id, num_labels=num_labels,
                            max_length=max_length, attn_implementation=attn_implementation, dropout=dropout,
                            seed=seed, task=task)
        return upcycle(dense, parse(name)[1], seed=seed)
    _use_hub(name)
    path = resolve(name)
    try:
        config = AutoConfig.from_pretrained(path)
        for key, value in _dropout_overrides(config.model_type, dropout).items():
            setattr(config, key, value)
        config.num_labels = num_labels
        model, missing = _from_pretrained(_AUTO[task], path, config, attn_implementation)
    except (OSError, ValueError) as err:
        raise _cannot_load(name, err) from None
    if missing:
        raise ValueError(f"model {name!r}: its checkpoint lacks {len(missing)} of the model's weights ({missing[0]}"
                         f"{', ...' if len(missing) > 1 else ''}), which would start random")
    try:
        plan_for(model)
    except TypeError as err:
        raise ValueError(f"model {name!r}: {err}") from None
    check = model.config.max_position_embeddings
    if check < max_length:
        raise ValueError(f"max_length={max_length} exceeds model {name!r}'s {check} positions "
                         f"(n_positions / max_position_embeddings); use max_length <= {check}")
    if vocab_size > model.config.vocab_size:
        model.resize_token_embeddings(vocab_size)
    model.config.pad_token_id = pad_token_id
    return model


def _from_pretrained(auto, path: str, config, attn_implementation: str) -> tuple[torch.nn.Module, list[str]]:
    """The model and the weights of its base model (not the task's new head) its checkpoint lacks. Tied
    weights load for every head: a tied model's checkpoint may hold the embedding only as the LM head's copy
    (``lm_head.weight``: the converted smollm2-135m), which a classifier, having no LM head, would skip."""
    def load(**extra):
        with quiet_transformers():   # its load report: what is missing is checked here
            return auto.from_pretrained(path, config=config, attn_implementation=attn_implementation,
                                        output_loading_info=True, **extra)
    model, info = load()
    embedding = next(n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight)
    if embedding in info["missing_keys"] and "lm_head.weight" in info["unexpected_keys"] \
            and getattr(config, "tie_word_embeddings", False):
        model, info = load(key_mapping={r"^lm_head\.weight$": embedding})
    if getattr(model, "use_kernels", False):
        # transformers 5 swaps hub kernels into a loaded model's layers, again on every train(), which drops
        # the forward each parallelism sets on a layer (its per-rank runs): the model's own torch code, as a
        # named shape runs it
        model.use_kernels = False
    parameters = {n for n, _ in model.named_parameters()}
    base = model.base_model_prefix
    return model, sorted(k for k in info["missing_keys"] if k in parameters and k.split(".")[0] == base)


def _use_hub(name: str) -> None:
    """Before a pretrained load by name: ask once per process whether the hub can be reached
    (offline mode if not, so the load answers from the cache at once)."""
    name = base(name)
    if not Path(name).exists() and not is_packaged(name):
        hub_reachable()


def check_model(name: str) -> None:
    """Raise build_model's one-line reason when model ``name`` cannot be loaded here (its config
    is read: from a directory, the cache, or the hub)."""
    name = base(name)
    if not is_pretrained(name):
        return
    _use_hub(name)
    path = resolve(name)
    try:
        AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise _cannot_load(name, err) from None


def _cannot_load(name: str, err: BaseException) -> ValueError:
    where = "local directory" if Path(name).exists() else "model name"
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    why = why_unavailable() if where == "model name" else None
    return ValueError(f"cannot load model {name!r} ({where}): {why + '; ' if why else ''}{first}. Use a named shape "
                      f"({', '.join(NAMED_SHAPES)}), a packaged model ({', '.join(PACKAGED)}), a local directory, "
                      "or go online "
                      "(unset HF_HUB_OFFLINE), or cache it once on a machine that can reach the hub")
