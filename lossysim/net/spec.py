"""The network's settings, in one frozen spec checked once where it is built.

Every rule about what the network accepts, and every message saying what is wrong, lives in
``NetworkSpec.__post_init__`` (and in the value types it builds: ``Topology``, ``Transport``,
``Link``, the loss model). The experiment config builds one spec from its keys (the spec's field
names are the config's keys) and Python callers build one through ``LossyNetwork(ranks, ...)``;
the network takes it whole and never checks again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Optional, Sequence, Union

from ..fabric.place import Placement, placement as fabric_placement
from ..loss import LossModel, parse_loss_model
from ..timing import Compute, Link, Measured, nccl, parse_compute, parse_link
from ..timing.congestion import CONGESTION
from ..timing.retransmission import DEFAULT_NIC, NIC_PRESETS, Nic, parse_nic
from ..util import one_of
from .algorithms import ALGORITHMS, IN_SWITCH
from .recovery import (ACTIVATIONS, DEFAULT_HADAMARD_BLOCK, DEFAULT_OUTLIER_FRACTION, RECOVERY_POLICIES, Policy,
                       check_block, check_fraction, policy)
from .selection import SiteSelection
from .topology import Topology
from .transport import Transport

DIRECTIONS = ("fwd", "bwd")
# NCCL's socket transport: NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD sockets per connection, 1 x 1 by
# default, 2 x 8 on AWS's ENA (src/transport/net_socket.cc, ncclSocketGetNsockNthread), at most 64
# (MAX_SOCKETS); each message is cut into one contiguous chunk per socket.
MAX_SOCKETS = 64
# The largest frame of any link modelled: a 9000-byte Ethernet jumbo frame's MTU. RoCE and InfiniBand carry
# less, 4096 bytes at their largest IB MTU (IB_MTU_4096; an Ethernet port's jumbo MTU "surely supports the
# max IB mtu of 4K", Linux commit bcacb897, IB/mlx4). A payload past it is no packet any link sends.
MAX_PAYLOAD_BYTES = 9000
LOSSY = (*DIRECTIONS, "both")    # what ``lossy`` takes: one direction, or both


def _directions(lossy: Union[str, Sequence[str]]) -> tuple[str, ...]:
    """``both``, ``fwd``, ``bwd`` or a sequence of directions -> a tuple in fwd, bwd order."""
    given = DIRECTIONS if lossy == "both" else ((lossy,) if isinstance(lossy, str) else tuple(lossy))
    for direction in given:
        if direction not in DIRECTIONS:
            raise ValueError(f"lossy={direction!r} must be {one_of(LOSSY)}")
    return tuple(d for d in DIRECTIONS if d in given)


def _count(name: str, value, most: int) -> int:
    """``value`` (an int or its digits) as a whole number in [1, most], or a one-line ValueError."""
    text = str(value).strip()
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise ValueError(f"{name}={value} must be a whole number from 1 to {most}")
    return int(text)


def _choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} must be {one_of(allowed)}")


@dataclass(frozen=True)
class NetworkSpec:
    """Everything that decides what a network drops, repairs and charges (see docs/semantics.md,
    docs/time_model.md). Strings are parsed: ``loss`` by ``parse_loss_model``, links by ``parse_link``.

    Args:
        ranks: number of ranks.
        loss: the loss model of every lossy link.
        seed: root of every call site's random stream.
        payload_bytes: tensor bytes per packet (1450 = UDP in a 1500-byte MTU).
        recovery: ``zero`` (a lost packet contributes nothing), ``rescale`` (what arrives is divided
            by the probability that it arrives: an unbiased estimate of the sum), ``hadamard`` or
            ``hadamard+rescale`` (a randomized Hadamard transform around the collective), ``outliers``
            or ``outliers+hadamard`` (each sender's largest elements over a reliable side path, the
            rest under ``zero`` or ``hadamard``), ``stale``
            (the last values that arrived) or ``error_feedback`` (what was lost is sent with the next
            call; gradients only): ``lossysim.net.recovery``.
        lossy: directions whose traffic can be lost (``fwd``, ``bwd``, or ``both``); the others are
            delivered intact but still counted and timed.
        max_burst: burst-length histogram bins; the last one holds longer runs.
        algorithm: ``ring``, ``tree``, ``direct``, ``nvls``, ``nvls_tree`` (``lossysim.net.algorithms``) or
            ``auto``: per collective and size, what NCCL's tuner picks (``lossysim.timing.nccl.choose``).
        ranks_per_node, lossy_links: the topology (``lossysim.net.topology``).
        transport, deadline: what a loss costs (``lossysim.net.transport``).
        nic: how lost packets are detected and repaired (a preset of ``lossysim.timing.retransmission``:
            ideal, irn, srd, roce-gbn, roce-gbn-timeout, tcp, tcp-bbr); ``retransmit`` (selective or
            go_back_n) and ``rto_s`` (every timer, seconds) override it.
        channels: connections per link (NCCL's channels): each one's last packets are its tail losses.
        sockets: a TCP nic's sockets per channel (NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD, 1 to 64),
            each a TCP connection with its own window; RDMA nics have none.
        congestion: a TCP nic's congestion control, overriding the preset's (``cubic``, ``reno``, ``bbr``;
            None: the nic's).
        nics_per_node: NICs a node's inter-node traffic spreads over (None: one per rank).
        link_intra, link_inter: the links of each class (``lossysim.timing.links``).
        hadamard_block: elements per Hadamard transform block (a power of two).
        outlier_fraction: ``outliers``: the share of each rank's message, in (0, 0.5], sent reliably
            (k = ceil(fraction x elements), at least 1).
        compute: the GPU model a recovery policy's compute is charged at (``lossysim.timing.compute``;
            ``measured``: nothing is charged, the measured step already holds it).
        lossy_layers, lossy_sites: which TP call sites can lose packets (``lossysim.net.selection``:
            ``all``, layers such as ``0-5,12``; ``all``, ``attn`` or ``mlp``).
    """
    ranks: int
    loss: Union[str, LossModel] = "none"
    seed: int = 0
    payload_bytes: int = 1450
    recovery: str = "zero"
    lossy: Union[str, Sequence[str]] = DIRECTIONS
    max_burst: int = 256
    algorithm: str = "ring"
    ranks_per_node: Optional[int] = None
    lossy_links: str = "all"
    transport: str = "drop"
    nic: str = DEFAULT_NIC
    retransmit: Optional[str] = None
    deadline: float = 1.5
    rto_s: Optional[float] = None
    channels: int = 2
    sockets: int = 1
    congestion: Optional[str] = None
    nics_per_node: Optional[int] = None
    link_intra: Union[str, Link] = "nvlink4"
    link_inter: Union[str, Link] = "roce-200g"
    hadamard_block: int = DEFAULT_HADAMARD_BLOCK
    outlier_fraction: float = DEFAULT_OUTLIER_FRACTION
    compute: Union[str, Compute, Measured] = "h100"
    lossy_layers: str = "all"
    lossy_sites: str = "all"
    # The fabric (docs/fabric.md): none keeps every rank pair its own link, as before.
    fabric: str = "none"
    bad_link: Union[str, Sequence[str]] = ()
    corrupt_share: float = 0.0
    qps_per_connection: int = 1
    pxn: bool = True
    routing: str = "ecmp"
    placement: Optional[tuple] = None   # (global ranks, ranks per node, root seed): the mesh's; None: in order
    # Derived once from the fields above.
    selection: SiteSelection = field(init=False, repr=False, compare=False)
    topology: Topology = field(init=False, repr=False, compare=False)
    transport_model: Transport = field(init=False, repr=False, compare=False)
    nic_model: Nic = field(init=False, repr=False, compare=False)
    recovery_model: Policy = field(init=False, repr=False, compare=False)
    cables: Optional[Placement] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)
        if int(self.payload_bytes) < 8:
            raise ValueError(f"payload_bytes={self.payload_bytes} must be >= 8")
        if int(self.payload_bytes) > MAX_PAYLOAD_BYTES:
            raise ValueError(f"payload_bytes={self.payload_bytes} is larger than any link's frame: at most "
                             f"{MAX_PAYLOAD_BYTES} (an Ethernet jumbo frame's MTU; RoCE and InfiniBand: 4096, "
                             "their largest IB MTU)")
        if int(self.max_burst) < 1:
            raise ValueError(f"max_burst={self.max_burst} must be >= 1")
        _choice("recovery", self.recovery, RECOVERY_POLICIES)
        block = check_block(self.hadamard_block)
        fraction = check_fraction(self.outlier_fraction)
        try:
            compute = parse_compute(self.compute)
        except ValueError as err:
            raise ValueError(f"compute: {err}") from None
        _choice("algorithm", self.algorithm, ALGORITHMS)
        try:
            loss = parse_loss_model(self.loss)
        except ValueError as err:
            raise ValueError(f"loss: {err}") from None
        links = {}
        for name in ("link_intra", "link_inter"):
            try:
                links[name] = parse_link(getattr(self, name))
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
        if self.rto_s is not None and not (math.isfinite(self.rto_s) and self.rto_s > 0):
            raise ValueError(f"rto_s={self.rto_s} must be a positive number of seconds (or null)")
        if int(self.channels) < 1:
            raise ValueError(f"channels={self.channels} must be >= 1")
        sockets = _count("sockets", self.sockets, MAX_SOCKETS)
        nic = parse_nic(self.nic)
        if self.congestion is not None:
            _choice("congestion", self.congestion, CONGESTION)
            if not nic.rack:
                tcp = self._tcp_nics()
                raise ValueError(f"congestion={self.congestion}: only a TCP nic has a congestion window (nic="
                                 f"{self.nic}); use {tcp or 'congestion=null'}")
        if sockets != 1 and not nic.rack:   # an RDMA nic's queue pair is one connection: sockets would do nothing
            tcp = self._tcp_nics()
            raise ValueError(f"sockets={sockets}: only a TCP nic has sockets (nic={self.nic}); use sockets=1"
                             f"{' or ' + tcp if tcp else ''}")
        nic = nic.override(self.retransmit, self.rto_s, self.congestion)
        topology = Topology(int(self.ranks), self.ranks_per_node, self.lossy_links)
        if self.nics_per_node is not None and int(self.nics_per_node) < 1:
            raise ValueError(f"nics_per_node={self.nics_per_node} must be >= 1 (or null: one per rank)")
        transport = Transport(self.transport, nic.mode, float(self.deadline))
        if transport.repairs and loss.loss_rate >= 1.0:
            raise ValueError(f"transport={self.transport} never finishes: {loss.spec} loses every packet")
        recovery = policy(self.recovery, block, fraction)
        # outliers retransmit their side path whatever ``transport`` says
        side_path = recovery.side_path
        if side_path and loss.loss_rate >= 1.0:
            raise ValueError(f"recovery={self.recovery} retransmits its outliers, which never finishes: "
                             f"{loss.spec} loses every packet")
        if side_path and nic.mode == "go_back_n" and not loss.rewindable:
            raise ValueError(f"recovery={self.recovery} retransmits its outliers by go-back-N (nic={self.nic}), "
                             f"which is not supported with {loss.spec}: use a selective repeat nic or "
                             "retransmit=selective")
        if self.algorithm in IN_SWITCH:
            arch = nccl.arch_of(getattr(compute, "gpu", ""))
            if recovery.send_by_send:
                raise ValueError(f"algorithm={self.algorithm}: recovery={self.recovery} replays every send between "
                                 "ranks, and NVLS reduces in the switch: use another recovery or algorithm=auto")
            if nccl.NVLS_EFFICIENCY[arch] == 0 or links["link_intra"].hw != "nvlink":
                raise ValueError(f"algorithm={self.algorithm} needs NVLink SHARP: Hopper or later GPUs (compute="
                                 f"{compute.spec} is {arch}) on an NVLink link_intra (hw={links['link_intra'].hw})")
        rescale = recovery.rescale
        if rescale and loss.loss_rate >= 1.0:
            raise ValueError(f"recovery={self.recovery} needs a loss rate below 1: {loss.spec} loses every packet")
        if rescale and transport.kind == "deadline":
            raise ValueError(f"recovery={self.recovery} with transport=deadline is not supported: the probability "
                             "that a packet arrives by the deadline has no closed form")
        if not recovery.on_activations and _directions(self.lossy) == (ACTIVATIONS,):
            raise ValueError(f"recovery={self.recovery} acts on gradients only; with lossy=fwd only activations "
                             "lose packets: use lossy=bwd or both")
        if transport.kind == "retransmit" and transport.mode == "go_back_n" and not loss.rewindable:
            raise ValueError(f"go-back-N (nic={self.nic}, retransmit={nic.mode}) is not supported with {loss.spec}: "
                             "go-back-N learns how many packets it sent only after drawing them; use a selective "
                             "repeat nic or retransmit=selective")
        put("ranks", topology.ranks)
        put("ranks_per_node", topology.ranks_per_node)
        put("loss", loss)
        put("seed", int(self.seed))
        put("payload_bytes", int(self.payload_bytes))
        put("lossy", _directions(self.lossy))
        put("max_burst", int(self.max_burst))
        put("deadline", float(self.deadline))
        put("rto_s", None if self.rto_s is None else float(self.rto_s))
        put("channels", int(self.channels))
        put("sockets", sockets)
        put("nics_per_node", topology.ranks_per_node if self.nics_per_node is None else int(self.nics_per_node))
        put("link_intra", links["link_intra"])
        put("link_inter", links["link_inter"])
        put("hadamard_block", block)
        put("outlier_fraction", fraction)
        put("compute", compute)
        put("topology", topology)
        put("transport_model", transport)
        put("nic_model", nic)
        put("recovery_model", recovery)
        put("selection", SiteSelection.parse(self.lossy_layers, self.lossy_sites))
        self._place_on_fabric(put)

    def _place_on_fabric(self, put) -> None:
        """The network's ranks on the fabric (``fabric.place``), its settings checked; None without one."""
        text = "none" if self.fabric is None else str(self.fabric).strip()
        bad = tuple(b.strip() for b in (self.bad_link.split(";") if isinstance(self.bad_link, str)
                                        else self.bad_link) if str(b).strip())
        put("fabric", text)
        put("bad_link", bad)
        put("corrupt_share", float(self.corrupt_share))
        put("qps_per_connection", int(self.qps_per_connection))
        put("pxn", bool(self.pxn))
        if text.lower() in ("none", ""):
            if bad or self.corrupt_share:
                raise ValueError(f"{'bad_link' if bad else 'corrupt_share'} needs a fabric: set fabric "
                                 "(superpod:SU, leaf-spine:nodes=N,..., or a .yaml file)")
            put("cables", None)
            return
        if self.routing == "spray" and self.nic_model.mode == "go_back_n":
            raise ValueError(f"routing=spray reorders packets, which go-back-N (nic={self.nic}) takes for losses: "
                             "use a selective repeat nic (irn, srd) or routing=ecmp")
        if self.placement is None:
            ranks, per_node, root = tuple(range(self.ranks)), self.topology.ranks_per_node, self.seed
        else:
            ranks, per_node, root = tuple(self.placement[0]), int(self.placement[1]), int(self.placement[2])
        every = None if self.loss.lossless else self.loss.spec
        put("cables", fabric_placement(text, ranks, per_node, channels=self.channels, seed=root,
                                       qps_per_connection=self.qps_per_connection, pxn=self.pxn,
                                       routing=self.routing, bad_link=bad, corrupt_share=self.corrupt_share,
                                       every_cable=every))

    def _tcp_nics(self) -> str:
        """The TCP nics this spec takes in place of its own, as a refusal of a TCP-only setting suggests them
        (``nic=tcp or tcp-bbr``; a nic refused for another setting alone, its message naming no nic, counts)."""
        working = []
        for name in (n for n, preset in NIC_PRESETS.items() if preset.rack):
            try:
                replace(self, nic=name)
            except ValueError as err:
                if "nic=" in str(err):
                    continue
            working.append(name)
        return f"nic={' or '.join(working)}" if working else ""

    def replace(self, **changes) -> "NetworkSpec":
        """A copy with some settings changed (checked again)."""
        return replace(self, **changes)

    @property
    def connections(self) -> int:
        """Connections a send on one link is spread over: NCCL's channels, times its sockets for TCP."""
        return self.channels * (self.sockets if self.nic_model.rack else 1)

    def link(self, link_class: str) -> Link:
        """The Link of class ``intra`` or ``inter``."""
        return self.link_intra if link_class == "intra" else self.link_inter

    @property
    def arch(self) -> str:
        """The GPU generation NCCL's tuner tables are read for (LL ceilings, per-channel caps, NVLS): the
        compute preset's (``h100`` -> hopper, ``a100`` -> ampere); Hopper for any other GPU."""
        return nccl.arch_of(getattr(self.compute, "gpu", ""))

    def bus_bandwidth(self) -> float:
        """Bytes/s a rank's collective traffic sustains: its NVLink port inside a node; across nodes the
        slower of that and the node's NICs together (NCCL spreads its channels over them)."""
        if self.topology.nodes == 1:
            return self.link_intra.bandwidth_Bps
        return min(self.link_intra.bandwidth_Bps, self.nics_per_node * self.link_inter.bandwidth_Bps)

    def as_dict(self) -> dict:
        """The settings as plain values: what a saved network state records and is checked against.
        The recovery policy's settings appear only where the policy uses them, so a zero or rescale
        network's state saved before they existed still loads."""
        out = {"ranks": self.ranks, "loss_model": self.loss.spec, "seed": self.seed,
               "payload_bytes": self.payload_bytes, "recovery": self.recovery, "lossy": list(self.lossy),
               "max_burst": self.max_burst, "algorithm": self.algorithm, "ranks_per_node": self.ranks_per_node,
               "lossy_links": self.lossy_links, "transport": self.transport, "retransmit": self.retransmit,
               "deadline": self.deadline, "link_intra": self.link_intra.spec, "link_inter": self.link_inter.spec,
               "rto_s": self.rto_s, "nic": self.nic, "channels": self.channels,
               "nics_per_node": self.nics_per_node}
        for name in self.recovery_model.settings:
            out[name] = getattr(self, name)
        if self.recovery_model.computes:
            out["compute"] = self.compute.spec      # what the policy's compute is charged at
        if not self.selection.everything:          # likewise: states saved before selections load
            out.update(lossy_layers=str(self.lossy_layers), lossy_sites=str(self.lossy_sites))
        if self.sockets != 1:                      # and before sockets and congestion control
            out["sockets"] = self.sockets
        if self.congestion is not None:
            out["congestion"] = self.congestion
        if self.cables is not None:                # and before the fabric
            out.update(fabric=self.fabric, bad_link=list(self.bad_link), corrupt_share=self.corrupt_share,
                       qps_per_connection=self.qps_per_connection, pxn=self.pxn, routing=self.routing)
        return out

    @property
    def can_lose(self) -> bool:
        """Whether any link can lose a packet: the loss model on a lossy link, or (under a fabric) a link
        whose route crosses a lossy cable."""
        intra = not self.loss.lossless and self.topology.has_lossy_link
        if self.cables is None:
            return intra
        topology = self.topology
        return self.cables.any_lossy() or (intra and topology.lossy_links == "all" and topology.ranks_per_node > 1)

    def link_lossy(self, src: int, dst: int) -> bool:
        """Whether the link src -> dst can lose packets: without a fabric, the topology's rule; under one,
        NVLink inside a node as before and a link between nodes where its route crosses a lossy cable."""
        topology = self.topology
        if self.cables is None or topology.link_class(src, dst) == "intra":
            return not self.loss.lossless and topology.lossy(src, dst)
        return bool(self.cables.lossy(src, dst))

    def link_rate(self, src: int, dst: int) -> float:
        """The share of the link's packets its losses take (under a fabric: on their routes' cables)."""
        if self.cables is None or self.topology.link_class(src, dst) == "intra":
            return self.loss.loss_rate if self.link_lossy(src, dst) else 0.0
        return self.cables.rate(src, dst)


SETTINGS = tuple(f.name for f in fields(NetworkSpec) if f.init)
