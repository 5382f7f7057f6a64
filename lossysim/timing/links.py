"""Links: one link class (intra-node, inter-node), its presets and its spec.

A link has a one-way wire latency ``alpha`` (a round trip is 2 alpha: what a NAK or an ACK costs),
a bandwidth ``B`` per direction of one rank's port, ``header_bytes`` added to every packet on the
wire, and the hardware class NCCL's cost model times it as (``hw``: nvlink, pci or net; see
``lossysim.timing.nccl``). A message of ``w`` wire bytes takes ``alpha + w / B`` (Hockney; Thakur,
Rabenseifner and Gropp 2005). docs/time_model.md gives the presets' sources.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Union

from .specs import NAME_PATTERN, format_rate, format_time, parse_bytes, parse_rate, parse_time, split_spec


HW_CLASSES = ("nvlink", "pci", "net")


@dataclass(frozen=True)
class Link:
    """One link class: alpha (one-way wire latency), bandwidth per direction of one rank's port in
    bytes/s, wire bytes added to every packet, and NCCL's hardware class for its per-hop latency."""
    name: str
    latency_s: float
    bandwidth_Bps: float
    header_bytes: int = 0
    hw: str = "net"

    def __post_init__(self):
        if not NAME_PATTERN.match(str(self.name)):
            raise ValueError(f"name={self.name!r} must be letters, digits, '_', '.' or '-'")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"alpha={self.latency_s!r} must be a finite time >= 0 s")
        if not (math.isfinite(self.bandwidth_Bps) and self.bandwidth_Bps > 0):
            raise ValueError(f"bw={self.bandwidth_Bps!r} must be a finite rate > 0 B/s")
        if int(self.header_bytes) != self.header_bytes or self.header_bytes < 0:
            raise ValueError(f"header={self.header_bytes!r} must be an integer >= 0 bytes")
        if self.hw not in HW_CLASSES:
            raise ValueError(f"hw={self.hw!r} must be one of {', '.join(HW_CLASSES)}")
        object.__setattr__(self, "latency_s", float(self.latency_s))
        object.__setattr__(self, "bandwidth_Bps", float(self.bandwidth_Bps))
        object.__setattr__(self, "header_bytes", int(self.header_bytes))

    @property
    def alpha(self) -> float:
        """alpha = one-way latency per message, seconds."""
        return self.latency_s

    @property
    def beta(self) -> float:
        """beta = 1 / B, seconds per wire byte."""
        return 1.0 / self.bandwidth_Bps

    def wire_bytes(self, payload_bytes: int, packets: int) -> int:
        """wire(S, P) = S + P * header_bytes."""
        if payload_bytes < 0 or packets < 0 or (payload_bytes > 0 and packets < 1):
            raise ValueError(f"payload_bytes={payload_bytes}, packets={packets}: need >= 0 and "
                             "at least one packet for a non-empty payload")
        return int(payload_bytes) + int(packets) * self.header_bytes

    def send_time(self, payload_bytes: int, packets: int, share: int = 1) -> float:
        """t = alpha + wire(S, P) * share / B, share = senders or receivers on the port."""
        if share < 1:
            raise ValueError(f"share={share} must be >= 1")
        return self.latency_s + self.wire_bytes(payload_bytes, packets) * share / self.bandwidth_Bps

    @property
    def spec(self) -> str:
        """A string ``parse_link`` turns back into this exact link."""
        base = LINK_PRESETS.get(self.name)
        if base == self:
            return self.name
        items = {"alpha": format_time(self.latency_s), "bw": format_rate(self.bandwidth_Bps),
                 "header": str(self.header_bytes), "hw": self.hw}
        if base is not None:
            keep = {"alpha": base.latency_s == self.latency_s,
                    "bw": base.bandwidth_Bps == self.bandwidth_Bps,
                    "header": base.header_bytes == self.header_bytes, "hw": base.hw == self.hw}
            return ",".join([self.name] + [f"{k}={v}" for k, v in items.items() if not keep[k]])
        named = [] if self.name == "custom" else [f"name={self.name}"]
        return ",".join(named + [f"{k}={v}" for k, v in items.items() if k != "hw" or self.hw != "net"])


