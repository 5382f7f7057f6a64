"""NCCL's cost model of a collective: how long a loss-free all-reduce, all-gather or reduce-scatter
takes by each algorithm NCCL has (ring, tree, NVLS, NVLS-tree), which (algorithm, protocol) NCCL's
tuner would pick (``choose``), and a point-to-point send (``p2p_time``).

NCCL pipelines a collective: the message is cut into slices that stream through the ranks over
several channels, so a collective costs a latency (a base per algorithm and protocol plus a
latency per hop the data crosses) and its bytes over an algorithm bandwidth. NCCL's tuner models it
(``src/graph/tuning.cc`` of NCCL 2.30.7: ``ncclTopoTuneModel`` fills a latency and a bandwidth per
(collective, algorithm, protocol) from ``ncclTunerConstantsDefaults``; ``ncclTopoGetAlgoTime`` times
a size) as

    time = latency + bytes / algorithm bandwidth,    the fastest enabled pair runs

- ring all-reduce: latency = base + (2(R-1) - 2(N-1)) intra + 2(N-1) inter hops; algorithm
  bandwidth = busBw R / (2(R-1)). All-gather and reduce-scatter: R-1 steps, N-1 between nodes.
- tree all-reduce (a double binary tree across nodes, chains inside them): latency = base +
  2 ((R/N - 1) intra + log2(N) inter); algorithm bandwidth = busBw / 2 (two complementary trees each
  carry half of the message, pipelined), times a static correction per size.
- NVLS all-reduce (one node: the NVSwitch reduces and multicasts): latency = the NVLink hop of NVLS
  (25 us, no base); busBw = channels x min(2 x 0.85 x bwIntra (C-1)/C, bwInter), algorithm
  bandwidth busBw R / (2(R-1)) like the ring's.
- NVLS-tree all-reduce (NVLS inside nodes, a tree between them): latency = 25 us + 2 log2(N) x
  20.9 us; per channel min(NVLS's, bwInter (x2 on two nodes), the per-channel cap).
- protocols: LL (8-byte flag words: half the bandwidth, capped by ``LL_MAX_BW`` per GPU generation on
  one node and per node count across nodes), LL128 (120 of 128 bytes, capped per channel) and Simple
  (tree capped per channel); NVLS and NVLS-tree run Simple only.

The bandwidths need NCCL's channels and per-channel speeds, which its topology search finds
(``src/graph/search.cc``, ``ncclTopoCompute``): ``graph`` finds them from our links the way the search
does on NVSwitch nodes (the largest speed of NCCL's speed table a link sustains, as many channels as
the links carry, doubled by ``ncclTopoDupChannels``); a ring's or tree's bus bandwidth stays what a
rank's busiest link class sustains (one rank's NVLink port inside a node; across nodes the slower of
that and the node's NICs together), split over the channels for the per-channel caps.
docs/time_model.md compares the model with NCCL's own figures and published nccl-tests results.

A send (ncclSend/ncclRecv) is not in the tuner: NCCL picks its protocol by size (LL up to
``NCCL_P2P_LL_THRESHOLD`` bytes per channel, 16 KiB by default, else Simple; never LL128,
``src/enqueue.cc``), and the message crosses one link. It is timed as one step of a ring on that
link: the protocol's base latency and one hop's hardware latency, then its bytes over the link's
bandwidth at the protocol's share, plus the link's one-way latency (its ``alpha``).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

from .links import Link

PROTOCOLS = ("LL", "LL128", "Simple")
# NCCL's order (NCCL_ALGO_TREE, RING, ..., NVLS, NVLS_TREE): the tuner keeps the first of equal times.
ALGORITHMS = ("tree", "ring", "nvls", "nvls_tree")
AUTO = "auto"
# GPU generations, as ncclTopoTuneModel indexes its tables (compCapIndex); a GPU preset's generation.
ARCHS = ("volta", "ampere", "hopper", "blackwell")
GPU_ARCH = {"v100": "volta", "a100": "ampere", "l4": "ampere", "h100": "hopper", "h100-pcie": "hopper",
            "h200": "hopper", "b200": "blackwell"}
DEFAULT_ARCH = "hopper"

# microseconds, per protocol (LL, LL128, Simple): ncclTunerConstantsDefaults.baseLatencies
BASE_LATENCY_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0)}
# microseconds per hop, per hardware class and protocol: ncclTunerConstantsDefaults.hwLatencies
HW_LATENCY_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": (0, 0, 25), "nvls_tree": (0, 0, 25)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "nvls": (0, 0, 18), "nvls_tree": (0, 0, 20.9)},
}
# GB/s, llMaxBws: LL's bus bandwidth ceiling. One node: per GPU generation; across nodes: per CPU
# vendor and node count (2, more). lossysim assumes Intel hosts, as DGX H100's are (DGX A100's are AMD
# EPYC, whose row ``LL_MAX_BW_AMD`` is kept as data).
LL_MAX_BW_ONE_NODE = {"volta": 39.0, "ampere": 87.7, "hopper": 141.0, "blackwell": 282.0}
LL_MAX_BW_INTEL = (39.0, 20.4)
LL_MAX_BW_AMD = (22.5, 19.0)
# GB/s per channel, per GPU generation and node count (1, 2, more): perChMaxRingLL128Bws,
# perChMaxTreeLL128Bws, perChMaxTreeBws, perChMaxNVLSTreeBws.
PER_CHANNEL_RING_LL128 = {"volta": (20.0, 20.0, 20.0), "ampere": (20.0, 20.0, 20.0),
                          "hopper": (36.7, 36.7, 36.7), "blackwell": (40.0, 40.0, 40.0)}
PER_CHANNEL_TREE_LL128 = {"volta": (20.0, 20.0, 20.0), "ampere": (20.0, 20.0, 20.0),
                          "hopper": (36.7, 36.7, 29.0), "blackwell": (55.6, 31.67, 20.0)}
PER_CHANNEL_TREE = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8),
                    "hopper": (38.7, 41.4, 36.0), "blackwell": (70.0, 42.8, 24.0)}
PER_CHANNEL_NVLS_TREE = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8),
                         "hopper": (0.0, 57.7, 45.5), "blackwell": (0.0, 96.0, 80.0)}
# nvlsEfficiency: the share of NVLink bandwidth NVLS gets (none before Hopper: no NVLink SHARP).
NVLS_EFFICIENCY = {"volta": 0.0, "ampere": 0.0, "hopper": 0.85, "blackwell": 0.74}
# The speeds (GB/s per channel) NCCL's search tries, fastest first (search.cc: speedArrayIntra/Inter,
# sm90SpeedArrayIntra/Inter, sm100SpeedArrayIntra/Inter): inside one node, and across nodes.
SPEEDS = {
    "intra": {"volta": (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0),
              "hopper": (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0),
              "blackwell": (90.0, 80.0, 70.0, 60.0, 50.0, 45.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0)},
    "inter": {"volta": (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4,
                        1.2, 0.24, 0.12),
              "hopper": (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24,
                         0.12),
              "blackwell": (96.0, 86.0, 80.0, 48.0, 45.1, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0,
                            3.0, 2.4, 1.2, 0.24, 0.12)},
}
MAX_RING_CHANNELS = 32      # init.cc: ringGraph->maxChannels = MAXCHANNELS / 2 (trees: the ring's count)
MAX_NVLS_CHANNELS = 32      # NCCL_MAX_NVLS_ARITY: an NVLS graph has at most one channel per local GPU
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
GB = 1e9
# The share of the link a send's protocol carries (a p2p step is a ring's: LL half, Simple all).
P2P_EFFICIENCY = {"LL": 0.5, "Simple": 1.0}


class Estimate(NamedTuple):
    """One collective's modelled time, split, and the (algorithm, protocol, channels) it runs with."""
    seconds: float
    latency_s: float
    bandwidth_s: float
    protocol: str
    algorithm: str = ""
    channels: int = 0


