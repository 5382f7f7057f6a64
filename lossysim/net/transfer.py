"""One collective on one message shape: its packets, the sends of its schedule, the links they use,
how long it takes without loss and what its repairs need. Built once per (collective, size, dtype,
device) and reused by every call of that shape, so a call does no Python work per send.

Time: a ring, tree, NVLS or NVLS-tree collective takes what NCCL's cost model says
(``lossysim.timing.nccl``: its latency, and its wire bytes over the bus bandwidth our links give;
``algorithm: auto`` first asks the model which algorithm NCCL runs); a send, NCCL's p2p time over its
one link (``nccl.p2p_time``); the direct exchange (not an NCCL algorithm) takes one alpha-beta step
with its ports shared (``timing.send_times``). Repairs add to that step by step
(``lossysim.net.transport``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from .. import timing
from ..timing import nccl
from .algorithms import IN_SWITCH, PHASES, Schedule, schedule
from .receivers import Delivery, path_weights
from .spec import NetworkSpec
from .transport import Sends


def packets(payload_bytes: int, numel: int, dtype: torch.dtype) -> tuple[int, int]:
    """(elements per packet, packets per message) for a message of ``numel`` elements: the last packet
    may be partial."""
    per_packet = max(1, payload_bytes // dtype.itemsize)
    return per_packet, -(-int(numel) // per_packet)


@dataclass
class Step:
    """One step's sends and what the transport needs of them."""
    sends: list                        # send indices
    rows: list                         # their schedule link rows
    phase: int
    transport: Sends                   # packets, tau, rtt, window, tails per send
    slots: torch.Tensor                # [sends] counter slot: phase * links + link id
    budget: float                      # seconds of repairs a deadline allows this step


@dataclass
class Transfer:
    """Everything a call of this shape needs, derived once from the schedule, topology and time model."""
    sched: Schedule
    per_packet: int
    links: int                         # the network's directed links (counter slots are phase * links + link)
    link_ids: torch.Tensor             # [rows] network link id of each schedule link
    lossy_rows: list                   # schedule rows whose links can lose packets
    factor: torch.Tensor               # [sends] weight of a delivered packet under rescale
    lengths: torch.Tensor              # [rows] packets per link
    width: int                         # max(lengths)
    sent: torch.Tensor                 # [phases, links] packets a call sends
    steps: list                        # the steps with traffic
    ideal: float                       # loss-free duration of the collective
    choice: nccl.Estimate              # how it runs: NCCL's (algorithm, protocol, channels) and its time
    _weights: dict = field(default_factory=dict)
    host_steps: Optional[list] = None  # the steps as the fates keepers index them (``fates.HostStep``), once needed
    _slots: Optional[torch.Tensor] = None

    @property
    def slots(self) -> torch.Tensor:
        """``[rows, width]`` counter slot (phase * links + link id) of each packet, built on first use: only
        a call whose draw is counted whole reads it (a repaired call counts step by step, by ``Step.slots``)."""
        if self._slots is None:
            phase = self.sched.packet_phases(self.link_ids.device).long()
            self._slots = phase * self.links + self.link_ids.unsqueeze(1) if phase.numel() else phase
        return self._slots

    def weights(self, dtype: torch.dtype) -> Delivery:
        """What each path carries when delivered under ``rescale`` (``receivers.path_weights``)."""
        if dtype not in self._weights:
            self._weights[dtype] = path_weights(self.sched, self.factor, dtype)
        return self._weights[dtype]


def build(spec: NetworkSpec, links: list, collective: str, numel: int, dtype: torch.dtype, device,
          pair: Optional[tuple[int, int]] = None) -> Transfer:
    """The Transfer of one collective of ``numel`` elements of ``dtype`` on ``device`` (a send: from
    ``pair[0]`` to ``pair[1]``)."""
    per_packet, n_packets = packets(spec.payload_bytes, numel, dtype)
    itemsize = dtype.itemsize
    algorithm = spec.algorithm
    if algorithm == "auto":   # a send is one message on one link whatever the algorithm (NCCL's p2p)
        algorithm = "ring" if collective == "send" else choose(spec, collective, numel * itemsize,
                                                               per_packet * itemsize).algorithm
    sched = schedule(algorithm, collective, spec.ranks, n_packets, pair,
                     spec.topology.ranks_per_node if algorithm in IN_SWITCH else None)
    chosen = loss_free(spec, sched, numel * itemsize, per_packet * itemsize)
    return assemble(spec, links, sched, per_packet, itemsize, chosen, device, numel=numel)


