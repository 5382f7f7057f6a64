"""The recovery policies by name (``RECOVERY_POLICIES``, ``policy``), which of them act on each kind of
message (the ``*_POLICIES`` tuples, read off the flags ``base.KINDS`` names) and the one rule that
checks it (``require``); ``packets_of``, what arrived under any policy's draw.
"""
from __future__ import annotations

from typing import Callable

from ..receivers import Delivery, combine
from ...util import one_of
from .base import KINDS, ZERO, Policy
from .hadamard import DEFAULT_HADAMARD_BLOCK, Hadamard, Transformed
from .holes import DROP_TOKEN, MASK, RESCALE
from .outliers import DEFAULT_OUTLIER_FRACTION, Outliers
from .send_by_send import ERROR_FEEDBACK, STALE, Hops

RECOVERY_POLICIES = ("zero", "rescale", "hadamard", "hadamard+rescale", "stale", "error_feedback", "outliers",
                     "outliers+hadamard", "drop_token", "mask")


def policy(name: str, hadamard_block: int = DEFAULT_HADAMARD_BLOCK,
           outlier_fraction: float = DEFAULT_OUTLIER_FRACTION) -> Policy:
    """The policy called ``name`` (one of RECOVERY_POLICIES)."""
    if name not in RECOVERY_POLICIES:
        raise ValueError(f"recovery={name!r} must be one of {', '.join(RECOVERY_POLICIES)}")
    if name.startswith("outliers"):
        inner = Hadamard(ZERO, hadamard_block) if name.endswith("+hadamard") else ZERO
        return Outliers(inner, outlier_fraction)
    if name.startswith("hadamard"):
        return Hadamard(RESCALE if name.endswith("+rescale") else ZERO, hadamard_block)
    return {"zero": ZERO, "rescale": RESCALE, "stale": STALE, "error_feedback": ERROR_FEEDBACK,
            "drop_token": DROP_TOKEN, "mask": MASK}[name]


def packets_of(drawn) -> Delivery:
    """What arrived packet by packet, before a policy filled or transformed anything (a Delivery for any
    policy's draw): which elements a loss touched, whatever the policy then makes of them."""
    if isinstance(drawn, Transformed):
        return drawn.delivery
    if isinstance(drawn, Hops):
        return combine(drawn.sched, drawn.lost, None)
    return drawn


def _acting(kind: str) -> tuple[str, ...]:
    """The policies whose flag for ``kind`` (``base.KINDS``) says they act on it."""
    flag = KINDS[kind][0]
    return tuple(name for name in RECOVERY_POLICIES if getattr(policy(name), flag))


# The policies that act on a reduce-scatter: what FSDP's sharded gradients can use.
SHARD_POLICIES = _acting("reduce_scatter")
# The policies that act on a point-to-point send: what pipeline stages' messages can use.
SEND_POLICIES = _acting("send")
# The policies that act on an all-to-all: what an MoE's dispatch and combine can use.
EXCHANGE_POLICIES = _acting("all_to_all")
# The policies that act on context parallelism's key/value exchange (``lossysim.cp``).
KV_POLICIES = _acting("kv_exchange")
_ACTING = {"send": SEND_POLICIES, "reduce_scatter": SHARD_POLICIES, "all_to_all": EXCHANGE_POLICIES,
           "kv_exchange": KV_POLICIES}


def require(name: str, collective: str, used: bool = True, works: Callable[[str], bool] = lambda name: True) -> None:
    """The one rule of what a policy acts on, for the network (a Python caller) and the config (a run's
    layout) alike: ``collective`` ``send`` (pipeline stages' point-to-point sends), ``reduce_scatter``
    (FSDP's sharded gradients), ``all_to_all`` (an MoE's dispatch and combine) or ``kv_exchange`` (context
    parallelism's keys and values, by sends or an all-gather). ``used``: whether the run has that
    collective; a policy that acts on it alone (``only_on``) needs it. A one-line ValueError naming the
    policies that do and that ``works`` accepts (the config's: the run's other settings accept them; all
    that act when none does, as another setting is wrong too)."""
    acts, what = _ACTING[collective], KINDS[collective][1]
    if used and name not in acts:
        working = tuple(candidate for candidate in acts if works(candidate)) or acts
        raise ValueError(f"recovery={name} does not act on {what}: use "
                         f"{one_of(working) if len(working) > 1 else working[0]}")
    if not used and policy(name).only_on == collective:
        raise ValueError(f"recovery={name} acts on {what} only (elsewhere it is zero), and the run has none")
