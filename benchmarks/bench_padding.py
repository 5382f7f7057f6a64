"""Training step time with every example padded to max_length against dynamic padding.

    .venv/bin/python benchmarks/bench_padding.py [--device cpu|cuda] [--model tiny|small] [--steps 20]

MNLI-like lengths: premise + hypothesis mostly 30-70 tokens (a log-normal around 48, a few
long pairs cut at max_length=128). Both variants train the same model (tensor-parallel over
``--tp-size`` simulated ranks, ``--loss``) on the same batches, interleaved step by step so
that machine noise hits both alike; one trains on rows padded to 128 (how lossysim tokenised
until dynamic padding), the other on lossysim.data.train_batches, which cuts each batch to its
longest row. Prints median step times, their ratio, and real tokens/s.
"""
import argparse
import statistics
import time

import numpy as np
import torch
from transformers import GPT2ForSequenceClassification

from lossysim import LossyNetwork, parallelize
import threads_flag
from lossysim.data import train_batches
from lossysim.models.shapes import NAMED_SHAPES, named_config

PAD = 0
GPT2_SHAPES = sorted(name for name, (model_type, _) in NAMED_SHAPES.items() if model_type == "gpt2")


def mnli_like_split(n: int, max_length: int, seed: int = 0) -> dict:
    """Right-padded random token rows whose lengths look like MNLI pairs under GPT-2's BPE."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(48), 0.3, n)), 8, max_length).astype(int)
    ids = torch.full((n, max_length), PAD, dtype=torch.long)
    mask = torch.zeros((n, max_length), dtype=torch.long)
    for i, length in enumerate(lengths):
        ids[i, :length] = torch.from_numpy(rng.integers(1, 50000, length))
        mask[i, :length] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.from_numpy(rng.integers(0, 3, n))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="tiny", choices=GPT2_SHAPES, help="a GPT-2 named shape")
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--loss", default="bernoulli:0.01")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    args = threads_flag.parse_args(parser)
    device = torch.device(args.device)
    split = mnli_like_split(20 * args.batch_size, args.max_length)
    lengths = split["attention_mask"].sum(1).float()
    print(f"lengths: median {lengths.median():.0f}, 10-90% {lengths.quantile(0.1):.0f}-"
          f"{lengths.quantile(0.9):.0f}, max {lengths.max():.0f} (max_length {args.max_length})")

    def build():
        torch.manual_seed(0)
        config = named_config(args.model, vocab_size=50257, n_positions=args.max_length, num_labels=3,
                              pad_token_id=PAD)
        network = LossyNetwork(args.tp_size, args.loss, seed=0)
        model = parallelize(GPT2ForSequenceClassification(config).to(device), args.tp_size, network)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    variants = {"padded to max_length": build(), "dynamic (longest in batch)": build()}

    def step(model, optimizer, batch):
        batch = {k: v.to(device) for k, v in batch.items()}
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    dynamic = train_batches(split, args.batch_size, seed=0)
    times = {name: [] for name in variants}
    tokens = {name: 0 for name in variants}
    for i in range(args.steps + 2):   # two warm-up steps
        cut = next(dynamic)
        # the same rows in both variants: the padded batch re-pads the dynamic batch's rows
        padded = {k: torch.nn.functional.pad(v, (0, args.max_length - v.shape[1]), value=PAD if k == "input_ids" else 0)
                  if v.dim() == 2 else v for k, v in cut.items()}
        for name, batch in (("padded to max_length", padded), ("dynamic (longest in batch)", cut)):
            seconds = step(*variants[name], batch)
            if i >= 2:
                times[name].append(seconds)
                tokens[name] += int(batch["attention_mask"].sum())
    base = statistics.median(times["padded to max_length"])
    print(f"{args.model}, tp {args.tp_size} (sim), loss {args.loss}, batch {args.batch_size}, device {device}, "
          f"{args.steps} steps each")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"  {name:<28} median step {1000 * median:8.1f} ms   real tokens/s {tokens[name] / sum(seconds):9.0f}"
              f"   speed-up x{base / median:.2f}")


if __name__ == "__main__":
    main()
