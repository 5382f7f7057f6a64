"""Link events in training: a fabric's cables down or slowed on the run's simulated clock
(``fabric.events``' schedule), and what they do to each call whose flows cross them.

The time base is the run's simulated clock: before each step the run sets ``now`` to its simulated time
so far (``run.clock``: compute, traffic, restarts), which every rank computes alike, so sim and dist meet
the same events. Every call of a step is taken to start at the step's start (the simplification, stated
in docs/fabric.md: an outage that begins inside a step is met from the next one).

A call's loss-free seconds are the clock's: its transfer's times the network's collision factor on shared
cables (``run.fabric_record.stretch_clocks``), so an outage meets a stretched call, and its end is timed,
on the stretched seconds. A call's loads are its packets on each directed cable (the transfer's packets
per link, each link's share on each of its flows' routes, ``Placement.paths``). With a retransmitting transport the call ends
when ``fabric.events.call_end`` says (an outage: later by the outage and the pending timer; a speed cut:
stretched by its most loaded slowed cable); the seconds it adds go on the network's clock, under the
run's nic and, without ever failing, under the ideal one. A call still down after the transport's
retries fails the collective: the run counts it (at most once a step: the job aborts at its first failed
collective) and ``run.clock`` charges it ``restart_s`` and ``restart_lost_steps``, as it charges any
failure. The data of a retransmitted call arrive exact (a failed one is redone after the restart).

With ``drop`` nothing waits for a lost packet: a call whose flows cross a cable down at ``now`` loses
every packet of those flows (``CableChains`` marks them lost beside its lossy cables' draws, which go on
as without the event, so every other packet's fate is the one a run without events draws) and costs no
time for it; a speed cut still stretches it. A network whose links cross a cable some event takes down
draws under ``drop`` even on a fabric without a lossy cable (``losing``), and the rows of its calls that
cross one join the transfer's lossy rows (``widen``); without events nothing of this runs.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import numpy as np
import torch

from ..fabric.events import REROUTE_S, LinkSchedule, call_end
from ..timing.retransmission import outage_waits

# The run's events while it trains (one run a process at a time: ``active``); None: no events.
ACTIVE: Optional["RunEvents"] = None
# A training run's events last to its end, unknown in advance: a horizon no run reaches.
HORIZON_S = 1e9


class RunEvents:
    """One training run's link schedule, its clock's ``now`` and the steps a collective failed in."""

    def __init__(self, schedule: LinkSchedule, reroute: str = "ecmp", ib_timeout: int = 20):
        self.schedule, self.reroute_s, self.ib_timeout = schedule, REROUTE_S[reroute], int(ib_timeout)
        self.now = 0.0
        self.failed_at: set = set()     # the step starts at which some collective failed
        self._loads: dict = {}
        self._losing: dict = {}
        # the cables an event takes down at some time (a speed cut alone loses nothing)
        self.downable = frozenset(c for c, events in schedule.events.items()
                                  if any(e.kind in ("down", "flap") for e in events))

    def at(self, now: float) -> None:
        self.now = float(now)

    @property
    def failures(self) -> int:
        return len(self.failed_at)

    def loads(self, network, transfer) -> np.ndarray:
        """Bytes of ``transfer`` on each directed cable of the network's fabric (once per transfer)."""
        key = (id(network), id(transfer))
        if key not in self._loads:
            if len(self._loads) > 4096:   # an all-to-all builds a transfer a call: hold a bounded few
                self._loads.clear()
            placement = network.spec.cables
            out = np.zeros(len(placement.fabric.cables))
            packets = transfer.sent.sum(0).cpu().numpy()
            for link in np.flatnonzero(packets):
                src, dst = network.links[int(link)]
                for cables, modulus, _ in placement.paths(src, dst):
                    for cable in cables:
                        out[cable] += packets[link] * network.spec.payload_bytes / modulus
            self._loads[key] = (transfer, out)     # the transfer held: its id stays its own
        return self._loads[key][1]

    def down(self, spec) -> frozenset:
        """The cables down at ``now`` whose packets a network of ``spec`` loses (none for a transport that
        repairs: its time is ``charge``'s)."""
        if spec.cables is None or spec.transport_model.repairs or not self.downable:
            return frozenset()
        return frozenset(c for c in self.downable if self.schedule.down(c, self.now))

    def _crossing(self, placement, src: int, dst: int) -> bool:
        return any(c in self.downable for cables, _, _ in placement.paths(src, dst) for c in cables)

    def losing(self, network) -> bool:
        """Whether ``network`` can lose packets to an outage: ``drop``, and a link of it crosses a cable some
        event takes down (once per network)."""
        key = id(network)
        if key not in self._losing:
            spec = network.spec
            self._losing[key] = (network, spec.cables is not None and not spec.transport_model.repairs and
                                 any(spec.topology.link_class(s, d) != "intra" and
                                     self._crossing(spec.cables, s, d) for s, d in network.links))
        return self._losing[key][1]

    def widen(self, network, transfer) -> None:
        """Add to ``transfer``'s lossy rows those whose links cross a cable some event takes down (once)."""
        if getattr(transfer, "_widened", False) or not self.losing(network):
            return
        spec, rows = network.spec, set(transfer.lossy_rows)
        for r, (src, dst) in enumerate(transfer.sched.links):
            if spec.topology.link_class(src, dst) != "intra" and self._crossing(spec.cables, src, dst):
                rows.add(r)
        transfer.lossy_rows = sorted(rows)
        for cached in ("_lossy_np",):      # what a draw derived from the old rows
            transfer.__dict__.pop(cached, None)
        transfer.host_steps = None
        transfer._widened = True

    def charge(self, network, transfer) -> Optional[torch.Tensor]:
        """The seconds ``transfer``'s call at ``now`` is later by, [run's nic, ideal nic] (None: it meets
        no event); a failed call is recorded."""
        if network.spec.cables is None or transfer.ideal <= 0:
            return None
        loads = self.loads(network, transfer)
        if not any(loads[c] > 0 for c in self.schedule.events):
            return None
        spec = network.spec
        rtt = 2 * spec.link_inter.alpha
        drop = not spec.transport_model.repairs     # nothing waits: the outage lost the packets instead
        # the call as the clock times it: on shared cables its loss-free seconds stretched by the collision
        # factor (``run.fabric_record.stretch_clocks``; 1.0 otherwise, the same seconds to the bit), so an
        # outage meets it, and its end is timed, on the seconds it really spans
        seconds = transfer.ideal * network.time.stretch
        ends = [call_end(self.schedule, loads, self.now, seconds, None if drop else waits, self.reroute_s,
                         drop) for waits in (outage_waits(spec.nic_model, self.ib_timeout, rtt_s=rtt), None)]
        if ends[0].failed:
            self.failed_at.add(self.now)
        extra = [max(e.end_s - self.now - seconds, 0.0) for e in ends]
        if not any(extra):
            return None
        return torch.tensor(extra, dtype=torch.float64, device=transfer.link_ids.device)