class Fabric(NamedTuple):
    """What NCCL's tuner sees of a communicator: ranks on nodes, the bus bandwidth a ring or tree
    sustains (bytes/s), one rank's NVLink port and one NIC (bytes/s, for the channel search), the GPU
    generation and the hardware classes of the links inside and between nodes."""
    ranks: int
    nodes: int
    busbw_Bps: float
    intra_Bps: float
    nic_Bps: float
    arch: str = DEFAULT_ARCH
    intra_hw: str = "nvlink"
    inter_hw: str = "net"

    @property
    def per_node(self) -> int:
        return self.ranks // self.nodes

    @property
    def column(self) -> int:
        """ncclTopoTuneModel's node-count index: one node, two, more."""
        return min(self.nodes, 3) - 1


def arch_of(gpu: str) -> str:
    """The generation of a GPU preset's name (``h100`` -> hopper); any other name: Hopper."""
    return GPU_ARCH.get(str(gpu), DEFAULT_ARCH)


def _speeds(arch: str, where: str) -> tuple:
    return SPEEDS[where]["volta" if arch in ("volta", "ampere") else arch]


def _fastest(speeds: tuple, limit: float) -> int:
    """The index of the fastest speed at most ``limit`` (the slowest when none is)."""
    return next((i for i, s in enumerate(speeds) if s <= limit * (1 + 1e-9)), len(speeds) - 1)


