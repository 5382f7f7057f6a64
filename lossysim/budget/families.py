"""The traffic families a budget is measured for, as data: each one's layout (the one axis that carries
it, across nodes), the ``lossy_traffic`` keys that let only it lose packets, the model it needs and
the recovery policies tried on it (those the run accepts are kept: ``ExperimentConfig.accepts``).

Layouts are the smallest that carry the family between nodes (``ranks_per_node: 1``): tp 3 (SmolLM2's
9 query and 3 kv heads), two pipeline stages, two context ranks, two data-parallel replicas (DDP or
FSDP), and for experts the model upcycled into 4 experts over ep 2 (``models/upcycle.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("zero", "rescale", "outliers", "mask", "drop_token", "hadamard")


@dataclass(frozen=True)
class Family:
    name: str
    label: str
    lossy_traffic: str
    layout: dict = field(default_factory=dict)
    upcycled: int = 0      # experts to upcycle the model into (0: the model as it is)


FAMILIES = (
    Family("tp", "TP activations and gradients", "tp_forward,tp_backward", dict(tp_size=3)),
    Family("pp", "PP activations and gradients", "pp_forward,pp_backward", dict(tp_size=1, pp_size=2)),
    Family("cp_ring", "CP keys/values (ring)", "cp_forward,cp_backward", dict(tp_size=1, cp_size=2, cp_mode="ring")),
    Family("cp_allgather", "CP keys/values (all-gather)", "cp_forward,cp_backward",
           dict(tp_size=1, cp_size=2, cp_mode="allgather")),
    Family("ep", "EP dispatch and combine", "ep_dispatch,ep_dispatch_backward,ep_combine,ep_combine_backward",
           dict(tp_size=1, dp_size=2, ep_size=2), upcycled=4),
    Family("dp", "DP gradient buckets", "dp", dict(tp_size=1, dp_size=2)),
    Family("fsdp", "FSDP gathers and reduce-scatters", "dp", dict(tp_size=1, dp_size=2, dp_mode="fsdp")),
)
BY_NAME = {f.name: f for f in FAMILIES}


def parse_families(text: str) -> tuple[Family, ...]:
    """``all`` or names separated by commas -> the families, in ``FAMILIES`` order."""
    names = {n.strip() for n in str(text).split(",") if n.strip()}
    if names == {"all"}:
        return FAMILIES
    unknown = sorted(names - set(BY_NAME))
    if unknown or not names:
        raise ValueError(f"families={text!r} must be all, or some of {', '.join(BY_NAME)} separated by commas")
    return tuple(f for f in FAMILIES if f.name in names)


def model_for(family: Family, model: str) -> str:
    return f"upcycled:{model}:{family.upcycled}" if family.upcycled else model
