"""The parallelisms, each declared once in its own package (``lossysim/<axis>/axis.py``), collected here.

An ``Axis`` says everything the code outside its package needs to know about it, as data: the mesh axis it
sizes, its settings (each a config field with its default, its ``lossysim train`` and ``lossysim estimate``
flags, their help and its checks, Megatron's ``ModelParallelConfig`` fields carrying their flags), its
traffic classes (named from ``lossysim.traffic``, or declared here by an axis outside the package), its
traffic families measured by ``lossysim budget`` (``budget``), its counters (``TrainState``'s, saved in
checkpoints), its summary.json section and the summary.csv columns read
off it, its report section, the run's ``Parts`` attribute holding it and the module with what a run records
of it (``record``: its metrics-row, summary and checkpoint functions, imported by ``run/`` when used), the
collective its recovery policy must act on (``requires``), its checks against other settings (``pairs``) and its
part of the estimate's job (``estimate``).

The declarations import no torch and nothing after ``traffic``: ``config/`` reads them before any axis's
package can be imported (docs/architecture.md: they are their own stage, ``axes``). ``AXES`` is the one
list; config, run, results and estimate iterate over it. ``declared(axis)`` adds one for as long as a
``with`` lasts (a test's throwaway axis): its settings become config fields and flags, its classes traffic.
"""
from __future__ import annotations

import contextlib
import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union

from . import traffic
from .traffic import TrafficClass
from .util import one_of

BUILT_IN = ("tp", "dp", "pp", "ep", "cp")   # the order the axes were added: summary.json's sections, the report's


@dataclass(frozen=True)
class EstimateFlag:
    """A setting's ``lossysim estimate`` flag: its help, argparse's default, and the config's value when the
    flag is left out (None: the setting's default)."""
    help: str
    default: Any = None
    unset: Any = None
    name: Optional[str] = None          # when it differs from the setting's flag (``--no-dp-overlap``)


@dataclass(frozen=True)
class WorkloadFlag:
    """An estimate-only setting of an axis: a ``Workload`` field (no config field: training measures what the
    estimate assumes), with its ``lossysim estimate`` flag, argparse's type and default, its help, and its
    check (``Workload``'s, of a value however given: a callable raising a one-line ValueError)."""
    field: str
    flag: str
    type: Any
    default: Any
    help: str
    check: Optional[Callable[[Any], None]] = None


@dataclass(frozen=True)
class Setting:
    """A config field an axis owns: its type and default, its ``lossysim train`` flag (None: ``--set`` only)
    and help, its estimate flag, and its checks (at least ``minimum``, one of ``choices``, ``check``: a
    callable raising a one-line ValueError). ``identity_at_default``: False for settings added after the first
    sweeps, left out of a run's identity at their default so those sweeps still find their runs."""
    field: str
    type: Any
    default: Any
    help: str
    flag: Optional[str] = None
    estimate: Optional[EstimateFlag] = None
    minimum: Optional[float] = None
    choices: tuple = ()
    check: Optional[Callable[[Any], None]] = None
    identity_at_default: bool = True

    def validate(self, value: Any) -> None:
        if self.minimum is not None and value is not None and value < self.minimum:
            raise ValueError(f"{self.field}={value} must be >= {self.minimum}")
        if self.choices and value not in self.choices:
            raise ValueError(f"{self.field}={value!r} must be {one_of(self.choices)}")
        if self.check is not None:
            self.check(value)


@dataclass(frozen=True)
class Counter:
    """A number a run keeps in its ``TrainState`` (and its checkpoints, where it differs from its default);
    ``per_step``: the metrics row's and summary's name of its rate per step; ``clock``: the simulated clock's
    columns its seconds add to (``run/clock.py``)."""
    name: str
    default: Any = 0.0                  # a number, or () for a list
    help: str = ""
    per_step: Optional[str] = None
    # the simulated clock's columns it adds its seconds to (``sim_time_s``, ``sim_time_s_ideal_nic``), in the
    # place ``clock_order`` gives it (the order the clock has always summed them: a float sum's digits
    # follow its order); ``scheduled``: with pipeline stages the schedule's step holds it already
    clock: tuple[str, ...] = ()
    clock_order: int = 0
    scheduled: bool = False

    def fresh(self) -> Any:
        return list(self.default) if isinstance(self.default, tuple) else self.default


@dataclass(frozen=True)
class Column:
    """A summary.csv column read off the axis's summary.json section (``number``: as a number, else as written)."""
    name: str
    key: str
    number: bool = True


@dataclass(frozen=True)
class Section:
    """The axis's report section: its title, the text before and after the text every axis's shares, its
    table's own figures (name -> (summary.csv column, scale)), and whether it names the most fragile setting."""
    title: str
    lead: str
    text: str
    extra: dict = field(default_factory=dict)
    fragile: bool = True


@dataclass(frozen=True)
class Family:
    """A traffic family the axis carries, whose loss budget ``lossysim budget`` measures (``budget/``): its
    name and label, the ``lossy_traffic`` keys that let it alone lose packets, the layout its runs take (the
    smallest that carries it between nodes), the experts to upcycle the model into (0: the model as it is;
    a job of experts in the trade), its trade's job's layout where it differs from ``layout`` (None: the
    same) and its place among every axis's families (``order``: the budget's table and its flag list them
    so)."""
    name: str
    label: str
    lossy_traffic: str
    layout: dict = field(default_factory=dict)
    upcycled: int = 0
    job: Optional[dict] = None
    order: int = 0