def ring_channels(fabric: Fabric) -> int:
    """The channels NCCL's search gives a ring (and a tree): the fastest speed of its table one channel
    can run at (inside a node: up to the NVLink port; across nodes: up to one NIC), as many channels
    of it as the bus bandwidth carries, doubled when the speed is high (ncclTopoDupChannels: at 25
    GB/s or more, on Hopper and later only from 50 GB/s or with at most 4 channels)."""
    total = fabric.busbw_Bps / GB
    where = "intra" if fabric.nodes == 1 else "inter"
    speeds = _speeds(fabric.arch, where)
    speed = speeds[_fastest(speeds, total if where == "intra" else min(total, fabric.nic_Bps / GB))]
    channels = max(1, min(MAX_RING_CHANNELS, round(total / speed)))
    if speed >= 25 and not (fabric.arch in ("hopper", "blackwell") and speed < 50 and channels > 4):
        channels = min(2 * channels, MAX_RING_CHANNELS)
    return channels


def nvls_graph(fabric: Fabric) -> tuple[int, float, float]:
    """(channels, bwIntra, bwInter in GB/s per channel) of NCCL's NVLS search: one channel per local
    GPU; the fastest speed at which they all fit on the NVLink port (across nodes also at most one
    NIC); then bwInter raised while below twice bwIntra, as far as a NIC allows (search.cc, pass 2)."""
    channels = min(MAX_NVLS_CHANNELS, fabric.per_node)
    nic = fabric.nic_Bps / GB if fabric.nodes > 1 else float("inf")
    speeds = _speeds(fabric.arch, "intra" if fabric.nodes == 1 else "inter")
    i = _fastest(speeds, min(fabric.intra_Bps / GB / channels, nic))
    intra = inter = speeds[i]
    while i > 0 and inter < 2 * intra and speeds[i - 1] <= nic:
        i -= 1
        inter = speeds[i]
    return channels, intra, inter


