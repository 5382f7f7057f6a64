"""Is the synthetic NLI task learnable? Train a tiny GPT-2 on it with a plain HF loop.

Not a test (it takes a minute or two on a CPU): run it after changing the synthetic task and
report the printed accuracies. Expect >= 85% on validation_matched (chance is 33%; mismatched,
with unseen sentence frames, lands a few points lower, like MNLI's).

    HF_HUB_OFFLINE=1 python benchmarks/check_synthetic_learnable.py [--steps 500] [--seed 0]
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2ForSequenceClassification

from lossysim.config import ExperimentConfig
from lossysim.data import eval_batches, prepare_data, train_batches


def tiny_model(data, max_length: int) -> GPT2ForSequenceClassification:
    eos = data.tokenizer.eos_token_id
    config = GPT2Config(n_layer=2, n_head=4, n_embd=128, n_positions=max_length, vocab_size=data.vocab_size,
                        pad_token_id=data.pad_token_id, num_labels=data.num_labels, bos_token_id=eos, eos_token_id=eos)
    return GPT2ForSequenceClassification(config)


@torch.no_grad()
def accuracy(model, split, batch_size: int = 256) -> float:
    model.eval()
    correct = 0
    for batch in eval_batches(split, batch_size):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        correct += int((logits.argmax(-1) == batch["labels"]).sum())
    model.train()
    return correct / len(split["labels"])


def train(data, *, steps: int, batch_size: int, lr: float, seed: int, max_length: int, eval_every: int = 0):
    """Plain AdamW loop; returns the model and the (step, matched, mismatched) accuracies seen."""
    torch.manual_seed(seed)
    model = tiny_model(data, max_length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    history = []
    batches = train_batches(data, batch_size, seed)
    for step in range(1, steps + 1):
        batch = next(batches)
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if eval_every and (step % eval_every == 0 or step == steps):
            history.append((step, accuracy(model, data.splits["validation_matched"]),
                            accuracy(model, data.splits["validation_mismatched"]), loss.item()))
    return model, history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--train-samples", type=int, default=20_000)
    parser.add_argument("--eval-samples", type=int, default=2_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one is fastest for this size)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = ExperimentConfig(dataset="synthetic", tokenizer="bpe", max_length=args.max_length, seed=args.seed,
                              max_train_samples=args.train_samples, max_eval_samples=args.eval_samples)
    with tempfile.TemporaryDirectory() as cache:
        data = prepare_data(config, cache)
    print(f"{data.name}: train {len(data.splits['train']['labels'])}, eval "
          f"{len(data.splits['validation_matched']['labels'])} x 2, vocab {data.vocab_size}")
    start = time.perf_counter()
    _, history = train(data, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                       max_length=args.max_length, eval_every=args.eval_every)
    for step, matched, mismatched, loss in history:
        print(f"step {step:4d}  loss {loss:.3f}  acc matched {matched:.3f}  mismatched {mismatched:.3f}")
    print(f"{args.steps} steps, batch {args.batch_size}, lr {args.lr}, max_length {args.max_length}: "
          f"{time.perf_counter() - start:.1f} s (training + evaluations)")


if __name__ == "__main__":
    main()
