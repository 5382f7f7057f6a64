"""The short lossy runs whose numbers must never change by accident (see tests/golden/)."""
from __future__ import annotations

from pathlib import Path

# What a run's numbers are: losses, accuracies, packets and the simulated clock.
KEYS = ("loss", "accuracy", "packets_sent_fwd", "packets_lost_fwd", "packets_sent_bwd", "packets_lost_bwd",
        "observed_loss_rate", "disagreement", "hidden_rel_diff", "sim_time_s", "comm_s_per_step",
        "retransmit_s_per_step", "compute_s_per_step")

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
    from lossysim.config import ExperimentConfig
    return ExperimentConfig(**{**_BASE, **CASES[name], "out": str(out)}).validate()
