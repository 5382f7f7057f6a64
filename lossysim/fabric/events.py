"""Link events in time: a cable that goes down, flaps or trains down to a lower speed, and what that
does to a call whose flows cross it.

An event names a cable and a schedule (``parse_link_event``, or a YAML list, ``load_link_events``):

- ``CABLE:down:at=T,for=D``: down from T for D seconds (no ``for``: to the run's end);
- ``CABLE:flap:at=T,period=P,down=D[,for=W]``: down D seconds at the start of every P from T;
- ``CABLE:speed:at=T,fraction=F[,for=D]``: up at F of its speed (a link trained down).

A physical cable fails as a whole: an event on ``leaf3-spine1`` holds for ``spine1-leaf3`` too.
While a cable is down every packet on it is lost. A connection whose packets nothing acknowledges
waits its transport's timers in a row (``timing.retransmission.outage_waits``: an RC queue pair the
ACK timeout before each of 7 retries and once after, 34.4 s at NCCL_IB_TIMEOUT 20); the first retry
sent once its path is back goes through, so a shorter outage ends the call later by the outage and
the rest of the pending timer. A path is back when the cable comes up, or when routes reconverge
around it (``REROUTE_S``) if the cable's switch has another cable of the same kind to send on: a NIC's
cable to its leaf has none (one NIC per rail, one cable). A connection still down after its last wait
fails the collective: the job pays ``restart_s`` and redoes the steps since its last checkpoint
(``run_steps``), as ``max_failures`` charges a failed collective in training.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import yaml

from .graph import Fabric

KINDS = ("down", "flap", "speed")
KEYS = {"down": ("at", "for"), "flap": ("at", "period", "down", "for"), "speed": ("at", "fraction", "for")}
# How long routes take to move flows off a dead cable (seconds), each from its source:
REROUTE_S = {
    # leaf-spine Ethernet, ECMP member withdrawn by BGP with fast fallover on link down: "sub-second"
    # (RFC 7938, section 7); taken at its bound
    "ecmp": 1.0,
    # the same with BFD at 50 ms x 3 detecting the loss (a common profile; RFC 5880)
    "ecmp-bfd": 0.15,
    # InfiniBand SHIELD (fast link fault recovery, on by default in opensm's shield_mode): the switch picks
    # another output port itself; Mellanox (2017) gives it as 5,000x faster than the subnet manager's
    # 10-20 s recomputation on a large fabric: 10 s / 5000
    "ib-shield": 0.002,
    # InfiniBand without it: the subnet manager recomputes routes, 10-20 s on a large fabric (same source)
    "ib-sm": 10.0,
    # no reroute: a flow waits for its cable
    "none": math.inf,
}


@dataclass(frozen=True)
class LinkEvent:
    cable: str
    kind: str
    at: float
    duration: float = math.inf    # seconds the event lasts (inf: to the run's end)
    period: float = 0.0           # flap: seconds from one down to the next
    down: float = 0.0             # flap: seconds down each period
    fraction: float = 1.0         # speed: the share of its speed the cable keeps

    def text(self) -> str:
        keys = {"at": self.at, "period": self.period, "down": self.down, "fraction": self.fraction,
                "for": self.duration}
        return f"{self.cable}:{self.kind}:" + ",".join(f"{k}={keys[k]:g}" for k in KEYS[self.kind]
                                                       if not (k == "for" and math.isinf(self.duration)))


def parse_link_event(text) -> LinkEvent:
    """``CABLE:KIND:key=value,...`` (module docstring) -> a LinkEvent, checked alone (the fabric and
    the run are checked by ``LinkSchedule``)."""
    if isinstance(text, LinkEvent):
        return text
    if isinstance(text, dict):
        return _event(text.get("cable"), text.get("kind"), {k: v for k, v in text.items() if k not in ("cable", "kind")},
                      f"link event {text!r}")
    cable, _, rest = str(text).partition(":")
    kind, _, args = rest.partition(":")
    given = {}
    for part in filter(None, (p.strip() for p in args.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"link_event={text!r}: {part!r} must be key=value")
        given[key.strip()] = value.strip()
    return _event(cable.strip(), kind.strip(), given, f"link_event={text!r}")


def _event(cable, kind, given: dict, what: str) -> LinkEvent:
    if not cable or kind not in KINDS:
        raise ValueError(f"{what} must be CABLE:KIND:key=value,... with KIND one of {', '.join(KINDS)} "
                         "(e.g. leaf3-spine1:down:at=120,for=30)")
    unknown = sorted(set(given) - set(KEYS[kind]))
    if unknown:
        raise ValueError(f"{what}: {kind} takes {', '.join(KEYS[kind])}, not {unknown[0]!r}")
    values = {}
    for key, value in given.items():
        try:
            values[key] = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{what}: {key}={value!r} is not a number") from None
        if math.isnan(values[key]) or values[key] < 0:
            raise ValueError(f"{what}: {key}={value!r} must be a number >= 0")
    needed = [k for k in KEYS[kind] if k != "for" and k not in values]
    if needed:
        raise ValueError(f"{what}: {kind} needs {needed[0]}=")
    event = LinkEvent(str(cable), kind, values["at"], values.get("for", math.inf), values.get("period", 0.0),
                      values.get("down", 0.0), values.get("fraction", 1.0))
    if event.duration <= 0:
        raise ValueError(f"{what}: for={event.duration:g} must be > 0 seconds")
    if kind == "flap" and not 0 < event.down < event.period:
        raise ValueError(f"{what}: a flap needs 0 < down < period (down={event.down:g}, period={event.period:g})")
    if kind == "speed" and not 0 < event.fraction < 1:
        raise ValueError(f"{what}: fraction={event.fraction:g} must be between 0 and 1 (0: use down; 1: no event)")
    return event


def load_link_events(source: Union[str, Path, Sequence]) -> list[LinkEvent]:
    """A YAML file (or an already read list): each entry an event string or a mapping ``{cable, kind,
    at, for, period, down, fraction}``."""
    entries = source
    if isinstance(source, (str, Path)):
        try:
            entries = yaml.safe_load(Path(source).read_text())
        except (OSError, yaml.YAMLError) as error:
            raise ValueError(f"link events file {source}: {str(error).splitlines()[0]}") from None
    if not isinstance(entries, list):
        raise ValueError(f"link events {source}: expected a list of events")
    return [parse_link_event(entry) for entry in entries]


class LinkSchedule:
    """The events of one run of ``run_s`` seconds on ``fabric``, checked: an unknown cable, an event
    starting before 0 or ending after the run, or two events on one cable that say different things at
    once (down and a flap's up time, two flaps, two speeds) is a one-line ValueError. A cable down
    while trained down is down."""

    def __init__(self, fabric: Fabric, events: Iterable, run_s: float):
        if not run_s > 0 or math.isinf(run_s):
            raise ValueError(f"run_s={run_s!r} must be a number of seconds > 0")
        self.fabric, self.run_s = fabric, float(run_s)
        self.events: dict[int, list[LinkEvent]] = {}
        self._reroutable: dict[int, bool] = {}
        for given in events:
            event = parse_link_event(given)
            index = fabric.cable(event.cable)
            end = event.at + event.duration
            if event.at >= self.run_s or (not math.isinf(end) and end > self.run_s + 1e-9):
                raise ValueError(f"link event {event.text()} falls outside the run (0 to {self.run_s:g} s)")
            for cable in (index, self._reverse(index)):
                for other in self.events.get(cable, []):
                    self._check_pair(other, event)
                self.events.setdefault(cable, []).append(event)

    def _reverse(self, index: int) -> int:
        cable = self.fabric.cables[index]
        suffix = cable.name[len(f"{cable.src}-{cable.dst}"):]
        return self.fabric.index[f"{cable.dst}-{cable.src}{suffix}"]

    def _check_pair(self, a: LinkEvent, b: LinkEvent) -> None:
        ends = [min(e.at + e.duration, self.run_s) for e in (a, b)]
        if max(a.at, b.at) >= min(ends):
            return
        kinds = {a.kind, b.kind}
        if kinds == {"down"} or "speed" in kinds and kinds != {"speed"}:
            return                   # a down over a down is one outage; down beats slow
        if kinds == {"speed"} and a.fraction == b.fraction:
            return
        raise ValueError(f"link events {a.text()} and {b.text()} overlap and contradict each other")

    # -- state at a time -------------------------------------------------------------------------------
    def index(self, cable) -> int:
        return cable if isinstance(cable, (int, np.integer)) else self.fabric.cable(cable)

    def down(self, cable, t: float) -> bool:
        """Whether ``cable`` (a name or an index) is down at ``t``."""
        return any(a <= t < b for a, b in self.outages(cable, t, t + 1e-12))

    def speed(self, cable, t: float) -> float:
        """The share of its speed ``cable`` runs at at ``t``: 0 while down, a speed event's fraction, else 1."""
        if self.down(cable, t):
            return 0.0
        for e in self.events.get(self.index(cable), []):
            if e.kind == "speed" and e.at <= t < min(e.at + e.duration, self.run_s):
                return e.fraction
        return 1.0

    def outages(self, cable, start: float, end: float) -> list[tuple[float, float]]:
        """``cable``'s down intervals that meet [start, end), merged, in order (a flap's periods worked
        out only over the window, so a month of flaps costs what the window holds)."""
        spans = []
        for e in self.events.get(self.index(cable), []):
            stop = min(e.at + e.duration, self.run_s)
            if e.kind == "down":
                spans.append((e.at, stop))
            elif e.kind == "flap":
                first = max(0, math.floor((start - e.at) / e.period))
                k = first
                while e.at + k * e.period < min(end, stop):
                    a = e.at + k * e.period
                    spans.append((a, min(a + e.down, stop)))
                    k += 1
        merged: list[list[float]] = []
        for a, b in sorted(s for s in spans if s[1] > start and s[0] < end):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return [(a, b) for a, b in merged]

    def changes(self, cables: Iterable[int], start: float, end: float) -> list[float]:
        """Times in (start, end) where a speed or an outage of ``cables`` begins or ends."""
        out = set()
        for cable in cables:
            for a, b in self.outages(cable, start, end):
                out.update((a, b))
            for e in self.events.get(cable, []):
                if e.kind == "speed":
                    out.update((e.at, min(e.at + e.duration, self.run_s)))
        return sorted(t for t in out if start < t < end)

    def reroutable(self, cable) -> bool:
        """Whether routes can move a flow off ``cable``: its switch has another cable up to a switch of
        the same tier (a NIC, single-homed, has none)."""
        index = self.index(cable)
        if index not in self._reroutable:
            self._reroutable[index] = self._around(self.fabric.cables[index])
        return self._reroutable[index]

    def _around(self, c) -> bool:
        if self.fabric.tier(c.src) == "nic" or self.fabric.tier(c.dst) == "nic":
            return False
        tier = self.fabric.tier(c.dst)
        return any(o.src == c.src and o.name != c.name and self.fabric.tier(o.dst) == tier
                   for o in self.fabric.cables)


@dataclass(frozen=True)
class CallEnd:
    """When a call ends (or fails), and the seconds outages and speed cuts added to it."""
    end_s: float
    failed: bool
    stalled_s: float
    slowed_s: float
    dropped: bool = False    # drop: an outage met the call and lost its packets (it did not wait)


def resume_at(down_at: float, back: float, waits: Optional[Sequence[float]]) -> tuple[float, bool]:
    """When a connection cut at ``down_at`` whose path is back at ``back`` goes on (its first retry at
    or after ``back``), or the time it gives up and True."""
    if waits is None:
        return back, False
    t = down_at
    for wait in waits[:-1]:
        t += wait
        if t >= back:
            return t, False
    return t + waits[-1], True


def call_end(schedule: LinkSchedule, loads: np.ndarray, start: float, seconds: float,
             waits: Optional[Sequence[float]], reroute_s: float = REROUTE_S["ecmp"], drop: bool = False) -> CallEnd:
    """When a call that starts at ``start`` and takes ``seconds`` loss-free ends under ``schedule``.
    ``loads``: bytes per directed cable (``load.cable_loads``): only cables that carry some matter,
    and while some are slowed the call goes at the rate its most loaded cable allows then (its step
    time at full speed over its step time at the speeds of the moment). An outage of any of them stops
    it (``resume_at``); a flow rerouted off a cable is assumed to find room on the others. ``drop``
    (transport=drop): nothing waits for a lost packet, so an outage costs no time; the call is marked
    ``dropped`` when one met it."""
    per_byte = loads * 8 / (np.array([c.gbps for c in schedule.fabric.cables]) * 1e9)
    crossed = np.flatnonzero(loads > 0)
    if not len(crossed) or seconds <= 0:
        return CallEnd(start + max(seconds, 0.0), False, 0.0, 0.0)
    full = float(per_byte[crossed].max())
    # only the crossed cables with events can hold the call; the others' time never changes
    evented = [int(c) for c in crossed if int(c) in schedule.events]
    others = loads > 0
    others[evented] = False
    steady = float(per_byte[others].max(initial=0.0))
    # the slowest the call can go (every cable at its lowest speed): the stretches are worked out only up
    # to when it must have ended, so a flap with no end (training's horizon) costs what the call spans
    slowest = max([steady, *(per_byte[c] / min([e.fraction for e in schedule.events[c] if e.kind == "speed"],
                                               default=1.0) for c in evented)])
    t, left, stalled, slowed = float(start), 1.0, 0.0, 0.0
    while True:
        outage = None if drop else _next_outage(schedule, evented, t, reroute_s)
        horizon = outage[0] if outage else math.inf
        # the work goes on piecewise at each stretch's rate until the outage (or the end)
        while t < horizon:
            stop = min(horizon, t + 2 * left * seconds * slowest / full + 1.0)
            points = [t, *schedule.changes(evented, t, min(stop, t + 10 * schedule.run_s)), stop]
            for a, b in zip(points, points[1:]):
                # a cable down here has had its flows rerouted (else the outage would come first): its
                # bytes are assumed to find room elsewhere, so it holds nothing back
                now = max([steady, *(per_byte[c] / (schedule.speed(c, (a + b) / 2) or 1.0) for c in evented)])
                rate = full / now
                if (b - a) * rate / seconds >= left:
                    done = a + left * seconds / rate
                    slowed += (done - a) - left * seconds
                    met = drop and any(schedule.outages(c, start, done) for c in evented)
                    return CallEnd(done, False, stalled, slowed, met)
                left -= (b - a) * rate / seconds
                slowed += (b - a) * (1 - rate)
            t = stop
        down_at, back = outage
        resumed, failed = resume_at(down_at, back, waits)
        if failed:
            return CallEnd(resumed, True, stalled + resumed - down_at, slowed)
        stalled += resumed - down_at
        t = resumed


def _next_outage(schedule: LinkSchedule, crossed: Sequence[int], t: float,
                 reroute_s: float) -> Optional[tuple[float, float]]:
    """The first outage the call meets at or after ``t``: (when its packets start being lost, when a path
    is back), the cables' outages joined (a flow is down while any of its cables is). An outage routes
    have already gone around by ``t`` is none."""
    window = 60.0
    while True:     # a window that doubles: a month of flaps is not worked out for every call
        spans = []
        for cable in crossed:
            for a, b in schedule.outages(cable, t, t + window):
                back = min(b, a + (reroute_s if schedule.reroutable(cable) else math.inf))
                if back > t:
                    spans.append((max(a, t), back))
        if spans:
            break
        if t + window > schedule.run_s:
            return None
        window *= 2
    spans.sort()
    first, back = spans[0]
    for a, b in spans[1:]:
        if a <= back:
            back = max(back, b)
    return first, back


@dataclass(frozen=True)
class RunEnd:
    """A run of steps under a schedule: when it ended, its failed collectives, the seconds outages held
    calls, the seconds restarts and redone steps cost; the steps a speed cut slowed, the calls an outage
    ended later (or, with ``drop``, met) and the seconds speed cuts added."""
    end_s: float
    failures: int
    stalled_s: float
    restart_s: float
    slowed_steps: int = 0
    later_calls: int = 0
    slowed_s: float = 0.0
    dropped_calls: int = 0


def run_steps(schedule: LinkSchedule, loads: np.ndarray, steps: int, compute_s: float, comm_s: float,
              waits: Optional[Sequence[float]], reroute_s: float = REROUTE_S["ecmp"], checkpoint_every: int = 0,
              restart_s: float = 300.0, max_failures: int = 100, lost_steps: Optional[int] = None,
              drop: bool = False) -> RunEnd:
    """``steps`` training steps from t = 0, each ``compute_s`` of compute then one call of ``comm_s``
    loss-free on ``loads``. A failed call costs ``restart_s``, then the job resumes from its last
    checkpoint (every ``checkpoint_every`` steps; 0: from the start; ``lost_steps``: that many steps
    back, as training's ``restart_lost_steps`` charges it); more than ``max_failures`` failures is an
    error. ``drop``: ``call_end``'s."""
    t, done, saved, failures, stalled, lost = 0.0, 0, 0, 0, 0.0, 0.0
    slowed_steps = later = dropped = 0
    slowed_s = 0.0
    while done < steps:
        end = call_end(schedule, loads, t + compute_s, comm_s, waits, reroute_s, drop)
        if end.failed:
            failures += 1
            if failures > max_failures:
                raise ValueError(f"the run failed more than max_failures={max_failures} times by t={end.end_s:g} s")
            step_start = t
            t = end.end_s + restart_s
            if lost_steps is not None:
                saved = max(0, done - int(lost_steps))
            lost += restart_s + (end.end_s - step_start) + (done - saved) * (compute_s + comm_s)
            done = saved
            continue
        stalled += end.stalled_s
        slowed_s += end.slowed_s
        slowed_steps += end.slowed_s > 1e-12 * max(comm_s, 1.0)
        later += end.stalled_s > 0
        dropped += end.dropped
        t, done = end.end_s, done + 1
        if checkpoint_every and done % checkpoint_every == 0:
            saved = done
    return RunEnd(t, failures, stalled, lost, slowed_steps, later, slowed_s, dropped)