def refusal(config, sizes: Sequence[str] = ()) -> Optional[str]:
    """Why training refuses ``config``'s link events (None: it runs them): only what is built and tested.
    ``sizes``: the settings sizing the axes training does not run them over yet (each axis declares it:
    ``Axis.link_events``; the network stage reads no declarations)."""
    if not str(config.link_event or "").strip():
        return None
    if config.transport not in ("retransmit", "drop"):
        return (f"link_event: training does not run link events under transport={config.transport} yet (only "
                "retransmit and drop; the estimate runs them)")
    if config.pp_size > 1 and (config.transport != "drop" or config.dp_size > 1):
        return ("link_event: training does not run link events with pp_size above 1 under transport="
                f"{config.transport} and dp_size={config.dp_size} yet (only drop, dp_size 1)")
    if any(getattr(config, size, 1) > 1 for size in sizes):
        return "link_event: training does not run link events with tp, cp or ep sizes above 1 yet (dp and pp alone)"
    if config.checkpoint_every:
        return ("link_event: training does not run link events with checkpoint_every > 0 yet (a resumed run "
                "would forget the collectives they failed)")
    return None


@contextlib.contextmanager
def active(schedule: Optional[LinkSchedule], reroute: str, ib_timeout: int):
    """Run ``schedule``'s link events (None: none) while the block trains (the run builds the schedule
    from its config: the network stage reads no config)."""
    global ACTIVE
    if schedule is None:
        yield None
        return
    previous, ACTIVE = ACTIVE, RunEvents(schedule, reroute, ib_timeout)
    try:
        yield ACTIVE
    finally:
        ACTIVE = previous


def failures() -> int:
    return ACTIVE.failures if ACTIVE is not None else 0
