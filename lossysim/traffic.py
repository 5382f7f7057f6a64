"""The traffic classes: every kind of message a training step sends, declared once.

A class is a name (the estimate's column prefix, summary.json's network tag), the mesh axis whose
groups carry it, its directions, and for each direction the ``lossy_traffic`` key that lets it lose
packets and what it is called. The config's ``lossy_traffic`` keys, the directions each network may
lose, summary.json's traffic, the report's labels and tables, the collectives table and the estimate's
columns all derive from ``CLASSES``: adding a class is adding an entry (and the code that sends it). An axis
declared outside the package (``lossysim.axes.declared``) adds its own classes with ``add``; ``CLASSES`` and
``KINDS`` are live views, so every module that imported them sees those too.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Callable, Optional


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
    # how a group's ranks exchange it, for the flows a fabric's cables carry (``estimate.events``): ``ring``
    # (each rank to its successor), ``all_to_all`` (every pair), ``sends`` (a pipeline's neighbouring stages)
    flows: str = "ring"

    def lossy(self, kinds: tuple[str, ...]) -> tuple[str, ...]:
        """The directions that may lose packets when ``lossy_traffic`` names ``kinds``."""
        return tuple(d.direction for d in self.directions if d.key in kinds)


_DECLARED = (
    TrafficClass("tp", "tp", "TP", (Direction("fwd", "tp_forward", "TP activations"),
                                    Direction("bwd", "tp_backward", "TP gradients"))),
    TrafficClass("pp", "pp", "PP", (Direction("fwd", "pp_forward", "PP activations"),
                                    Direction("bwd", "pp_backward", "PP gradients")), flows="sends"),
    TrafficClass("dp", "dp", "DP", (Direction("bwd", "dp", "DP gradients"),)),
    TrafficClass("fsdp", "dp", "FSDP", (Direction("fwd", "dp", "FSDP weight gathers"),
                                        Direction("bwd", "dp", "FSDP gradient reduce-scatters"))),
    # An MoE block's all-to-alls over its expert-parallel group: tokens to their experts (dispatch) and the
    # experts' outputs back (combine); in backward each carries the other's way the gradient of its data.
    TrafficClass("ep_dispatch", "ep", "EP dispatch", (Direction("fwd", "ep_dispatch", "EP dispatch"),
                                                      Direction("bwd", "ep_dispatch_backward",
                                                                "EP dispatch gradients")), flows="all_to_all"),
    TrafficClass("ep_combine", "ep", "EP combine", (Direction("fwd", "ep_combine", "EP combine"),
                                                    Direction("bwd", "ep_combine_backward", "EP combine gradients")),
                 flows="all_to_all"),
    TrafficClass("cp", "cp", "CP", (Direction("fwd", "cp_forward", "CP keys and values"),
                                    Direction("bwd", "cp_backward", "CP key/value gradients"))),
)


class Live(Sequence):
    """A tuple that follows the declared classes: an axis declared later (``lossysim.axes.declared``)
    adds its classes, and every module that imported these names sees them."""

    def __init__(self, build: Callable[[], tuple]):
        self._build = build

    def __getitem__(self, index):
        return self._build()[index]

    def __len__(self) -> int:
        return len(self._build())

    def __repr__(self) -> str:
        return repr(self._build())

    def __eq__(self, other) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, (tuple, list, Live)) else other)

    __hash__ = None


_classes: list[TrafficClass] = list(_DECLARED)
CLASSES = Live(lambda: tuple(_classes))
BY_NAME: dict[str, TrafficClass] = {}
# lossy_traffic's keys, each named once, in the classes' order; a key's label is its first direction's
KINDS = Live(lambda: tuple(dict.fromkeys(d.key for c in _classes for d in c.directions)))
KIND_LABELS: dict[str, str] = {}
# Both directions of a class named together read as the class's traffic ("TP traffic")
PAIRS: dict[tuple, str] = {}


def _refresh() -> None:
    """Every name above from ``_classes``, in place."""
    BY_NAME.clear()
    BY_NAME.update({c.name: c for c in _classes})
    KIND_LABELS.clear()
    KIND_LABELS.update({key: next(d.label for c in _classes for d in c.directions if d.key == key) for key in KINDS})
    PAIRS.clear()
    PAIRS.update({tuple(d.label for d in c.directions): f"{c.label} traffic" for c in _classes
                  if len(c.directions) == 2 and len({d.key for d in c.directions}) == 2})


def add(cls: TrafficClass) -> None:
    """Declare another class (an axis declared outside this file, ``lossysim.axes.declared``)."""
    if cls.name in BY_NAME:
        raise ValueError(f"traffic class {cls.name!r} is declared already")
    _classes.append(cls)
    _refresh()


def remove(name: str) -> None:
    """Take back a class ``add`` declared; the classes declared here stay."""
    if name in {c.name for c in _DECLARED}:
        raise ValueError(f"traffic class {name!r} is declared in lossysim.traffic and stays")
    _classes[:] = [c for c in _classes if c.name != name]
    _refresh()


_refresh()


def parse_kinds(value) -> tuple[str, ...]:
    """``lossy_traffic``: ``all`` or kinds separated by commas -> the kinds, in ``KINDS`` order."""
    items = value if isinstance(value, (list, tuple)) else str(value).replace(" ", ",").split(",")
    names = {str(item).strip().lower() for item in items if str(item).strip()}
    if names == {"all"}:
        return tuple(KINDS)
    unknown = sorted(names - set(KINDS))
    if unknown or not names:
        raise ValueError(f"lossy_traffic={value!r} must be all, or some of {', '.join(KINDS)} "
                         "separated by commas")
    return tuple(k for k in KINDS if k in names)


def of_network(name: str) -> Optional[TrafficClass]:
    """The class a summary's ``collectives`` network tag names (``tp.stage1``, ``pp.boundary0``,
    ``dp.tp0``, ``fsdp.tp1``, ``ep_dispatch.tp0``, ``cp.tp0``), or None."""
    return BY_NAME.get(name.split(".")[0])
