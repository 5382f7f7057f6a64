"""The other side of a budget: what retransmitting a family's traffic at its budget rate costs a real
job's step (``lossysim estimate``), so a budget reads "drop below X%, or pay Y% of a step".

Each family's job is a named shape with that family's axis at 2 across nodes (``ranks_per_node: 1``, as
the budget's own runs place it; ``Family.job`` where its layout differs from the budget's runs') on H100s
over RoCE 200G, steps of 8 sequences of 4,096 tokens, its traffic lossy alone: the mean step with
``transport: retransmit`` on each NIC preset over the loss-free step, with its 95% interval over ``STEPS``
steps. TCP's step varies widely from one draw of losses to the next (a tail probe, a timeout or none):
three steps of the CP ring's job at 3.16% gave 226%, its interval 132% to 321%; 24 give 207% +-10. A
family of experts runs on a mixture of experts. A job whose TP stays inside NVLink never loses TP
packets; this says what it would cost if it crossed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import from_dict
from .families import Family

NICS = ("irn", "tcp")
SEQ = 4096
STEPS = 24
HARDWARE = dict(compute="h100", link_inter="roce-200g", link_intra="nvlink4")   # what the job runs on
_DENSE, _MOE = "llama-3.1-8b", "mixtral-8x7b"


def job(family: Family) -> tuple[str, dict]:
    """``family``'s job: its named shape and its layout."""
    return (_MOE if family.upcycled else _DENSE), dict(family.layout if family.job is None else family.job)


@dataclass(frozen=True)
class Cost:
    """Percent of the loss-free step that retransmitting adds: the mean over the steps and its 95%
    interval's half-width (Student's t; the loss-free step is exact, so the interval is the mean step's);
    and how often the transport gives a collective up (its retries spent: the job stops, which the step
    time does not hold), per 1,000 steps."""
    pct: float
    half_width: float
    failures_per_1000_steps: float = 0.0


def step_cost(family: Family, rate: float, nic: str, seed: int = 0) -> Cost:
    """What retransmitting ``family``'s traffic at ``rate`` adds to its job's step, on ``nic``."""
    from ..estimate.simulate import estimate
    from ..estimate.workload import Workload
    shape, layout = job(family)
    config = from_dict({**layout, **HARDWARE, "ranks_per_node": 1, "lossy_links": "inter_node", "batch_size": 8,
                        "seed": seed, "lossy_traffic": family.lossy_traffic, "loss": f"bernoulli:{rate:.6g}",
                        "transport": "retransmit", "nic": nic})
    row = estimate(shape, config, Workload(seq=SEQ), steps=STEPS)
    hi = row["step_mean_hi_s"]
    half = math.nan if hi is None else (hi - row["step_mean_s"]) / row["loss_free_step_s"]
    return Cost(100.0 * (row["slowdown"] - 1.0), 100.0 * half, float(row["failures_per_1000_steps"]))
