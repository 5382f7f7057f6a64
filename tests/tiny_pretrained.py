"""A tiny pretrained-shaped model on local files, for tests that load a pretrained model by path.

Not collected by pytest (no ``test_`` prefix). A Llama with SmolLM2's proportions (3 query heads to 1
kv head: tp 3; tied embeddings), saved as a pretrained model is: its config, weights and a BPE
tokenizer trained on Python's documentation text.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lossysim.data import pydoc_text
from lossysim.data.tokenizers import train_bpe

HIDDEN = 48


def save_tiny_pretrained(folder: Path, seed: int = 3) -> Path:
    tokenizer = train_bpe(pydoc_text.texts("train")[:40], vocab_size=300)
    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1, hidden_size=HIDDEN,
                         head_dim=16, intermediate_size=96, vocab_size=len(tokenizer), tie_word_embeddings=True,
                         max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
