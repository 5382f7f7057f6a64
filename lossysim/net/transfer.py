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


_PHASE = {phase: k for k, phase in enumerate(PHASES)}


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
    # per send, from its schedule link (a 128-rank ring has 32,512 sends on 128 links)
    row = np.asarray(sched.send_row, dtype=np.int64)
    if spec.cables is None:
        lossy = [topology.lossy(src, dst) for src, dst in sched.links]
        rescale = 1.0 / (1.0 - spec.loss.loss_rate) if spec.loss.loss_rate < 1 else 0.0
        per_link = [rescale if is_lossy else 1.0 for is_lossy in lossy]
    else:   # each link at the loss its route's cables give it
        lossy = [spec.link_lossy(src, dst) for src, dst in sched.links]
        rate = [spec.link_rate(*link) for link in sched.links]
        per_link = [1.0 / (1.0 - r) if r < 1 else 0.0 for r in rate]
    lossy_rows = [r for r, is_lossy in enumerate(lossy) if is_lossy]
    factor = torch.from_numpy(np.asarray(per_link, dtype=np.float64)[row]).to(device)
    phase = np.fromiter((_PHASE[s.phase] for s in sched.sends), np.int64, len(sched.sends))
    packets = np.fromiter((s.packets for s in sched.sends), np.int64, len(sched.sends))
    # packets each (phase, link) sends: one bincount
    slot = phase * len(links) + np.asarray([index[link] for link in sched.links], dtype=np.int64)[row]
    sent = torch.from_numpy(np.bincount(slot, packets, minlength=len(PHASES) * len(links)).astype(np.int64))
    sent = sent.view(len(PHASES), len(links)).to(device)
    if sizes is None:
        first = np.fromiter((s.first for s in sched.sends), np.int64, len(sched.sends))
        sizes = np.maximum(0, np.minimum(numel, (first + packets) * per_packet) - first * per_packet)
    ideal = chosen.seconds
    steps = _steps(spec, sched, row, packets, link_ids, len(links), sizes, itemsize, ideal, device)
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


def _steps(spec, sched, row, packets, link_ids, n_links, sizes, itemsize, ideal, device) -> list:
    """Per step with traffic: its sends as the transport needs them (``row``, ``packets``, ``sizes``: each
    send's schedule link, packets and elements).

    Worked out for every send at once (a 128-rank ring has 32,512), then cut step by step: each step's
    sends with packets, in schedule order; a send is final where its link sends for the last time (its
    connections end there)."""
    nic, sends = spec.nic_model, sched.sends
    step = np.fromiter((s.step for s in sends), np.int64, len(sends))
    busy = np.flatnonzero(packets > 0)
    busy = busy[np.argsort(step[busy], kind="stable")]          # by step, each step's in schedule order
    last = np.full(len(sched.links), -1, dtype=np.int64)
    np.maximum.at(last, row[busy], step[busy])
    final = step == last[row]
    # each schedule link's Link (a ring's 128): its header, bandwidth, round trip and window
    link_of = [spec.link(spec.topology.link_class(*pair)) for pair in sched.links]
    header = np.array([link.header_bytes for link in link_of], dtype=np.int64)
    bandwidth = np.array([link.bandwidth_Bps for link in link_of], dtype=np.float64)
    rtt = np.array([2 * link.latency_s for link in link_of], dtype=np.float64)
    windows = {id(link): timing.window_packets(link, spec.payload_bytes) for link in link_of}
    window = np.array([windows[id(link)] for link in link_of], dtype=np.int64)
    wire = np.asarray(sizes, dtype=np.int64) * itemsize + packets * header[row]
    with np.errstate(divide="ignore", invalid="ignore"):       # (sends without packets are left out)
        tau = wire / bandwidth[row] / packets
    resends = np.where(final, nic.dupacks * spec.channels, 0)
    starts = np.flatnonzero(np.diff(step[busy], prepend=-1)) if len(busy) else np.zeros(0, dtype=np.int64)
    active, out = len(starts), []
    on = lambda values: torch.from_numpy(values).to(device)  # noqa: E731
    for first, end in zip(starts.tolist(), [*starts[1:].tolist(), len(busy)]):
        i = busy[first:end]
        width = int(packets[i].max())
        tails = np.zeros((len(i), width), dtype=np.bool_)   # calloc'd, written in numpy: few are set
        if not nic.rack:   # the last packets of each channel's share: nothing follows them
            # (TCP finds its tails from the fates, per connection: ``transport._Rack``)
            for k in np.flatnonzero(final[i]).tolist():
                for stop in _channel_ends(int(packets[i[k]]), spec.channels):
                    tails[k, max(stop - nic.dupacks + 1, 0):stop + 1] = True
        transport = Sends(packets=on(packets[i]), tau=on(tau[i]), rtt=on(rtt[row[i]]),
                          window=on(window[row[i]]), final=on(final[i]), tails=on(tails),
                          tail_resends=on(resends[i]), connections=spec.connections)
        rows = row[i].tolist()
        phase = PHASES.index(sends[i[0]].phase)
        out.append(Step(i.tolist(), rows, phase, transport, phase * n_links + link_ids[rows],
                        (spec.deadline - 1.0) * ideal / active))
    return out


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