# RoCEv2 per packet: Ethernet 14 + IPv4 20 + UDP 8 + BTH 12 + ICRC 4 + FCS 4 = 62 bytes in the
# frame, plus 8 preamble/SFD + 12 inter-frame gap = 20 bytes of line time: 82 on the wire.
ROCE_HEADER_BYTES = 14 + 20 + 8 + 12 + 4 + 4 + 20
# InfiniBand per packet on a subnet: LRH 8 + BTH 12 + ICRC 4 + VCRC 2 = 26 bytes (no GRH).
IB_HEADER_BYTES = 8 + 12 + 4 + 2

# Wire latencies are assumptions, not facts about any site (a few microseconds per RDMA hop); a
# collective's per-hop latency comes from NCCL's model for the link's hardware class instead.
# NVLink presets carry the bus bandwidth NCCL sustains, not the line rate: NCCL's protocol costs
# about 20% of an H100's 450 GB/s, leaving about 370 GB/s (NVIDIA/nccl-tests#212); an 8 x A100 node
# measures 232 GB/s of its 300 (NVIDIA/nccl-tests#175). The ``-line`` presets keep the line rates.
LINK_PRESETS = {
    "nvlink4": Link("nvlink4", 1e-6, 370e9, 0, "nvlink"),
    "nvlink4-line": Link("nvlink4-line", 1e-6, 450e9, 0, "nvlink"),   # H100: 18 links x 25 GB/s
    "nvlink3": Link("nvlink3", 1e-6, 232e9, 0, "nvlink"),
    "nvlink3-line": Link("nvlink3-line", 1e-6, 300e9, 0, "nvlink"),   # A100: 12 links x 25 GB/s
    "ib-hdr200": Link("ib-hdr200", 3e-6, 200e9 / 8, IB_HEADER_BYTES, "net"),
    "ib-ndr400": Link("ib-ndr400", 3e-6, 400e9 / 8, IB_HEADER_BYTES, "net"),
    "roce-100g": Link("roce-100g", 5e-6, 100e9 / 8, ROCE_HEADER_BYTES, "net"),
    "roce-200g": Link("roce-200g", 5e-6, 200e9 / 8, ROCE_HEADER_BYTES, "net"),
    "roce-400g": Link("roce-400g", 5e-6, 400e9 / 8, ROCE_HEADER_BYTES, "net"),
}


def parse_link(spec: Union[str, Link]) -> Link:
    """A Link from ``nvlink4``, ``roce-200g,alpha=10us`` or ``alpha=2us,bw=200Gbps,header=82[,hw=net]``."""
    if isinstance(spec, Link):
        return spec
    text = str(spec).strip()
    try:
        preset, values = split_spec(text, ("alpha", "bw", "header", "hw", "name"), LINK_PRESETS)
        if preset is None:
            missing = [k for k in ("alpha", "bw") if k not in values]
            if missing:
                raise ValueError(f"{missing[0]} is missing (a preset name or alpha=..,bw=..[,header=..])")
        link = LINK_PRESETS[preset] if preset else Link("custom", 0.0, 1.0, 0)
        changes = {}
        if "name" in values:
            changes["name"] = values["name"]
        if "alpha" in values:
            changes["latency_s"] = parse_time("alpha", values["alpha"])
        if "bw" in values:
            changes["bandwidth_Bps"] = parse_rate("bw", values["bw"])
        if "header" in values:
            changes["header_bytes"] = parse_bytes("header", values["header"])
        if "hw" in values:
            changes["hw"] = values["hw"]
        return replace(link, **changes)
    except ValueError as err:
        raise ValueError(f"bad link spec {text!r}: {err}") from None
