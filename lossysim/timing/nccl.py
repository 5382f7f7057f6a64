"""NCCL's cost model of a collective: how long a loss-free ring or tree all-reduce or all-gather takes,
and a point-to-point send (``p2p_time``).

NCCL pipelines a collective: the message is cut into slices that stream through the ranks over
several channels, so a collective costs a latency (a base per algorithm and protocol plus a
latency per hop the data crosses) and its bytes over an algorithm bandwidth. NCCL's tuner
(``src/graph/tuning.cc``, the default ``ncclTunerConstants`` of NCCL 2.2x, Hopper) models it as

    time = latency + bytes / algorithm bandwidth

- ring all-reduce: latency = base + (2(R-1) - 2(N-1)) intra + 2(N-1) inter hops; algorithm
  bandwidth = busBw R / (2(R-1)). All-gather: R-1 steps, N-1 of them between nodes.
- tree all-reduce (NCCL's double binary tree across nodes, chains inside them): latency = base +
  2 ((R/N - 1) intra + log2(N) inter); algorithm bandwidth = busBw / 2, its bandwidth term about
  2M/B, not 2 log2(R) M/B: two complementary trees each carry half of the message, pipelined.
- protocols: LL (8-byte flag words: half the bandwidth), LL128 (120 of 128 bytes) and Simple;
  the tuner takes whichever is fastest for the size.

``busBw`` (the bus bandwidth a rank's busiest link class sustains) comes from our links: one
rank's NVLink port inside a node; across nodes the slower of that and the node's NICs together
(NCCL spreads its channels over them, one NIC per GPU on DGX-class nodes). NCCL's per-channel
caps (which need its channel count) and the GPU-specific LL bandwidth ceilings are not modelled:
docs/time_model.md shows the comparison with NCCL's own figures and published nccl-tests results.

A send (ncclSend/ncclRecv) is not in the tuner: NCCL picks its protocol by size (LL up to
``NCCL_P2P_LL_THRESHOLD`` bytes per channel, 16 KiB by default, else Simple; never LL128,
``src/enqueue.cc``), and the message crosses one link. It is timed as one step of a ring on that
link: the protocol's base latency and one hop's hardware latency, then its bytes over the link's
bandwidth at the protocol's share.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from .links import Link

PROTOCOLS = ("LL", "LL128", "Simple")
ALGORITHMS = ("ring", "tree")

# microseconds, per protocol (LL, LL128, Simple): ncclTunerConstantsDefaults.baseLatencies
BASE_LATENCY_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4)}
# microseconds per hop, per hardware class and protocol: ncclTunerConstantsDefaults.hwLatencies
HW_LATENCY_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0)},
}
# The share of the bus bandwidth a protocol carries (ncclTopoTuneModel's refinements).
RING_EFFICIENCY = {"LL": 0.5, "LL128": 0.92, "Simple": 1.0}
TREE_EFFICIENCY = {"LL": 0.92 / 3.8, "LL128": None, "Simple": 0.92}   # LL128: 7/9 in a node, 120/128 across
# Trees stray from the model at medium sizes; NCCL scales their bandwidth by a static factor per
# power of two of bytes / 64 (treeCorrectionFactor).
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
}
# A ring across nodes is slower than the model once messages are large (the "plateau effect").
RING_PLATEAU = 1.4
# NCCL_P2P_LL_THRESHOLD's default: a send of at most this many bytes per channel goes by LL. Over NVLink
# and networks NCCL cuts a send into parts of at least 64 KiB per channel, so it is the whole message's.
P2P_LL_THRESHOLD = 16384


class Estimate(NamedTuple):
    """One collective's modelled time, split, and the protocol the tuner chose."""
    seconds: float
    latency_s: float
    bandwidth_s: float
    protocol: str


def _steps(collective: str, ranks: int, nodes: int) -> tuple[int, int]:
    """(steps, steps between nodes) of a ring collective."""
    if collective == "all_reduce":
        return 2 * (ranks - 1), 2 * (nodes - 1)
    return ranks - 1, nodes - 1