def assemble(spec: NetworkSpec, links: list, sched: Schedule, per_packet: int, itemsize: int,
             chosen: nccl.Estimate, device, numel: Optional[int] = None,
             sizes: Optional[Sequence[int]] = None) -> Transfer:
    """The Transfer of a schedule whose loss-free time is ``chosen``: its links, counters' slots and the
    transport's steps. Each send carries packets of the one message of ``numel`` elements, or (an
    all-to-all's sends, each its own message) ``sizes[i]`` elements for send i."""
    topology = spec.topology
    index = {link: i for i, link in enumerate(links)}
    link_ids = torch.tensor([index[link] for link in sched.links], dtype=torch.long, device=device)
    if spec.cables is None:
        lossy_rows = [r for r, (src, dst) in enumerate(sched.links) if topology.lossy(src, dst)]
        rescale = 1.0 / (1.0 - spec.loss.loss_rate) if spec.loss.loss_rate < 1 else 0.0
        factor = torch.tensor([rescale if topology.lossy(s.src, s.dst) else 1.0 for s in sched.sends],
                              dtype=torch.float64, device=device)
    else:   # each link at the loss its route's cables give it
        lossy_rows = [r for r, (src, dst) in enumerate(sched.links) if spec.link_lossy(src, dst)]
        rate = {link: spec.link_rate(*link) for link in set(sched.links)}
        factor = torch.tensor([1.0 / (1.0 - rate[s.src, s.dst]) if rate[s.src, s.dst] < 1 else 0.0
                               for s in sched.sends], dtype=torch.float64, device=device)
    # packets each (phase, link) sends: one bincount (a 128-rank ring has 32,512 sends)
    slot = [PHASES.index(s.phase) * len(links) + index[sched.links[row]] for s, row in zip(sched.sends, sched.send_row)]
    sent = torch.from_numpy(np.bincount(np.asarray(slot, dtype=np.int64), [s.packets for s in sched.sends],
                                        minlength=len(PHASES) * len(links)).astype(np.int64))
    sent = sent.view(len(PHASES), len(links)).to(device)
    if sizes is None:
        sizes = [max(0, min(numel, (s.first + s.packets) * per_packet) - s.first * per_packet) for s in sched.sends]
    ideal = chosen.seconds
    steps = _steps(spec, sched, link_ids, len(links), sizes, itemsize, ideal, device)
    return Transfer(sched, per_packet, len(links), link_ids, lossy_rows, factor,
                    torch.tensor(sched.link_packets, dtype=torch.long, device=device),
                    max(sched.link_packets, default=0), sent, steps, ideal, chosen)


def choose(spec: NetworkSpec, collective: str, message_bytes: int, packet_bytes: int) -> nccl.Estimate:
    """What NCCL's tuner runs for this collective and message on the spec's links
    (``nccl.choose``); a policy that replays every send between ranks (``stale``, ``error_feedback``)
    cannot run a reduction in the switch, so it is offered rings and trees only."""
    allowed = nccl.ALGORITHMS if not spec.recovery_model.send_by_send else ("tree", "ring")
    return nccl.collective_estimate(collective, "auto", spec.ranks, spec.topology.nodes, message_bytes, packet_bytes,
                                    spec.link_intra, spec.link_inter, spec.bus_bandwidth(), spec.arch, allowed)


def loss_free_time(spec: NetworkSpec, sched: Schedule, message_bytes: int, packet_bytes: int) -> float:
    """A collective's loss-free duration: NCCL's model for ring, tree, NVLS, NVLS-tree and a send, one
    alpha-beta step for direct (``loss_free``'s seconds)."""
    return loss_free(spec, sched, message_bytes, packet_bytes).seconds


