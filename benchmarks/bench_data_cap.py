"""Does the cost of preparing data follow the cap rather than the dataset size?

Writes an MNLI-format jsonl set (400k training lines, shaped like multinli_1.0_train.jsonl with
its parse-tree fields) into a temporary directory, then times lossysim.data's phases for
max_train_samples = 1k, 10k, 100k (and, with --uncapped, no cap). Not a test: timings vary
with the machine; what matters is that the time grows with the cap.

    HF_HUB_OFFLINE=1 python benchmarks/bench_data_cap.py [--lines 400000] [--uncapped]
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from lossysim import data as D
from lossysim.config import ExperimentConfig
import threads_flag

WORDS = ("the a man woman child dog cat car house street city park river book letter table window "
         "walks runs sits reads writes sees holds opens closes near under over with without because "
         "while after before red green old new small large quiet busy").split()
LABELS = ("entailment", "neutral", "contradiction", "-")


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 22))).capitalize() + "."


def parse_tree(text: str) -> str:
    """Stand-in for the real files' bracketed parses (they make a line ~3x longer than its text)."""
    return "( " + " ".join(f"( {w} )" for w in text.split()) + " )"


def write_split(path: Path, lines: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(lines):
            s1, s2 = sentence(rng), sentence(rng)
            label = rng.choices(LABELS, weights=(33, 33, 33, 1))[0]
            f.write(json.dumps({"annotator_labels": [label], "genre": "fiction", "gold_label": label,
                                "pairID": f"{i}n", "promptID": str(i), "sentence1": s1,
                                "sentence1_binary_parse": parse_tree(s1), "sentence1_parse": parse_tree(s1),
                                "sentence2": s2, "sentence2_binary_parse": parse_tree(s2),
                                "sentence2_parse": parse_tree(s2)}) + "\n")


def time_cap(folder: Path, cap, eval_cap: int) -> dict:
    config = ExperimentConfig(dataset=str(folder), tokenizer="bpe", max_length=128, seed=0,
                              max_train_samples=cap, max_eval_samples=eval_cap)
    times = {}
    start = time.perf_counter()
    examples = D.load_examples(config)
    times["load+cap"] = time.perf_counter() - start
    train = examples["train"]
    start = time.perf_counter()
    tokenizer = D.build_tokenizer("bpe", [t for pair in zip(train.premise, train.hypothesis) for t in pair])
    times["train bpe"] = time.perf_counter() - start
    start = time.perf_counter()
    for split in D.SPLITS:
        D.tokenize_examples(tokenizer, examples[split], config.max_length)
    times["tokenise"] = time.perf_counter() - start
    times["total"] = sum(times.values())
    times["rows"] = len(train)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=400_000, help="training lines to generate")
    parser.add_argument("--eval-lines", type=int, default=10_000)
    parser.add_argument("--eval-cap", type=int, default=1000)
    parser.add_argument("--caps", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--uncapped", action="store_true", help="also time max_train_samples=None")
    args = threads_flag.parse_args(parser)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        for seed, (split, name) in enumerate(D.FILE_SETS["jsonl"].items()):
            write_split(folder / name, args.lines if split == "train" else args.eval_lines, seed)
        size = (folder / D.FILE_SETS["jsonl"]["train"]).stat().st_size
        print(f"generated {args.lines} training lines ({size / 2**20:.0f} MiB) in {time.perf_counter() - start:.1f} s; "
              f"eval splits {args.eval_lines} lines each, eval cap {args.eval_cap}")
        print(f"{'max_train_samples':>17} {'rows':>7} {'load+cap s':>10} {'train bpe s':>11} {'tokenise s':>10} {'total s':>8}")
        for cap in args.caps + ([None] if args.uncapped else []):
            t = time_cap(folder, cap, args.eval_cap)
            print(f"{str(cap):>17} {t['rows']:>7} {t['load+cap']:>10.2f} {t['train bpe']:>11.2f} "
                  f"{t['tokenise']:>10.2f} {t['total']:>8.2f}")


if __name__ == "__main__":
    main()
