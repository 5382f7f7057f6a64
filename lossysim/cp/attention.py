"""Attention over keys and values gathered from the whole context group, with what was lost left out.

HF's attention modules compute queries, keys and values (RoPE applied at the tokens' global positions)
and hand them to an attention function named by ``config._attn_implementation``: context parallelism
registers its own (``NAME``). Each attention module knows its call site and its context parallelism
(``lossysim_context``); the function exchanges the keys and values over the context group
(``exchange``), then computes every local query's attention over every origin's keys, with one mask:
causal by global position (Mistral's sliding window too), padding keys out, and under ``recovery: mask``
every key whose key or value a lost packet touched (on any hop to this receiver) out of the softmax of
this receiver's queries, which renormalise over what arrived. Under ``zero`` a lost key is a zero key
(its score 0) and a lost value a zero value: still in the softmax.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

NAME = "lossysim_context_parallel"


@dataclass(frozen=True)
class Site:
    """An attention module's call site (``h.3.attn.kv``) and the context parallelism it runs under."""
    name: str
    context: object
    stage: int = 0       # the pipeline stage running the block (its context groups)


def _forward(module, query, key, value, attention_mask, scaling: Optional[float] = None, dropout: float = 0.0,
             **kwargs):
    site: Site = module.lossysim_context
    return site.context.attend(site.name, query, key, value, scaling, dropout, kwargs.get("sliding_window"),
                               site.stage)


def register() -> None:
    """Make ``NAME`` an attention implementation HF models can be set to (idempotent)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    ALL_ATTENTION_FUNCTIONS.register(NAME, _forward)


def allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, valid: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """[local contexts, batch, L, keys]: which key each local query may read: causal by global position
    (``q_pos`` [contexts, L], ``k_pos`` [keys]), inside the sliding window if any, real tokens only
    (``valid`` [batch, keys])."""
    ok = k_pos[None, None, :] <= q_pos[:, :, None]
    if window is not None:
        ok = ok & (q_pos[:, :, None] - k_pos[None, None, :] < window)
    return ok[:, None] & valid[None, :, None, :]


def lost_keys(missed: torch.Tensor, per_packet: int, shape: tuple) -> torch.Tensor:
    """Packets missed (``[..., packets]``) as keys missed: ``[..., batch, kv_heads, keys of the block]`` True
    where a lost packet held any element of that token's key or value (``shape``: a block's (2, batch,
    kv_heads, L, head_dim))."""
    n = 1
    for size in shape:
        n *= size
    elements = missed.repeat_interleave(per_packet, dim=-1)[..., :n]
    return elements.view(*missed.shape[:-1], *shape).any(-1).any(-4)


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ok: torch.Tensor,
           scaling: Optional[float], dropout: float) -> torch.Tensor:
    """``query`` [N, heads, L, d] over ``keys``/``values`` [N, kv_heads, K, d] where ``ok`` [N, heads or 1, L, K]
    allows: [N, L, heads, d], as HF's attention functions return it. A query that may read no key (padding)
    gets a uniform average, not NaN."""
    groups = query.shape[1] // keys.shape[1]
    if groups > 1:   # grouped-query attention: HF's repeat_kv
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    mask = torch.zeros(ok.shape, dtype=query.dtype, device=query.device).masked_fill_(~ok, torch.finfo(query.dtype).min)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous()