def loss_free(spec: NetworkSpec, sched: Schedule, message_bytes: int, packet_bytes: int) -> nccl.Estimate:
    """A collective's loss-free duration and how it runs: (algorithm, protocol, channels), as NCCL's
    model times it (a send: ``p2p``, LL or Simple, one channel; direct: no protocol, no channels)."""
    topology = spec.topology
    R, nodes = spec.ranks, topology.nodes
    if sched.collective == "send":
        link = spec.link(topology.link_class(*sched.pair))
        wire = link.wire_bytes(message_bytes, -(-message_bytes // packet_bytes)) if message_bytes else 0
        return nccl.p2p_estimate(message_bytes, wire, link)._replace(algorithm="p2p", channels=1)
    if R < 2 or message_bytes == 0:
        return nccl.Estimate(0.0, 0.0, 0.0, "", sched.algorithm, 0)
    if sched.algorithm == "direct":
        sends = [(s.src, s.dst, message_bytes, sched.n_packets, spec.link(topology.link_class(s.src, s.dst)),
                  topology.link_class(s.src, s.dst)) for s in sched.sends]
        seconds = timing.step_time(sends)
        return nccl.Estimate(seconds, 0.0, seconds, "", "direct", 0)
    return nccl.collective_estimate(sched.collective, sched.algorithm, R, nodes, message_bytes, packet_bytes,
                                    spec.link_intra, spec.link_inter, spec.bus_bandwidth(), spec.arch)


def _steps(spec, sched, link_ids, n_links, sizes, itemsize, ideal, device) -> list:
    """Per step with traffic: its sends as the transport needs them (``sizes``: each send's elements)."""
    topology, nic = spec.topology, spec.nic_model
    # One pass over the sends (a 128-rank ring has 32,512): each step's sends with packets, in schedule order,
    # and the step in which each link sends for the last time (its connections end there).
    last_step, by_step = {}, {}
    for i, s in enumerate(sched.sends):
        if s.packets:
            last_step[(s.src, s.dst)] = max(last_step.get((s.src, s.dst), -1), s.step)
            by_step.setdefault(s.step, []).append(i)
    active = sorted(by_step)
    steps = []
    link_of = {pair: spec.link(topology.link_class(*pair)) for pair in last_step}   # a ring's 128 links
    window_of = {id(link): timing.window_packets(link, spec.payload_bytes) for link in link_of.values()}
    for k in active:
        sends = by_step[k]
        hops = [sched.sends[i] for i in sends]
        links = [link_of[s.src, s.dst] for s in hops]
        payload = [sizes[i] * itemsize for i in sends]
        final = [last_step[(s.src, s.dst)] == k for s in hops]
        width = max(s.packets for s in hops)
        tails = np.zeros((len(hops), width), dtype=np.bool_)   # calloc'd, written in numpy: few are set
        for i, (s, is_final) in enumerate(zip(hops, final)):
            if is_final and not nic.rack:  # the last packets of each channel's share: nothing follows them
                # (TCP finds its tails from the fates, per connection: ``transport._Rack``)
                for end in _channel_ends(s.packets, spec.channels):
                    tails[i, max(end - nic.dupacks + 1, 0):end + 1] = True
        tails = torch.from_numpy(tails)
        seconds = lambda values: torch.tensor(values, dtype=torch.float64, device=device)  # noqa: E731
        transport = Sends(
            packets=torch.tensor([s.packets for s in hops], device=device),
            tau=seconds([link.wire_bytes(b, s.packets) / link.bandwidth_Bps / s.packets
                         for link, b, s in zip(links, payload, hops)]),
            rtt=seconds([2 * link.latency_s for link in links]),
            window=torch.tensor([window_of[id(link)] for link in links], device=device),
            final=torch.tensor(final, device=device), tails=tails.to(device),
            tail_resends=torch.tensor([nic.dupacks * spec.channels if f else 0 for f in final], device=device),
            connections=spec.connections)
        rows = [sched.send_row[i] for i in sends]
        phase = PHASES.index(hops[0].phase)
        steps.append(Step(sends, rows, phase, transport, phase * n_links + link_ids[rows],
                          (spec.deadline - 1.0) * ideal / len(active)))
    return steps


def _channel_ends(packets: int, channels: int) -> list[int]:
    """The last packet of each channel's contiguous share of a send."""
    base, extra = divmod(packets, channels)
    ends, first = [], 0
    for c in range(channels):
        count = base + (c < extra)
        if count:
            ends.append(first + count - 1)
        first += count
    return ends
