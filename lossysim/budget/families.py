"""The traffic families a budget is measured for, as each axis declares them (``Axis.budget``, a
``lossysim.axes.Family``): each one's layout (the one axis that carries it, across nodes), the
``lossy_traffic`` keys that let only it lose packets, the model it needs and the recovery policies tried on
it (those the run accepts are kept: ``ExperimentConfig.accepts``).

Layouts are the smallest that carry the family between nodes (``ranks_per_node: 1``): tp 3 (SmolLM2's
9 query and 3 kv heads), two pipeline stages, two context ranks, two data-parallel replicas (DDP or
FSDP), and for experts the model upcycled into 4 experts over ep 2 (``models/upcycle.py``).
"""
from __future__ import annotations

from .. import axes
from ..axes import Family
from ..traffic import Live

POLICIES = ("zero", "rescale", "outliers", "mask", "drop_token", "hadamard")

FAMILIES = Live(axes.families)   # every axis's, in their declared ``order``


def parse_families(text: str) -> tuple[Family, ...]:
    """``all`` or names separated by commas -> the families, in ``FAMILIES`` order."""
    families = tuple(FAMILIES)
    by_name = {f.name: f for f in families}
    names = {n.strip() for n in str(text).split(",") if n.strip()}
    if names == {"all"}:
        return families
    unknown = sorted(names - set(by_name))
    if unknown or not names:
        raise ValueError(f"families={text!r} must be all, or some of {', '.join(by_name)} separated by commas")
    return tuple(f for f in families if f.name in names)


def model_for(family: Family, model: str) -> str:
    return f"upcycled:{model}:{family.upcycled}" if family.upcycled else model
