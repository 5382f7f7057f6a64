"""Checkpoint save/load time for the GPT-2 small shape, and the overhead of one every 100 steps.

    .venv/bin/python benchmarks/bench_checkpoint.py [--steps 3] [--tp-size 2]

Saves what the trainer saves for resume (model shards, AdamW state, RNGs, network
state) through lossysim.run.checkpoint, loads it back with verification, and times a
training step (batch 8 x 128 tokens) to put the save cost in proportion.
Target: checkpointing every 100 steps costs under 5% of training time.
"""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2ForSequenceClassification

from lossysim import LossyNetwork, parallelize
import threads_flag
from lossysim.run import checkpoint


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed training steps")
    parser.add_argument("--repeats", type=int, default=3, help="timed saves and loads")
    parser.add_argument("--tp-size", type=int, default=2)
    args = threads_flag.parse_args(parser)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024,
                        num_labels=3, pad_token_id=50256)
    network = LossyNetwork(args.tp_size, "ge:rate=0.01,burst=8", seed=0)
    model = parallelize(GPT2ForSequenceClassification(config), args.tp_size, network)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = {"input_ids": torch.randint(0, 50000, (8, 128)), "labels": torch.randint(0, 3, (8,))}

    def step():
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up, and AdamW state exists from here on
    step_times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        step_times.append(time.perf_counter() - t0)

    def state():
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "replicated": model.group.rng_state()},
                "train_net": network.state_dict()}

    save_times, load_times = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            t0 = time.perf_counter()
            path = checkpoint.save(Path(tmp), i + 1, state(), keep=1)
            save_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            loaded = checkpoint.load(path)
            model.load_state_dict(loaded["model"])
            optimizer.load_state_dict(loaded["optimizer"])
            network.load_state_dict(loaded["train_net"])
            load_times.append(time.perf_counter() - t0)
        size = sum(f.stat().st_size for f in path.iterdir())

    params = sum(p.numel() for p in model.parameters())
    step_s, save_s, load_s = (statistics.median(t) for t in (step_times, save_times, load_times))
    overhead = save_s / (100 * step_s)
    print(f"GPT-2 small shape, sim tp {args.tp_size}: {params / 1e6:.1f} M parameters, "
          f"checkpoint {size / 2**20:.0f} MiB")
    print(f"  training step (batch 8 x 128)      {step_s:8.3f} s  (median of {len(step_times)})")
    print(f"  save (write, fsync, checksum, seal) {save_s:8.3f} s  (median of {len(save_times)})")
    print(f"  load (verify, restore)              {load_s:8.3f} s  (median of {len(load_times)})")
    print(f"  overhead of one save per 100 steps  {overhead:8.2%}  target < 5%: "
          f"{'PASS' if overhead < 0.05 else 'FAIL'}")


if __name__ == "__main__":
    main()
