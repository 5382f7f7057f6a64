"""Data for the experiment runner: MNLI (hub or local files) or the embedded synthetic NLI task.

One pipeline for every source: load rows (``sources``) -> drop unlabelled rows -> cap (seeded
shuffle, then select) -> tokenise (``tokenizers``) -> cache on disk with the tokenizer
(``prepare``) -> batches cut to their longest row (``batches``). Labels follow GLUE MNLI:
0 entailment, 1 neutral, 2 contradiction.
"""
from .batches import epoch_order, eval_batches, pad_to_longest, train_batches
from .examples import EVAL_SPLITS, LABELS, MNLI, NUM_LABELS, SPLITS, SYNTHETIC, Examples, display_name
from .prepare import PreparedData, build, cache_path, load_cached, prepare_data
from .sources import FILE_SETS, HF_MNLI, HOLDOUT_EVERY, dataset_identity, load_examples
from .synthetic import synthetic_cue_accuracy, synthetic_examples
from .tokenizers import (EOS_TOKEN, PAD_TOKEN, build_tokenizer, byte_tokenizer, check_vocabulary,
                         load_pretrained_tokenizer, tokenize_examples, tokenizer_spec, train_bpe)

__all__ = ["epoch_order", "eval_batches", "pad_to_longest", "train_batches", "EVAL_SPLITS", "LABELS", "MNLI",
           "NUM_LABELS", "SPLITS", "SYNTHETIC", "Examples", "display_name", "PreparedData", "build", "cache_path",
           "load_cached", "prepare_data", "FILE_SETS", "HF_MNLI", "HOLDOUT_EVERY", "dataset_identity",
           "load_examples", "synthetic_cue_accuracy", "synthetic_examples", "EOS_TOKEN", "PAD_TOKEN",
           "build_tokenizer", "byte_tokenizer", "check_vocabulary", "load_pretrained_tokenizer",
           "tokenize_examples", "tokenizer_spec", "train_bpe"]