def latency_s(collective: str, algorithm: str, protocol: str, ranks: int, nodes: int,
              intra_hw: str = "nvlink", inter_hw: str = "net") -> float:
    """The latency term: a base per algorithm and protocol, plus NCCL's per-hop latencies."""
    p = PROTOCOLS.index(protocol)
    base = BASE_LATENCY_US[algorithm][p]
    intra = HW_LATENCY_US[intra_hw][algorithm][p]
    # With one rank per node the network latency is fully exposed: NCCL charges the tree's.
    inter = HW_LATENCY_US[inter_hw]["tree" if ranks == nodes else algorithm][p]
    if algorithm == "ring":
        steps, between = _steps(collective, ranks, nodes)
        if nodes > 1:  # every step still pays the network proxy's post (1 us, 3x for Simple)
            intra = max(intra, 3.0 if protocol == "Simple" else 1.0)
        hops = (steps - between) * intra + between * inter
    else:
        hops = 2 * ((ranks // nodes - 1) * intra + int(math.log2(nodes)) * inter)
    return (base + hops) * 1e-6


def algorithm_bandwidth(collective: str, algorithm: str, protocol: str, ranks: int, nodes: int,
                        busbw_Bps: float, nbytes: float) -> float:
    """Bytes per second of the message (nccl-tests' algbw) a loss-free collective sustains."""
    if algorithm == "ring":
        steps, _ = _steps(collective, ranks, nodes)
        return busbw_Bps * RING_EFFICIENCY[protocol] * ranks / steps
    efficiency = TREE_EFFICIENCY[protocol]
    if efficiency is None:
        efficiency = 7 / 9 if nodes == 1 else 120 / 128
    bandwidth = busbw_Bps * efficiency * 0.5
    size = int(math.log2(max(int(nbytes) >> 6, 1)))
    factors = TREE_CORRECTION[protocol]
    return bandwidth * (factors[size] if size < len(factors) else 1.0)   # none beyond 256 MiB


def estimate(collective: str, algorithm: str, ranks: int, nodes: int, nbytes: float, busbw_Bps: float,
             intra_hw: str = "nvlink", inter_hw: str = "net", protocols=PROTOCOLS) -> Estimate:
    """NCCL's modelled time of one loss-free collective of ``nbytes`` (each rank's message for an
    all-reduce, the whole output for an all-gather, the whole input for a reduce-scatter, as
    nccl-tests sizes them), fastest protocol."""
    if collective not in ("all_reduce", "all_gather", "reduce_scatter"):
        raise ValueError(f"collective={collective!r} must be all_reduce, all_gather or reduce_scatter")
    if algorithm not in ALGORITHMS or (algorithm == "tree" and collective != "all_reduce"):
        raise ValueError(f"algorithm={algorithm!r}: NCCL models ring collectives and tree all-reduces")
    if ranks < 2:
        return Estimate(0.0, 0.0, 0.0, "Simple")
    best = None
    for protocol in protocols:
        latency = latency_s(collective, algorithm, protocol, ranks, nodes, intra_hw, inter_hw)
        if algorithm == "ring" and protocol == "Simple" and nodes > 1 and collective == "all_reduce" \
                and nbytes / ranks >= 64:
            latency *= RING_PLATEAU
        bandwidth = nbytes / algorithm_bandwidth(collective, algorithm, protocol, ranks, nodes, busbw_Bps, nbytes)
        guess = Estimate(latency + bandwidth, latency, bandwidth, protocol)
        if best is None or guess.seconds < best.seconds:
            best = guess
    return best


def collective_time(collective: str, algorithm: str, ranks: int, nodes: int, message_bytes: int,
                    packet_bytes: int, intra: Link, inter: Link, busbw_Bps: float) -> float:
    """Seconds a loss-free ring or tree collective takes on our links: ``message_bytes`` is each
    rank's message (an all-reduce's or a reduce-scatter's input, an all-gather's shard), cut into packets of
    ``packet_bytes``; the busiest link class (``inter`` across nodes) adds its header to every
    packet; ``busbw_Bps`` is what a rank's busiest link class sustains."""
    if ranks < 2 or message_bytes == 0:
        return 0.0
    bottleneck = inter if nodes > 1 else intra
    wire = bottleneck.wire_bytes(message_bytes, -(-message_bytes // packet_bytes))
    nbytes = wire * ranks if collective == "all_gather" else wire   # nccl-tests: all-gather's whole output
    return estimate(collective, algorithm, ranks, nodes, nbytes, busbw_Bps, intra.hw, inter.hw).seconds


def p2p_estimate(message_bytes: int, wire_bytes: int, link: Link) -> Estimate:
    """NCCL's p2p send of ``message_bytes`` (``wire_bytes`` on the wire) over one ``link``: LL up to
    ``P2P_LL_THRESHOLD`` bytes, else Simple; a ring step's base and hop latency for the link's hardware
    class, and the wire bytes at the protocol's share of the link's bandwidth."""
    if message_bytes == 0:
        return Estimate(0.0, 0.0, 0.0, "Simple")
    protocol = "LL" if message_bytes <= P2P_LL_THRESHOLD else "Simple"
    p = PROTOCOLS.index(protocol)
    latency = (BASE_LATENCY_US["ring"][p] + HW_LATENCY_US[link.hw]["ring"][p]) * 1e-6
    bandwidth = wire_bytes / (link.bandwidth_Bps * RING_EFFICIENCY[protocol])
    return Estimate(latency + bandwidth, latency, bandwidth, protocol)


def p2p_time(message_bytes: int, packet_bytes: int, link: Link) -> float:
    """Seconds a loss-free send of ``message_bytes`` takes over one ``link`` (the class between its two
    ranks), cut into packets of ``packet_bytes`` whose headers the link adds: ``p2p_estimate``."""
    if message_bytes == 0:
        return 0.0
    wire = link.wire_bytes(message_bytes, -(-message_bytes // packet_bytes))
    return p2p_estimate(message_bytes, wire, link).seconds
