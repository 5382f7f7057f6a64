"""The traffic classes: every kind of message a training step sends, declared once.

A class is a name (the estimate's column prefix, summary.json's network tag), the mesh axis whose
groups carry it, its directions, and for each direction the ``lossy_traffic`` key that lets it lose
packets and what it is called. The config's ``lossy_traffic`` keys, the directions each network may
lose, summary.json's traffic, the report's labels and tables, the collectives table and the estimate's
columns all derive from ``CLASSES``: adding a class is adding an entry (and the code that sends it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Direction:
    direction: str      # fwd | bwd: which pass sends it
    key: str            # the ``lossy_traffic`` key that lets it lose packets
    label: str          # what a report calls it


@dataclass(frozen=True)
class TrafficClass:
    name: str
    axis: str           # the mesh axis whose groups carry it (a pipeline boundary joins two stages' TP groups)
    label: str
    directions: tuple[Direction, ...]

    def lossy(self, kinds: tuple[str, ...]) -> tuple[str, ...]:
        """The directions that may lose packets when ``lossy_traffic`` names ``kinds``."""
        return tuple(d.direction for d in self.directions if d.key in kinds)


CLASSES = (
    TrafficClass("tp", "tp", "TP", (Direction("fwd", "tp_forward", "TP activations"),
                                    Direction("bwd", "tp_backward", "TP gradients"))),
    TrafficClass("pp", "pp", "PP", (Direction("fwd", "pp_forward", "PP activations"),
                                    Direction("bwd", "pp_backward", "PP gradients"))),
    TrafficClass("dp", "dp", "DP", (Direction("bwd", "dp", "DP gradients"),)),
    TrafficClass("fsdp", "dp", "FSDP", (Direction("fwd", "dp", "FSDP weight gathers"),
                                        Direction("bwd", "dp", "FSDP gradient reduce-scatters"))),
)
BY_NAME = {c.name: c for c in CLASSES}
# lossy_traffic's keys, each named once, in the classes' order; a key's label is its first direction's
KINDS = tuple(dict.fromkeys(d.key for c in CLASSES for d in c.directions))
KIND_LABELS = {key: next(d.label for c in CLASSES for d in c.directions if d.key == key) for key in KINDS}
# Both directions of a class named together read as the class's traffic ("TP traffic")
PAIRS = {tuple(d.label for d in c.directions): f"{c.label} traffic" for c in CLASSES if len(c.directions) == 2
         and len({d.key for d in c.directions}) == 2}


def parse_kinds(value) -> tuple[str, ...]:
    """``lossy_traffic``: ``all`` or kinds separated by commas -> the kinds, in ``KINDS`` order."""
    items = value if isinstance(value, (list, tuple)) else str(value).replace(" ", ",").split(",")
    names = {str(item).strip().lower() for item in items if str(item).strip()}
    if names == {"all"}:
        return KINDS
    unknown = sorted(names - set(KINDS))
    if unknown or not names:
        raise ValueError(f"lossy_traffic={value!r} must be all, or some of {', '.join(KINDS)} "
                         "separated by commas")
    return tuple(k for k in KINDS if k in names)


def of_network(name: str) -> Optional[TrafficClass]:
    """The class a summary's ``collectives`` network tag names (``tp.stage1``, ``pp.boundary0``,
    ``dp.tp0``, ``fsdp.tp1``), or None."""
    return BY_NAME.get(name.split(".")[0])