def _bus_bandwidth(collective: str, algorithm: str, protocol: str, fabric: Fabric) -> tuple[float, int]:
    """(bus bandwidth in bytes/s, channels) of one (algorithm, protocol), as ncclTopoTuneModel refines
    it: 0 where NCCL would not run the pair."""
    arch, col = fabric.arch, fabric.column
    if algorithm in ("nvls", "nvls_tree"):
        if protocol != "Simple" or NVLS_EFFICIENCY[arch] == 0 or fabric.intra_hw != "nvlink" \
                or collective != "all_reduce" or fabric.per_node < 2:
            return 0.0, 0
        channels, bw_intra, bw_inter = nvls_graph(fabric)
        if channels < 2:
            return 0.0, 0
        # an all-reduce pipelines its reduce and its multicast: twice NVLS's NVLink share
        intra = bw_intra * NVLS_EFFICIENCY[arch] * (channels - 1) / channels * 2
        inter = bw_inter * (2 if algorithm == "nvls_tree" and fabric.nodes <= 2 else 1)
        cap = PER_CHANNEL_NVLS_TREE[arch][col] if algorithm == "nvls_tree" else float("inf")
        return channels * min(intra, inter, cap) * GB, channels
    channels = ring_channels(fabric)
    bus = fabric.busbw_Bps
    ll_max = (LL_MAX_BW_ONE_NODE[arch] if fabric.nodes == 1 else LL_MAX_BW_INTEL[min(fabric.nodes, 3) - 2]) * GB
    if protocol == "LL128" and fabric.intra_hw != "nvlink" and fabric.ranks != fabric.nodes:
        return 0.0, channels     # LL128 runs only over NVLink inside a node (typeIntra <= PATH_NVB)
    if algorithm == "ring":
        if protocol == "LL":
            bus = min(ll_max, bus * 0.5)
        elif protocol == "LL128":
            bus = min(bus * 0.92, channels * PER_CHANNEL_RING_LL128[arch][col] * GB)
        return bus, channels
    if collective != "all_reduce":
        return 0.0, channels
    bus = min(bus * 0.92, channels * PER_CHANNEL_TREE[arch][col] * GB)
    if protocol == "LL":
        bus = min(bus / 3.8, ll_max)
    elif protocol == "LL128":
        bus = min(bus * (7 / 9 if fabric.nodes == 1 else 120 / 128), channels * PER_CHANNEL_TREE_LL128[arch][col] * GB)
    return bus, channels


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
    elif algorithm == "tree":
        hops = 2 * ((ranks // nodes - 1) * intra + int(math.log2(nodes)) * inter)
    elif algorithm == "nvls":        # the switch's one hop (and the network's, were it run across nodes)
        hops = intra + (inter if nodes > 1 else 0.0)
    else:                            # nvls_tree: the switch, then up and down a tree of nodes
        hops = intra + 2 * int(math.log2(nodes)) * inter
    return (base + hops) * 1e-6


def algorithm_bandwidth(collective: str, algorithm: str, protocol: str, ranks: int, nodes: int,
                        busbw_Bps: float, nbytes: float, fabric: Optional[Fabric] = None) -> float:
    """Bytes per second of the message (nccl-tests' algbw) a loss-free collective sustains (0: NCCL does
    not run the pair)."""
    if fabric is None:
        fabric = Fabric(ranks, nodes, busbw_Bps, busbw_Bps, busbw_Bps)
    bus, _ = _bus_bandwidth(collective, algorithm, protocol, fabric)
    if algorithm != "tree":
        steps, _ = _steps(collective, ranks, nodes)
        return bus * ranks / steps
    size = int(math.log2(max(int(nbytes) >> 6, 1)))
    factors = TREE_CORRECTION[protocol]
    return bus * 0.5 * (factors[size] if size < len(factors) else 1.0)   # none beyond 256 MiB


def _check(collective: str, algorithm: str) -> None:
    if collective not in ("all_reduce", "all_gather", "reduce_scatter"):
        raise ValueError(f"collective={collective!r} must be all_reduce, all_gather or reduce_scatter")
    if algorithm not in ALGORITHMS or (algorithm != "ring" and collective != "all_reduce"):
        raise ValueError(f"algorithm={algorithm!r}: NCCL models ring collectives and tree, nvls and nvls_tree "
                         "all-reduces")


def available(collective: str, algorithm: str, fabric: Fabric) -> bool:
    """Whether NCCL would run ``algorithm`` for this collective on this fabric: NVLS on one node of at
    least two NVLink GPUs of Hopper or later, NVLS-tree across such nodes (NVLS across nodes needs
    CollNet, NVLS-tree one node too many: ncclTopoTuneModel disables them), a tree for all-reduces."""
    if algorithm == "nvls" and fabric.nodes > 1 or algorithm == "nvls_tree" and fabric.nodes == 1:
        return False
    if algorithm != "ring" and collective != "all_reduce":
        return False
    return any(_bus_bandwidth(collective, algorithm, p, fabric)[0] > 0 for p in PROTOCOLS)


def estimate(collective: str, algorithm: str, ranks: int, nodes: int, nbytes: float, busbw_Bps: float,
             intra_hw: str = "nvlink", inter_hw: str = "net", protocols=PROTOCOLS, arch: str = DEFAULT_ARCH,
             intra_Bps: Optional[float] = None, nic_Bps: Optional[float] = None,
             algorithms=ALGORITHMS) -> Estimate:
    """NCCL's modelled time of one loss-free collective of ``nbytes`` (each rank's message for an
    all-reduce, the whole output for an all-gather, the whole input for a reduce-scatter, as
    nccl-tests sizes them) by ``algorithm``, fastest protocol (``auto``: the fastest of ``algorithms``
    too). ``intra_Bps`` (one rank's NVLink port) and ``nic_Bps`` (one NIC) default to ``busbw_Bps``."""
    if algorithm == AUTO:
        return choose(collective, Fabric(ranks, nodes, busbw_Bps, intra_Bps or busbw_Bps, nic_Bps or busbw_Bps,
                                         arch, intra_hw, inter_hw), nbytes, protocols, algorithms)
    _check(collective, algorithm)
    if ranks < 2:
        return Estimate(0.0, 0.0, 0.0, "Simple", algorithm, 0)
    fabric = Fabric(ranks, nodes, busbw_Bps, intra_Bps or busbw_Bps, nic_Bps or busbw_Bps, arch, intra_hw, inter_hw)
    best = None
    for protocol in protocols:
        guess = _time(collective, algorithm, protocol, fabric, nbytes)
        if guess is not None and (best is None or guess.seconds < best.seconds):
            best = guess
    if best is None:
        raise ValueError(f"algorithm={algorithm!r} does not run a {collective} on {ranks} ranks on {nodes} node(s) "
                         f"of {arch} GPUs ({intra_hw} inside nodes)")
    return best


def _time(collective: str, algorithm: str, protocol: str, fabric: Fabric, nbytes: float):
    """ncclTopoGetAlgoTime of one pair (None: NCCL does not run it)."""
    bus, channels = _bus_bandwidth(collective, algorithm, protocol, fabric)
    if bus <= 0:
        return None
    ranks, nodes = fabric.ranks, fabric.nodes
    latency = latency_s(collective, algorithm, protocol, ranks, nodes, fabric.intra_hw, fabric.inter_hw)
    if algorithm == "ring" and protocol == "Simple" and nodes > 1 and collective == "all_reduce" \
            and nbytes / (channels * ranks) >= 64:
        latency *= RING_PLATEAU
    bandwidth = nbytes / algorithm_bandwidth(collective, algorithm, protocol, ranks, nodes, fabric.busbw_Bps,
                                             nbytes, fabric)
    return Estimate(latency + bandwidth, latency, bandwidth, protocol, algorithm, channels)


def choose(collective: str, fabric: Fabric, nbytes: float, protocols=PROTOCOLS, algorithms=ALGORITHMS) -> Estimate:
    """The (algorithm, protocol) NCCL's tuner runs for ``nbytes`` on this fabric: the fastest of every
    pair it enables (ties: NCCL's order, tree before ring before NVLS). All-gathers and
    reduce-scatters: the ring (lossysim runs them on rings; NCCL's NVLS and PAT variants are not
    modelled)."""
    if fabric.ranks < 2:
        return Estimate(0.0, 0.0, 0.0, "Simple", "ring", 0)
    best = None
    for algorithm in (a for a in ALGORITHMS if a in algorithms):
        if not available(collective, algorithm, fabric):
            continue
        for protocol in protocols:
            guess = _time(collective, algorithm, protocol, fabric, nbytes)
            if guess is not None and (best is None or guess.seconds < best.seconds):
                best = guess
    return best


def collective_estimate(collective: str, algorithm: str, ranks: int, nodes: int, message_bytes: int,
                        packet_bytes: int, intra: Link, inter: Link, busbw_Bps: float,
                        arch: str = DEFAULT_ARCH, algorithms=ALGORITHMS) -> Estimate:
    """``estimate`` of a loss-free collective on our links: ``message_bytes`` is each rank's message
    (an all-reduce's or a reduce-scatter's input, an all-gather's shard), cut into packets of
    ``packet_bytes``; the busiest link class (``inter`` across nodes) adds its header to every packet;
    ``busbw_Bps`` is what a rank's busiest link class sustains; ``algorithm`` may be ``auto``."""
    if ranks < 2 or message_bytes == 0:
        return Estimate(0.0, 0.0, 0.0, "Simple", "ring" if algorithm == AUTO else algorithm, 0)
    bottleneck = inter if nodes > 1 else intra
    wire = bottleneck.wire_bytes(message_bytes, -(-message_bytes // packet_bytes))
    nbytes = wire * ranks if collective == "all_gather" else wire   # nccl-tests: all-gather's whole output
    return estimate(collective, algorithm, ranks, nodes, nbytes, busbw_Bps, intra.hw, inter.hw, arch=arch,
                    intra_Bps=intra.bandwidth_Bps, nic_Bps=inter.bandwidth_Bps, algorithms=algorithms)


def collective_time(collective: str, algorithm: str, ranks: int, nodes: int, message_bytes: int,
                    packet_bytes: int, intra: Link, inter: Link, busbw_Bps: float,
                    arch: str = DEFAULT_ARCH) -> float:
    """Seconds a loss-free collective takes on our links: ``collective_estimate``'s."""
    return collective_estimate(collective, algorithm, ranks, nodes, message_bytes, packet_bytes, intra, inter,
                               busbw_Bps, arch).seconds


def p2p_estimate(message_bytes: int, wire_bytes: int, link: Link) -> Estimate:
    """NCCL's p2p send of ``message_bytes`` (``wire_bytes`` on the wire) over one ``link``: LL up to
    ``P2P_LL_THRESHOLD`` bytes, else Simple; a ring step's base and hop latency for the link's hardware
    class, the link's own one-way latency (``alpha``: the message crosses the wire once, as its repairs'
    round trips count it), and the wire bytes at the protocol's share of the link's bandwidth."""
    if message_bytes == 0:
        return Estimate(0.0, 0.0, 0.0, "Simple")
    protocol = "LL" if message_bytes <= P2P_LL_THRESHOLD else "Simple"
    p = PROTOCOLS.index(protocol)
    latency = (BASE_LATENCY_US["ring"][p] + HW_LATENCY_US[link.hw]["ring"][p]) * 1e-6 + link.latency_s
    bandwidth = wire_bytes / (link.bandwidth_Bps * P2P_EFFICIENCY[protocol])
    return Estimate(latency + bandwidth, latency, bandwidth, protocol)


def p2p_time(message_bytes: int, packet_bytes: int, link: Link) -> float:
    """Seconds a loss-free send of ``message_bytes`` takes over one ``link`` (the class between its two
    ranks), cut into packets of ``packet_bytes`` whose headers the link adds: ``p2p_estimate``."""
    if message_bytes == 0:
        return 0.0
    wire = link.wire_bytes(message_bytes, -(-message_bytes // packet_bytes))
    return p2p_estimate(message_bytes, wire, link).seconds
