"""What ``bench_tensor_parallel.py`` times: the shapes as HF builds them (sequence classifiers, dropout 0,
sdpa attention), their batches and one training step, and PyTorch's own tensor parallelism applied to
them (the ``dist`` comparison's other side)."""
from __future__ import annotations

import torch
from torch import nn
from transformers import GPT2Config, GPT2ForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

from lossysim.models import NAMED_SHAPES

SHAPES = {  # name -> (config class, shape)
    "tiny": (GPT2Config, dict(n_layer=2, n_head=4, n_embd=128, vocab_size=8192)),
    "tiny-llama": (LlamaConfig, dict(NAMED_SHAPES["tiny-llama"][1], vocab_size=8192)),
    "small": (GPT2Config, dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257)),
}
BATCH, SEQ, LABELS = 8, 128, 3


def make_model(shape: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config_class, spec = SHAPES[shape]
    common = dict(num_labels=LABELS, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if config_class is GPT2Config:
        config = GPT2Config(**spec, n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
        model_class = GPT2ForSequenceClassification
    else:
        config = LlamaConfig(**spec, max_position_embeddings=1024, attention_dropout=0.0, **common)
        model_class = LlamaForSequenceClassification
    config._attn_implementation = "sdpa"
    return model_class(config)


def describe(shape: str) -> str:
    config = make_model_config(shape)
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return (f"{type(config).__name__[:-6]}, {config.num_hidden_layers} layers, {config.num_attention_heads} heads "
            f"({kv} kv), width {config.hidden_size}, vocab {config.vocab_size}")


def make_model_config(shape: str):
    config_class, spec = SHAPES[shape]
    return config_class(**spec)


def make_batch(vocab: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=gen)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH,), generator=gen)
    lengths[0] = SEQ
    mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
            "labels": torch.randint(0, LABELS, (BATCH,), generator=gen)}


def train_step(model, optimizer, batch) -> float:
    """One step; ``loss.item()`` waits for the device, so wall time covers the whole step."""
    optimizer.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return loss.item()


def conv_to_linear(conv) -> nn.Linear:
    """transformers' Conv1D (weight [in, out], y = x W + b) as an nn.Linear (weight [out, in])."""
    linear = nn.Linear(conv.weight.shape[0], conv.weight.shape[1])
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    return linear


def pytorch_tensor_parallel(model, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    tp = mesh.size()
    if isinstance(model, LlamaForSequenceClassification):  # nn.Linear already; views infer local heads
        for block in model.model.layers:
            parallelize_module(block, mesh, {
                "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()})
        return model
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        width = attn.embed_dim
        c_attn = conv_to_linear(attn.c_attn)
        # Output rows [Q | K | V] -> [Q_0 K_0 V_0 | Q_1 K_1 V_1 ...]: rank r's contiguous shard = its heads.
        order = torch.arange(3 * width).reshape(3, tp, width // tp).permute(1, 0, 2).reshape(-1)
        with torch.no_grad():
            c_attn.weight.copy_(c_attn.weight[order].clone())
            c_attn.bias.copy_(c_attn.bias[order].clone())
        attn.c_attn, attn.split_size = c_attn, width // tp  # GPT2Attention infers local heads (-1)
        attn.c_proj = conv_to_linear(attn.c_proj)
        mlp.c_fc, mlp.c_proj = conv_to_linear(mlp.c_fc), conv_to_linear(mlp.c_proj)
        parallelize_module(block, mesh, {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                                         "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
    return model
