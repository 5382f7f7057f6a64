"""``--hours H`` with ``--link-event``: the given schedule over the H hours, beside the failures the MTTF
draws (``hours``). Each outage of the schedule (a down, every period of a flap: ``LinkSchedule.outages``
over [0, H h)) on a cable in the job's reach (``reliability.cables_in_reach``: its nodes' NIC cables and
every switch cable, each taken to carry its traffic, as the MTTF's figures take them) is met by a running
job, by the rules of the step's run of events (``fabric.events``): its path is back when the cable comes
up, or once routes reconverge (``reroute_s``) where the switch has another cable; a connection still down
after the transport's last wait fails the collective, an interruption paying the give-up time,
``restart_s`` and half a checkpoint interval of lost work (the job comes back after the restart and meets
the outage again if the cable is still down: another interruption, losing no more work); otherwise every
rank stalls until the first retry after the path is back. Outages are taken one at a time (one beginning
during another's restart is met as if the job were running) and a speed cut costs nothing here (it slows,
stalls nothing: the step's line counts it).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from ..config.fabric import link_events
from ..fabric.events import LinkSchedule, resume_at
from ..fabric.reliability import cables_in_reach


@dataclass(frozen=True)
class EventsCost:
    outages: int            # the schedule's outages on cables within the job's reach
    interruptions: int      # collectives they fail (past the transport's last wait)
    stalls: int             # outages the job lives through, stalled
    stalled_s: float        # the seconds those stalls hold every rank
    lost_s: float           # every rank's seconds lost: stalls, give-ups, restarts, redone work

    def row(self) -> dict:
        return {f"event_{k}": v for k, v in asdict(self).items()}


def schedule(text: str, fabric, hours: float) -> LinkSchedule:
    """The events ``text`` (``link_event``'s entries) over ``hours`` on ``fabric``; an event outside them is a
    one-line ValueError naming the hours."""
    run_s = hours * 3600
    try:
        return LinkSchedule(fabric, link_events(text), run_s)
    except ValueError as error:
        message = str(error)
        if "falls outside the run" in message:
            message = message.replace("the run", f"--hours {hours:g} ({run_s:g} s)").split(" (0 to")[0]
        raise ValueError(message) from None


def cost(events: LinkSchedule, nodes: int, reroute_s: float, waits: Optional[Sequence[float]],
         restart_s: float, checkpoint_s: float) -> EventsCost:
    """What ``events``' outages cost a job on the first ``nodes`` nodes (module docstring)."""
    fabric = events.fabric
    nic, switch, _ = cables_in_reach(fabric, nodes)
    reach = set(nic) | set(switch)
    give_up = sum(waits) if waits is not None else 0.0
    outages = interruptions = stalls = 0
    stalled_s = lost_s = 0.0
    seen = set()
    for index in sorted(events.events):
        physical = min(index, events._reverse(index))     # both directions are one cable: met once
        if physical in seen or not reach.intersection((index, events._reverse(index))):
            continue
        seen.add(physical)
        around = reroute_s if events.reroutable(index) else math.inf
        for down_at, up_at in events.outages(index, 0.0, events.run_s):
            outages += 1
            n, stall = _met(down_at, min(up_at, down_at + around), waits, restart_s)
            interruptions += n
            stalls += n == 0
            stalled_s += stall
            lost_s += n * (give_up + restart_s) + (checkpoint_s / 2 if n else 0.0) + stall
    return EventsCost(outages, interruptions, stalls, stalled_s, lost_s)


def _met(down_at: float, back: float, waits, restart_s: float) -> tuple[int, float]:
    """(interruptions, seconds stalled) of one outage whose path is back at ``back``."""
    t, failures = down_at, 0
    while True:
        resumed, failed = resume_at(t, back, waits)
        if not failed:
            return failures, resumed - t
        failures += 1
        t = resumed + restart_s
        if t >= back:      # the cable is up when the job comes back
            return failures, 0.0
