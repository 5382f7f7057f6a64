"""The short lossy runs whose numbers must never change by accident (see tests/golden/), and how
today's numbers are told from the captured ones.

Run as a script (``python tests/golden_runs.py OUT.json``) it writes every case's numbers to OUT.json:
the golden tests run it under other kernel dispatch settings and compare in the parent.
"""
from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

# What a run's numbers are: losses, accuracies, packets and the simulated clock.
KEYS = ("loss", "accuracy", "packets_sent_fwd", "packets_lost_fwd", "packets_sent_bwd", "packets_lost_bwd",
        "observed_loss_rate", "disagreement", "hidden_rel_diff", "sim_time_s", "comm_s_per_step",
        "retransmit_s_per_step", "compute_s_per_step")
# The figures fp32 rounding may move: a sum over a model's activations, whose order differs with the
# CPU's BLAS and vector width. Every other key is exact by construction: packets are drawn from
# seeded streams whatever the values carried, the clock is float64 arithmetic on those counts and
# the config, and accuracy and disagreement are counts of argmax decisions no rounding can flip
# while every top-two logit gap is wider than twice the shift FLOAT_RTOL allows (checked per run).
FLOAT_KEYS = ("loss", "hidden_rel_diff")
# The largest relative shift a CPU may give a float figure. Measured on one AMD EPYC at every
# kernel level it has (AVX512, AVX2, default, with MKL's conditional reproducibility on and off)
# against the file, captured on an AVX2 CPU: at most 3.6e-7 (3 fp32 ulps) over six steps; and
# after sim began summing replicated gradients rank by rank (dist's order), at most 3.5e-7 at the
# AVX512, AVX2 and default levels. 1e-5 is 28 times that; a 1% change of the learning rate moves
# a figure by 1e-4 or more by step 3.
FLOAT_RTOL = 1e-5
# What summary.json says that is exact: packets sent, lost, resent, missing, runs of losses,
# timeouts and failures per direction, link class and call site, and the clock's totals.
SUMMARY_KEYS = ("packets", "packets_by_class", "packets_by_site", "sim_time")

_BASE = dict(dataset="synthetic", max_length=32, max_train_samples=96, max_eval_samples=48, batch_size=8,
             eval_batch_size=48, steps=6, eval_every=3, log_every=1, warmup_steps=2, dropout=0.0, lr=1e-3)

CASES = {
    "gpt2-ring-zero-bernoulli": dict(model="tiny", loss="bernoulli:0.05"),
    "gpt2-tree-rescale-ge": dict(model="tiny", loss="ge:rate=0.05,burst=4", algorithm="tree", recovery="rescale",
                                 tp_size=4),
    "gpt2-direct-zero-ge": dict(model="tiny", loss="ge:rate=0.1,burst=3", algorithm="direct"),
    "llama-ring-rescale-bernoulli": dict(model="tiny-llama", loss="bernoulli:0.05", recovery="rescale", tp_size=4),
    "llama-tree-zero-bernoulli": dict(model="tiny-llama", loss="bernoulli:0.1", algorithm="tree", lossy="fwd"),
    "gpt2-ring-retransmit": dict(model="tiny", loss="bernoulli:0.05", transport="retransmit"),
    "gpt2-ring-deadline-2x2": dict(model="tiny", loss="bernoulli:0.1", transport="deadline", deadline=3.0,
                                   tp_size=4, ranks_per_node=2, lossy_links="inter_node"),
}


def config_for(name: str, out: Path):
    from tiny_runs import tiny_run
    return tiny_run(out, **{**_BASE, **CASES[name]})


def numbers(config) -> dict:
    """Run ``config`` and return what the golden files keep of it: ``rows`` (KEYS of every metrics row)
    and ``summary`` (SUMMARY_KEYS of summary.json)."""
    from lossysim.io import read_jsonl
    from lossysim.run.experiment import run_experiment
    summary = run_experiment(config, config.out, progress=False)
    assert summary["status"] == "completed", summary.get("error")
    rows = read_jsonl(Path(config.out) / "metrics.jsonl")
    return {"rows": [{k: row[k] for k in ("step", "split", *KEYS) if k in row} for row in rows],
            "summary": {k: summary[k] for k in SUMMARY_KEYS}}


def differences(got: dict, expected: dict) -> list[str]:
    """Where ``got`` departs from ``expected`` (both as ``numbers`` returns them): FLOAT_KEYS beyond
    FLOAT_RTOL, anything else at all. An expected 0.0 must stay exactly 0.0 (a retransmitting
    transport leaves the ranks identical)."""
    found = []
    if len(got["rows"]) != len(expected["rows"]):
        found.append(f"{len(got['rows'])} rows, expected {len(expected['rows'])}")
    for mine, theirs in zip(got["rows"], expected["rows"]):
        for key, want in theirs.items():
            have = mine.get(key)
            same = math.isclose(have, want, rel_tol=FLOAT_RTOL, abs_tol=0.0) if key in FLOAT_KEYS and \
                isinstance(have, float) else have == want
            if not same:
                found.append(f"step {theirs['step']} {theirs['split']} {key}: {have!r}, expected {want!r}")
    for key, want in expected.get("summary", {}).items():
        if got["summary"].get(key) != want:
            found.append(f"summary {key}: {got['summary'].get(key)!r}, expected {want!r}")
    return found


def main(out: Path) -> None:
    """Every case's ``numbers`` and the kernel level torch dispatched at, as JSON in ``out``."""
    import torch
    torch.set_num_threads(1)
    every = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in CASES:
            every[name] = numbers(config_for(name, Path(tmp) / name))
    out.write_text(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "cases": every}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
