"""One collective on one message shape: its packets, the sends of its schedule, the links they use
and what each step costs without loss. Built once per (collective, size, dtype, device) and reused
by every call of that shape, so a call does no Python work per send.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import timing
from .algorithms import PHASES, Delivery, Schedule, path_weights, schedule
from .spec import NetworkSpec


def packets(payload_bytes: int, numel: int, dtype: torch.dtype) -> tuple[int, int]:
    """(elements per packet, packets per message) for a message of ``numel`` elements: the last packet
    may be partial."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_packet = max(1, payload_bytes // itemsize)
    return per_packet, -(-int(numel) // per_packet)


@dataclass
class Step:
    """One step's sends, and what the transport needs of them."""
    sends: list                        # send indices
    rows: list                         # their schedule link rows
    phase: int
    packets: torch.Tensor              # [sends]
    alpha: torch.Tensor                # [sends] seconds
    tau: torch.Tensor                  # [sends] wire seconds per packet, port sharing included
    rto: torch.Tensor                  # [sends] seconds
    window: torch.Tensor               # [sends] packets in flight during a round trip
    slots: torch.Tensor                # [sends] counter slot: phase * links + link id
    ideal: float                       # loss-free duration


@dataclass
class Transfer:
    """Everything a call of this shape needs, derived once from the schedule, topology and time model."""
    sched: Schedule
    per_packet: int
    link_ids: torch.Tensor             # [rows] network link id of each schedule link
    lossy_rows: list                   # schedule rows whose links can lose packets
    factor: torch.Tensor               # [sends] weight of a delivered packet under rescale
    slots: torch.Tensor                # [rows, width] counter slot (phase * links + link id) of each packet
    lengths: torch.Tensor              # [rows] packets per link
    width: int                         # max(lengths)
    sent: torch.Tensor                 # [phases, links] packets a call sends
    steps: list                        # the steps with traffic
    ideal: float                       # loss-free duration of the collective
    _weights: dict = field(default_factory=dict)

    def weights(self, dtype: torch.dtype) -> Delivery:
        """What each path carries when delivered under ``rescale`` (``algorithms.path_weights``)."""
        if dtype not in self._weights:
            self._weights[dtype] = path_weights(self.sched, self.factor, dtype)
        return self._weights[dtype]


def build(spec: NetworkSpec, links: list, collective: str, numel: int, dtype: torch.dtype, device) -> Transfer:
    """The Transfer of one collective of ``numel`` elements of ``dtype`` on ``device``."""
    per_packet, n_packets = packets(spec.payload_bytes, numel, dtype)
    sched = schedule(spec.algorithm, collective, spec.tp_size, n_packets)
    topology = spec.topology
    index = {link: i for i, link in enumerate(links)}
    link_ids = torch.tensor([index[link] for link in sched.links], dtype=torch.long, device=device)
    lossy_rows = [r for r, (src, dst) in enumerate(sched.links) if topology.lossy(src, dst)]
    rescale = 1.0 / (1.0 - spec.loss.loss_rate) if spec.loss.loss_rate < 1 else 0.0
    factor = torch.tensor([rescale if topology.lossy(s.src, s.dst) else 1.0 for s in sched.sends],
                          dtype=torch.float64, device=device)
    tensors = sched.tensors(device)
    slots = tensors["phase"] * len(links) + link_ids.unsqueeze(1) if tensors["phase"].numel() else tensors["phase"]
    sent = torch.zeros(len(PHASES), len(links), dtype=torch.long, device=device)
    for s, row in zip(sched.sends, sched.send_row):
        sent[PHASES.index(s.phase), link_ids[row]] += s.packets
    itemsize = torch.empty((), dtype=dtype).element_size()

    def payload(s) -> int:
        return (min(numel, (s.first + s.packets) * per_packet) - s.first * per_packet) * itemsize

    rto = spec.rto_s if spec.rto_s is not None else timing.default_rto(spec.transport_model.mode)
    steps = []
    for k in range(sched.steps):
        sends = [i for i, s in enumerate(sched.sends) if s.step == k and s.packets]
        if not sends:
            continue
        hops = [sched.sends[i] for i in sends]
        classes = [topology.link_class(s.src, s.dst) for s in hops]
        times = timing.send_times([(s.src, s.dst, payload(s), s.packets, spec.link(c), c)
                                   for s, c in zip(hops, classes)])
        rows = [sched.send_row[i] for i in sends]
        phase = PHASES.index(hops[0].phase)
        seconds = lambda values: torch.tensor(values, dtype=torch.float64, device=device)  # noqa: E731
        steps.append(Step(sends, rows, phase, torch.tensor([s.packets for s in hops], device=device),
                          seconds([t.alpha for t in times]), seconds([t.tau for t in times]),
                          seconds([rto] * len(hops)),
                          torch.tensor([timing.window_packets(spec.link(c), spec.payload_bytes) for c in classes],
                                       device=device),
                          phase * len(links) + link_ids[rows], max(t.seconds for t in times)))
    return Transfer(sched, per_packet, link_ids, lossy_rows, factor, slots, tensors["link_packets"].to(torch.long),
                    max(sched.link_packets, default=0), sent, steps, sum(step.ideal for step in steps))