@dataclass(frozen=True)
class Axis:
    name: str
    label: str                          # the report's name of it (``CP``)
    size: Optional[str] = None          # the setting that sizes it (used where it is above 1)
    # other axes' size settings its groups run across too (DP's gradients: over dp x cp, Megatron's): used
    # where the product is above 1
    spans: tuple[str, ...] = ()
    mesh: Optional[str] = None          # the ``Mesh`` axis that setting sizes (None: no mesh axis)
    settings: tuple[Setting, ...] = ()
    traffic: tuple[Union[str, TrafficClass], ...] = ()
    counters: tuple[Counter, ...] = ()
    summary: Optional[str] = None       # summary.json's section
    columns: tuple[Column, ...] = ()
    section: Optional[Section] = None
    part: Optional[str] = None          # the run's ``Parts`` attribute holding it
    record: Optional[str] = None        # the module with what a run records of it (``lossysim.cp.record``)
    # the collective its messages are, which the run's recovery policy must act on (``net.recovery.require``)
    requires: Optional[str] = None
    # the module with its part of the estimate's job (``PART``, a part of ``estimate.job.Job``: its groups,
    # ``init_part``; its messages per step, ``run_part``), imported by the estimate (``lossysim.cp.estimate``)
    estimate: Optional[str] = None
    # its checks against other settings (``config/pairs.py`` runs them in the axes' order): a callable taking
    # the config, raising a one-line ValueError
    pairs: Optional[Callable[[Any], None]] = None
    # its size against a model's shape (``fits(shape, size)``, a one-line ValueError), as training refuses it:
    # the estimate and a sweep's precheck run it on a shape built on the meta device
    fits: Optional[Callable[[Any, int], None]] = None
    # its estimate-only settings (``Workload`` fields with their flags) and its checks of the estimate's flags
    # (argparse's namespace, before the config is built: a one-line ValueError naming the flag)
    workload: tuple[WorkloadFlag, ...] = ()
    estimate_check: Optional[Callable[[Any], None]] = None
    # whether training runs link events with it above 1 (``net.cable_events.refusal`` refuses the others)
    link_events: bool = True
    # the traffic families it carries whose loss budgets ``lossysim budget`` measures
    budget: tuple[Family, ...] = ()

    @property
    def classes(self) -> tuple[TrafficClass, ...]:
        return tuple(c if isinstance(c, TrafficClass) else traffic.BY_NAME[c] for c in self.traffic)

    def used(self, config) -> bool:
        """Whether ``config`` (a config or a summary's config dict) spreads over this axis."""
        if self.size is None:
            return True
        sizes = [config.get(name, 1) if isinstance(config, dict) else getattr(config, name)
                 for name in (self.size, *self.spans)]
        return math.prod(value or 1 for value in sizes) > 1

    def hooks(self):
        """The module ``record`` names (None without one)."""
        return importlib.import_module(self.record) if self.record else None

    def estimate_part(self):
        """The ``PART`` of the module ``estimate`` names (None without one)."""
        return importlib.import_module(self.estimate).PART if self.estimate else None


_axes: list[Axis] = []
_listeners: list[Callable[[], None]] = []


class _Axes(traffic.Live):
    """The declared axes in order, loaded on first use (each package's ``axis.py``)."""

    def __init__(self):
        super().__init__(lambda: tuple(_loaded()))


def _loaded() -> list[Axis]:
    if not _axes:
        for name in BUILT_IN:
            _axes.append(importlib.import_module(f"lossysim.{name}.axis").AXIS)
    return _axes


AXES = _Axes()


def get(name: str) -> Axis:
    for axis in AXES:
        if axis.name == name:
            return axis
    raise ValueError(f"axis={name!r} is not one of {', '.join(a.name for a in AXES)}")


def settings() -> tuple[Setting, ...]:
    """Every axis's settings, in the axes' order."""
    return tuple(s for axis in AXES for s in axis.settings)


def setting(name: str) -> Setting:
    return next(s for s in settings() if s.field == name)


def workload_flags() -> tuple[WorkloadFlag, ...]:
    """Every axis's estimate-only settings, in the axes' order."""
    return tuple(f for axis in AXES for f in axis.workload)


def families() -> tuple[Family, ...]:
    """Every axis's budget families, in their ``order``."""
    return tuple(sorted((f for axis in AXES for f in axis.budget), key=lambda f: f.order))


def counters() -> tuple[Counter, ...]:
    return tuple(c for axis in AXES for c in axis.counters)


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener`` whenever an axis is declared or taken back (the config rebuilds its fields)."""
    _listeners.append(listener)


def _changed() -> None:
    for listener in _listeners:
        listener()


@contextlib.contextmanager
def declared(axis: Axis) -> Iterator[Axis]:
    """``axis`` among the axes inside the ``with``: its settings config fields and flags, its classes traffic,
    its counters a run's, its columns and section the results'. Names already taken are refused."""
    taken = {a.name for a in AXES}
    fields_taken = {s.field for s in settings()}
    if axis.name in taken:
        raise ValueError(f"axis {axis.name!r} is declared already")
    clash = sorted({s.field for s in axis.settings} & fields_taken)
    if clash:
        raise ValueError(f"setting {clash[0]!r} is declared already")
    added = [c for c in axis.traffic if isinstance(c, TrafficClass)]
    for cls in added:
        traffic.add(cls)
    _axes.append(axis)
    try:
        _changed()
        yield axis
    finally:
        _axes.remove(axis)
        for cls in added:
            traffic.remove(cls.name)
        _changed()
