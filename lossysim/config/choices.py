"""What each setting may be: the choices a key takes, the keys outside a run's identity, and the
parsing of ``report_to`` and ``pp_layout``."""
from __future__ import annotations

from .. import axes
from ..dp.axis import DP_MODES
from ..pp.axis import PP_SCHEDULES
from ..util import one_of

__all__ = ["BACKENDS", "DP_MODES", "IDENTITY_AT_DEFAULT_OMITTED", "NON_SEMANTIC",
           "PP_SCHEDULES", "TRACKERS", "check_choice", "parse_layout", "parse_report_to"]


# Keys that say where or how a run is executed, not what it trains: they stay out of a run's
# identity (the sweep's hash, what a resumed checkpoint must match), so a shard on another
# machine (another device, another output folder) finds the run. Checkpointing settings too:
# a resumed run ends exactly as an uninterrupted one.
NON_SEMANTIC = ("out", "name", "device", "timeout_s", "save_checkpoint", "checkpoint_every", "keep_checkpoints",
                "report_to", "threads")
TRACKERS = ("tensorboard", "wandb")
BACKENDS = ("sim", "dist")     # every rank in one process, or one per process (torchrun)
# Keys added after the first sweeps (data parallelism, micro-batches, ...): at their defaults they stay
# out of a run's identity (the sweep's hash), so sweeps written before them still find their runs. An axis's
# settings say so in their declaration (``Setting.identity_at_default``); the fabric's keys belong to no axis.
IDENTITY_AT_DEFAULT_OMITTED = ("lossy_traffic", "lossy_layers", "lossy_sites", "outlier_fraction", "parallel_order",
                               "fabric", "bad_link", "corrupt_share", "qps_per_connection", "pxn", "routing", "shared_cables",
                               "link_event", "reroute", "ib_timeout", "event_steps",
                               *(s.field for s in axes.settings() if not s.identity_at_default))


def parse_report_to(value) -> tuple[str, ...]:
    """``"none"``, ``"tensorboard"``, ``"tensorboard,wandb"`` or a list -> tracker names (ValueError
    naming report_to otherwise)."""
    items = value if isinstance(value, (list, tuple)) else str(value).replace(" ", ",").split(",")
    names = [str(item).strip().lower() for item in items if str(item).strip()]
    unknown = [n for n in names if n not in ("none", *TRACKERS)]
    if unknown:
        raise ValueError(f"report_to={value!r}: unknown tracker {unknown[0]!r} "
                         f"(expected none, {', '.join(TRACKERS)}, or several separated by commas)")
    if "none" in names and len(names) > 1:
        raise ValueError(f"report_to={value!r}: 'none' cannot be combined with a tracker")
    return tuple(dict.fromkeys(n for n in names if n != "none"))



def parse_layout(value: str, stages: int) -> tuple[int, ...]:
    """``pp_layout``: blocks per stage separated by commas (``"1,3"``), one entry >= 1 per stage."""
    try:
        counts = tuple(int(part) for part in str(value).replace(" ", "").split(","))
    except ValueError:
        counts = ()
    if len(counts) != stages or min(counts, default=0) < 1:
        raise ValueError(f"pp_layout={value!r} must be pp_size={stages} block counts >= 1 separated by commas "
                         "(e.g. 1,3)")
    return counts


def check_choice(name: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} must be {one_of(allowed)}")
