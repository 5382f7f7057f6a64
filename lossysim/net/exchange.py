"""All-to-all: every rank sends each peer a message of its own size (a mixture of experts' token dispatch
and combine), as NCCL runs it: grouped point-to-point sends, one per (sender, receiver) pair with data,
all in one step, each on its own directed link.

A call's schedule (``Exchange``) is built from its message sizes, which the routing decides afresh every
call. Each message is cut into packets as every message is; each link's packets lose on its chain of the
call site and direction, the transport repairs and charges as for every collective, and what arrives is
applied here (``deliver``): a lost packet is a hole (``zero``), or under ``drop_token`` every row it
touched (a message's last dimension: one token's vector for one expert) is lost whole.

Time without loss (``loss_free``): every send is NCCL's p2p send (``nccl.p2p_estimate``: LL or Simple by
its size). A rank's sends on one link class share its egress port and its receives its ingress port
(NVLink inside a node; across nodes its share of the node's NICs, ``nics_per_node`` among
``ranks_per_node`` ranks); the sends of one port run at once, so the port is busy for their largest
latency plus all their wire bytes at the protocol's share of its bandwidth. The slowest port of the
slowest rank sets the call's end, so the routing's imbalance shows. Left out: DeepEP's hierarchical
dispatch (an NVLink gather inside a node before one RDMA send per node), and overlap with compute.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from ..timing import nccl
from .algorithms import Schedule, Send
from .recovery import require
from .spec import NetworkSpec
from .transfer import Transfer, assemble, packets as packetise


class Exchange(Schedule):
    """The sends of one all-to-all: rank s's message to rank d as one send of ``packets[s * R + d]``
    packets (none when it is empty), every send in step 0 (NCCL's grouped sends)."""

    def __init__(self, ranks: int, packets: Sequence[int]):   # (no algorithm builds these: the routing does)
        R = int(ranks)
        self.algorithm, self.collective, self.pair, self.per_node = "p2p", "all_to_all", None, None
        self.ranks, self.n_packets = R, int(sum(packets))
        self.sends = tuple(Send(0, "exchange", s, d, 0, 0, int(packets[s * R + d]))
                           for s in range(R) for d in range(R) if s != d and packets[s * R + d])
        self._tensors, self._packet_layout = {}, {}
        self._lay_out()


def build(spec: NetworkSpec, counts: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Transfer:
    """The Transfer of an all-to-all whose rank s sends ``counts[s * R + d]`` elements of ``dtype`` to rank
    d (cached: an estimate's calls repeat their sizes, on groups alike but for their streams; training's
    change every call)."""
    return _build(spec.replace(seed=0), counts, dtype, torch.device(device))


@functools.lru_cache(maxsize=64)
def _build(spec: NetworkSpec, counts: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Transfer:
    R = spec.ranks
    if len(counts) != R * R:
        raise ValueError(f"an all-to-all of {R} ranks needs {R * R} message sizes, got {len(counts)}")
    per_packet, _ = packetise(spec.payload_bytes, 1, dtype)
    packets = [-(-int(n) // per_packet) if s != d else 0 for (s, d), n in
               zip(((s, d) for s in range(R) for d in range(R)), counts)]
    sched = Exchange(R, packets)
    sizes = [int(counts[s.src * R + s.dst]) for s in sched.sends]
    links = [(src, dst) for src in range(R) for dst in range(R) if src != dst]   # the network's order
    chosen = loss_free(spec, sched, [n * dtype.itemsize for n in sizes], per_packet * dtype.itemsize)
    return assemble(spec, links, sched, per_packet, dtype.itemsize, chosen, device, sizes=sizes)


def loss_free(spec: NetworkSpec, sched: Exchange, sizes: Sequence[int], packet_bytes: int) -> nccl.Estimate:
    """The loss-free time of an all-to-all whose send i carries ``sizes[i]`` bytes: the slowest port of
    the slowest rank (see the module's docstring)."""
    topology = spec.topology
    ranks_per_nic = topology.ranks_per_node / spec.nics_per_node
    ports: dict[tuple, list] = {}      # (rank, out|in, link class) -> [largest latency, bandwidth seconds]
    protocols = set()
    for send, nbytes in zip(sched.sends, sizes):
        link_class = topology.link_class(send.src, send.dst)
        link = spec.link(link_class)
        estimate = nccl.p2p_estimate(nbytes, link.wire_bytes(nbytes, send.packets), link)
        protocols.add(estimate.protocol)
        busy = estimate.bandwidth_s * (ranks_per_nic if link_class == "inter" else 1.0)
        for port in ((send.src, "out", link_class), (send.dst, "in", link_class)):
            held = ports.setdefault(port, [0.0, 0.0])
            held[0], held[1] = max(held[0], estimate.latency_s), held[1] + busy
    if not ports:
        return nccl.Estimate(0.0, 0.0, 0.0, "", "p2p", 0)
    latency, bandwidth = max(ports.values(), key=sum)
    protocol = "Simple" if "Simple" in protocols else "LL"
    return nccl.Estimate(latency + bandwidth, latency, bandwidth, protocol, "p2p", 1)


def counts_of(messages: Sequence[Sequence[torch.Tensor]]) -> tuple[int, ...]:
    """Elements rank s sends rank d, row-major (what a rank keeps for itself is not sent)."""
    R = len(messages)
    return tuple(messages[s][d].numel() if s != d else 0 for s in range(R) for d in range(R))


def all_to_all(network, site: str, direction: str, messages: Sequence[Sequence[torch.Tensor]],
               receivers: Optional[Sequence[int]] = None) -> list[list[torch.Tensor]]:
    """What each receiver holds of every rank's message to it (``LossyNetwork.all_to_all``)."""
    R = network.ranks
    if len(messages) != R or any(len(row) != R for row in messages):
        raise ValueError(f"an all-to-all of {R} ranks needs {R} x {R} messages (messages[src][dst])")
    policy = network.recovery.on(direction)
    require(policy.name, "all_to_all")
    receivers = list(range(R)) if receivers is None else [int(r) for r in receivers]
    held = [[messages[s][d] for s in range(R)] for d in receivers]
    real = [t for row in held for t in row if t.device.type != "meta"]
    dtypes = {t.dtype for row in messages for t in row}
    if len(dtypes) > 1:
        raise ValueError(f"an all-to-all's messages share one dtype, got {sorted(map(str, dtypes))}")
    if not real:
        raise ValueError("an all-to-all needs the data of the messages to its receivers")
    device = real[0].device
    delivery = network.simulate(site, direction, sum(counts_of(messages)), dtypes.pop(), "all_to_all", device,
                                counts=counts_of(messages))
    if delivery is not None:
        per_packet, _ = network.packets(1, held[0][0].dtype)
        for k, d in enumerate(receivers):
            for s in range(R):
                if s != d:
                    held[k][s] = _arrived(messages[s][d], delivery.weights[d, s], per_packet, policy.drops_rows)
    for row in held:
        for s, tensor in enumerate(row):
            if tensor.numel():
                network.watch(site, direction, tensor)
    return held


def _arrived(message: torch.Tensor, kept: torch.Tensor, per_packet: int, rows: bool) -> torch.Tensor:
    """``message`` as its packets arrived (``kept``: per packet, True where it arrived): zero where a
    packet was lost, or (``rows``) in every row a lost packet touched."""
    n = message.numel()
    kept = kept[:-(-n // per_packet)]
    if bool(kept.all()):
        return message
    mask = kept.repeat_interleave(per_packet)[:n].view(message.shape)
    if rows:
        mask = mask.all(-1, keepdim=True)
    return torch.where(mask, message, 0)
