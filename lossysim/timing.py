"""The time model: what a collective and a training step cost on a modelled cluster.

Links follow the alpha-beta model (Hockney; Thakur, Rabenseifner and Gropp 2005): a
message of ``w`` wire bytes takes ``alpha + w * beta`` with ``beta = 1 / B``. Each rank
has one port per link class (intra-node, inter-node) with bandwidth ``B`` per direction;
within one step the sends of a rank on a class share its egress port and the receives
share its ingress port. A collective is a sequence of steps; a step ends when its
slowest send ends, and steps do not overlap. Compute time is modelled from a GPU's peak
FLOP/s and an MFU, or measured on a real GPU. docs/time_model.md gives every formula
and assumption; the closed forms here are checked against ``step_time`` in the tests.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Union

# ---------------------------------------------------------------------------- links

# Divisors, not factors: 10 / 1e6 is exactly the double nearest 10 us, 10 * 1e-6 is not.
_TIME_UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}
_RATE_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_RATE_UNIT = re.compile(r"^\s*([0-9.eE+-]+)\s*([kKMGT]?)(bps|b/s|Bps|B/s)\s*$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class Link:
    """One link class: alpha (one-way latency per message), bandwidth per direction of
    one rank's port in bytes/s, and wire bytes added to every packet."""
    name: str
    latency_s: float
    bandwidth_Bps: float
    header_bytes: int = 0

    def __post_init__(self):
        if not _NAME.match(str(self.name)):
            raise ValueError(f"name={self.name!r} must be letters, digits, '_', '.' or '-'")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"alpha={self.latency_s!r} must be a finite time >= 0 s")
        if not (math.isfinite(self.bandwidth_Bps) and self.bandwidth_Bps > 0):
            raise ValueError(f"bw={self.bandwidth_Bps!r} must be a finite rate > 0 B/s")
        if int(self.header_bytes) != self.header_bytes or self.header_bytes < 0:
            raise ValueError(f"header={self.header_bytes!r} must be an integer >= 0 bytes")
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
        items = {"alpha": _format_time(self.latency_s), "bw": _format_rate(self.bandwidth_Bps),
                 "header": str(self.header_bytes)}
        if base is not None:
            keep = {"alpha": base.latency_s == self.latency_s,
                    "bw": base.bandwidth_Bps == self.bandwidth_Bps,
                    "header": base.header_bytes == self.header_bytes}
            return ",".join([self.name] + [f"{k}={v}" for k, v in items.items() if not keep[k]])
        named = [] if self.name == "custom" else [f"name={self.name}"]
        return ",".join(named + [f"{k}={v}" for k, v in items.items()])


# RoCEv2 per packet: Ethernet 14 + IPv4 20 + UDP 8 + BTH 12 + ICRC 4 + FCS 4 = 62 bytes in the
# frame, plus 8 preamble/SFD + 12 inter-frame gap = 20 bytes of line time: 82 on the wire.
ROCE_HEADER_BYTES = 14 + 20 + 8 + 12 + 4 + 4 + 20
# InfiniBand per packet on a subnet: LRH 8 + BTH 12 + ICRC 4 + VCRC 2 = 26 bytes (no GRH).
IB_HEADER_BYTES = 8 + 12 + 4 + 2

# Latencies are assumptions, not facts about any site: NCCL's own tuning model charges
# 0.5-3.4 us per NVLink hop and 2.7-14 us per network hop, depending on the protocol.
LINK_PRESETS = {
    "nvlink4": Link("nvlink4", 1e-6, 450e9, 0),            # H100: 18 links, 450 GB/s per direction
    "ib-ndr400": Link("ib-ndr400", 3e-6, 400e9 / 8, IB_HEADER_BYTES),
    "roce-100g": Link("roce-100g", 5e-6, 100e9 / 8, ROCE_HEADER_BYTES),
    "roce-200g": Link("roce-200g", 5e-6, 200e9 / 8, ROCE_HEADER_BYTES),
    "roce-400g": Link("roce-400g", 5e-6, 400e9 / 8, ROCE_HEADER_BYTES),
}


def _number(x: float) -> str:
    """The shortest decimal that reads back as exactly ``x``."""
    return next(t for t in (f"{x:.{d}g}" for d in range(1, 18)) if float(t) == x)


def _decimal(scaled: float, exact) -> str:
    """The shortest rounding of ``scaled`` whose text satisfies ``exact``; repr if none."""
    for places in range(16):
        text = repr(round(scaled, places)).removesuffix(".0")
        if exact(text):
            return text
    return repr(scaled)


def _format_time(seconds: float) -> str:
    if seconds == 0:
        return "0s"
    for unit in ("s", "ms", "us", "ns"):
        divisor = _TIME_UNITS[unit]
        text = _decimal(seconds * divisor, lambda t: float(t) / divisor == seconds)
        if (float(text) >= 1 or unit == "ns") and float(text) / divisor == seconds:
            return text + unit
    return f"{seconds!r}s"


def _format_rate(bytes_per_s: float) -> str:
    for prefix in ("T", "G", "M", "K", ""):
        factor = _RATE_PREFIX[prefix]
        text = _decimal(bytes_per_s * 8 / factor, lambda t: float(t) * factor / 8 == bytes_per_s)
        if float(text) >= 1 and float(text) * factor / 8 == bytes_per_s:
            return text + prefix + "bps"
    return f"{bytes_per_s!r}B/s"


def _parse_time(field: str, text: str) -> float:
    match = re.match(r"^\s*([0-9.eE+-]+)\s*(s|ms|us|µs|ns)\s*$", text)
    try:
        if match:
            return float(match.group(1)) / _TIME_UNITS[match.group(2)]
    except ValueError:
        pass
    raise ValueError(f"{field}={text!r} is not a time with a unit (s, ms, us, ns)")


def _parse_rate(field: str, text: str) -> float:
    match = _RATE_UNIT.match(text)
    try:
        if match:
            value = float(match.group(1)) * _RATE_PREFIX[match.group(2)]
            return value / 8 if match.group(3) in ("bps", "b/s") else value
    except ValueError:
        pass
    raise ValueError(f"{field}={text!r} is not a rate with a unit (bps, Kbps, Mbps, Gbps, Tbps "
                     "or B/s, KB/s, MB/s, GB/s, TB/s)")


def _parse_int(field: str, text: str) -> int:
    text = text.strip().removesuffix("B")
    if not re.match(r"^\d+$", text):
        raise ValueError(f"{field}={text!r} is not a whole number of bytes")
    return int(text)


def _split_spec(text: str, keys: tuple[str, ...], presets: dict) -> tuple[str | None, dict]:
    """``[preset,]key=value,...`` -> (preset or None, {key: text}), one-line errors."""
    if not text:
        raise ValueError(f"empty spec; expected a preset ({', '.join(presets)}) or {'=..,'.join(keys)}=..")
    items = [item.strip() for item in text.split(",")]
    preset = None
    if items and "=" not in items[0]:
        preset = items.pop(0)
        if preset not in presets:
            raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(presets)} "
                             f"or {'=..,'.join(keys)}=..")
    values = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise ValueError(f"{item!r} is not key=value")
        if key not in keys:
            raise ValueError(f"unknown key {key}={value}; expected {', '.join(keys)}")
        if key in values:
            raise ValueError(f"{key} given twice")
        values[key] = value.strip()
    return preset, values


def parse_link(spec: Union[str, Link]) -> Link:
    """A Link from ``nvlink4``, ``roce-200g,alpha=10us`` or ``alpha=2us,bw=200Gbps,header=82``."""
    if isinstance(spec, Link):
        return spec
    text = str(spec).strip()
    try:
        preset, values = _split_spec(text, ("alpha", "bw", "header", "name"), LINK_PRESETS)
        if preset is None:
            missing = [k for k in ("alpha", "bw") if k not in values]
            if missing:
                raise ValueError(f"{missing[0]} is missing (a preset name or alpha=..,bw=..[,header=..])")
        link = LINK_PRESETS[preset] if preset else Link("custom", 0.0, 1.0, 0)
        changes = {}
        if "name" in values:
            changes["name"] = values["name"]
        if "alpha" in values:
            changes["latency_s"] = _parse_time("alpha", values["alpha"])
        if "bw" in values:
            changes["bandwidth_Bps"] = _parse_rate("bw", values["bw"])
        if "header" in values:
            changes["header_bytes"] = _parse_int("header", values["header"])
        return replace(link, **changes)
    except ValueError as err:
        raise ValueError(f"bad link spec {text!r}: {err}") from None


# ---------------------------------------------------------------------------- steps

def packet_count(payload_bytes: int, packet_payload: int) -> int:
    """P = ceil(S / packet_payload): the last packet may be partial."""
    if packet_payload < 1:
        raise ValueError(f"packet_payload={packet_payload} must be >= 1 byte")
    return -(-int(payload_bytes) // int(packet_payload))


def step_time(sends: Iterable[tuple]) -> float:
    """max over sends of alpha + wire(S, P) * max(out_degree(src), in_degree(dst)) / B + extra.

    A send is (src, dst, payload_bytes, packets, link[, extra_s]): link is the class of that
    pair; count retransmitted packets in payload_bytes and packets, and put time spent
    waiting (timeouts, round trips to a NAK) in extra_s. Degrees count this step's sends on
    the same class; a class is a Link value, so give the intra- and inter-node classes
    different names if they must not share ports. An empty step takes no time.
    """
    sends = [tuple(send) for send in sends]
    for send in sends:
        if len(send) not in (5, 6):
            raise ValueError(f"send={send!r} must be (src, dst, payload_bytes, packets, link[, extra_s])")
        if send[0] == send[1]:
            raise ValueError(f"a rank cannot send to itself (src=dst={send[0]})")
        if len(send) == 6 and not send[5] >= 0:
            raise ValueError(f"extra_s={send[5]!r} must be >= 0")
    out_degree = Counter((send[0], send[4]) for send in sends)
    in_degree = Counter((send[1], send[4]) for send in sends)
    return max((link.send_time(size, packets, max(out_degree[src, link], in_degree[dst, link]))
                + (extra[0] if extra else 0.0)
                for src, dst, size, packets, link, *extra in sends), default=0.0)


def _sizes(R: int, M: int) -> tuple[int, int]:
    if int(R) != R or R < 1 or int(M) != M or M < 0:
        raise ValueError(f"R={R}, M={M}: need a whole number of ranks >= 1 and of bytes >= 0")
    return int(R), int(M)


def _chunks(total_bytes: int, parts: int) -> list[int]:
    """Near-equal split: the first total % parts chunks get one byte more."""
    base, extra = divmod(int(total_bytes), parts)
    return [base + (i < extra) for i in range(parts)]


def _depth(rank: int) -> int:
    return (rank + 1).bit_length() - 1


def schedule(algorithm: str, ranks: int, message_bytes: int) -> list[list[tuple[int, int, int]]]:
    """The steps of a collective, each a list of (src, dst, payload_bytes); empty sends omitted.

    ``message_bytes`` is M (each rank's whole message) for all-reduces and the shard S
    for all-gathers. Algorithms: ring_all_reduce, ring_all_gather, tree_all_reduce,
    direct_all_reduce, direct_all_gather.
    """
    R, M = _sizes(ranks, message_bytes)
    if algorithm == "ring_all_reduce":
        chunk = _chunks(M, R)
        # reduce-scatter: at step s rank r passes partial chunk (r - s) to r + 1; all-gather:
        # at step s rank r passes the finished chunk (r + 1 - s) on.
        steps = [[(r, (r + 1) % R, chunk[(r - s) % R]) for r in range(R)] for s in range(R - 1)]
        steps += [[(r, (r + 1) % R, chunk[(r + 1 - s) % R]) for r in range(R)] for s in range(R - 1)]
    elif algorithm == "ring_all_gather":
        steps = [[(r, (r + 1) % R, M) for r in range(R)] for _ in range(R - 1)]
    elif algorithm == "tree_all_reduce":
        levels = range(1, _depth(R - 1) + 1)
        reduce = [[(r, (r - 1) // 2, M) for r in range(R) if _depth(r) == d] for d in reversed(levels)]
        broadcast = [[((r - 1) // 2, r, M) for r in range(R) if _depth(r) == d] for d in levels]
        steps = reduce + broadcast
    elif algorithm in ("direct_all_reduce", "direct_all_gather"):
        steps = [[(r, q, M) for r in range(R) for q in range(R) if q != r]] if R > 1 else []
    else:
        raise ValueError(f"algorithm={algorithm!r} must be one of {', '.join(ALGORITHMS)}")
    return [kept for kept in ([send for send in step if send[2] > 0] for step in steps) if kept]


ALGORITHMS = ("ring_all_reduce", "ring_all_gather", "tree_all_reduce", "direct_all_reduce",
              "direct_all_gather")


def schedule_time(steps, link: Union[Link, Callable[[int, int], Link]], packet_payload: int) -> float:
    """Sum of step_time over the steps; ``link`` is one Link or a function (src, dst) -> Link."""
    link_of = link if callable(link) else (lambda src, dst: link)
    return sum(step_time((src, dst, size, packet_count(size, packet_payload), link_of(src, dst))
                         for src, dst, size in step) for step in steps)


def _send(link: Link, size: int, packet_payload: int, share: int = 1) -> float:
    return link.send_time(size, packet_count(size, packet_payload), share) if size > 0 else 0.0


def ring_all_reduce_time(R: int, M: int, link: Link, packet_payload: int = 1450) -> float:
    """2(R-1) (alpha + wire(C, ceil(C / pp)) / B), C = ceil(M / R) the largest chunk;
    = 2(R-1)(alpha + M / (R B)) with no headers and R dividing M."""
    R, M = _sizes(R, M)
    return 2 * (R - 1) * _send(link, -(-M // R), packet_payload)


def ring_all_gather_time(R: int, shard_bytes: int, link: Link, packet_payload: int = 1450) -> float:
    """(R-1) (alpha + wire(S, ceil(S / pp)) / B), S = each rank's shard."""
    R, shard_bytes = _sizes(R, shard_bytes)
    return (R - 1) * _send(link, shard_bytes, packet_payload)


def tree_all_reduce_time(R: int, M: int, link: Link, packet_payload: int = 1450) -> float:
    """2 sum_{d=1..D} (alpha + k_d wire(M) / B): one binary tree in heap layout, depth
    D = floor(log2 R), k_d = min(2, n_d) children sharing a port, n_d = min(2^d, R - 2^d + 1)."""
    R, M = _sizes(R, M)
    return 2 * sum(_send(link, M, packet_payload, min(2, R - 2**d + 1))
                   for d in range(1, _depth(R - 1) + 1))


def direct_all_reduce_time(R: int, M: int, link: Link, packet_payload: int = 1450) -> float:
    """alpha + (R-1) wire(M) / B: every rank sends its whole message to each of R-1 peers."""
    R, M = _sizes(R, M)
    return _send(link, M, packet_payload, R - 1) if R > 1 else 0.0


def direct_all_gather_time(R: int, shard_bytes: int, link: Link, packet_payload: int = 1450) -> float:
    """alpha + (R-1) wire(S) / B: every rank sends its shard to each of R-1 peers."""
    R, shard_bytes = _sizes(R, shard_bytes)
    return _send(link, shard_bytes, packet_payload, R - 1) if R > 1 else 0.0


BUSBW_FACTORS = {
    "all_reduce": lambda R: 2 * (R - 1) / R,
    "all_gather": lambda R: (R - 1) / R,
    "reduce_scatter": lambda R: (R - 1) / R,
    "broadcast": lambda R: 1.0,
    "reduce": lambda R: 1.0,
}


def algbw(M: float, t: float) -> float:
    """algbw = M / t (nccl-tests: M is the all-gather's whole output, R * shard)."""
    return M / t


def busbw(kind: str, R: int, M: float, t: float) -> float:
    """busbw = algbw * 2(R-1)/R (all_reduce), (R-1)/R (all_gather, reduce_scatter), 1 (broadcast, reduce)."""
    if kind not in BUSBW_FACTORS:
        raise ValueError(f"kind={kind!r} must be one of {', '.join(BUSBW_FACTORS)}")
    return algbw(M, t) * BUSBW_FACTORS[kind](R)


# ---------------------------------------------------------------------------- retransmission

TCP_RTO_MIN_S = 0.2       # Linux TCP_RTO_MIN (HZ / 5)
IB_TIMEOUT_DEFAULT = 20   # NCCL_IB_TIMEOUT default in current NCCL releases (18 and 14 earlier)


def selective_repeat_transmissions(p: float) -> float:
    """E[transmissions per delivered packet] = 1 / (1 - p): geometric under i.i.d. loss p."""
    _check_loss(p)
    return 1.0 / (1.0 - p)


def go_back_n_transmissions(p: float, window: int) -> float:
    """E = (1 + p W) / (1 - p): each loss also wastes the W transmissions in flight behind it.

    Failures before success are geometric with mean p / (1 - p), each costing 1 + W:
    E = 1 + (1 + W) p / (1 - p) = (1 + p W) / (1 - p).
    """
    _check_loss(p)
    if window < 0:
        raise ValueError(f"window={window} must be >= 0 packets")
    return (1.0 + p * window) / (1.0 - p)


def window_packets(link: Link, packet_payload: int = 1450) -> int:
    """W = ceil(2 alpha B / wire(pp, 1)): full packets sent during one round trip."""
    return math.ceil(2 * link.latency_s * link.bandwidth_Bps / link.wire_bytes(packet_payload, 1))


def ib_timeout_s(t: int = IB_TIMEOUT_DEFAULT) -> float:
    """IB local ACK timeout = 4.096 us * 2^t (NCCL_IB_TIMEOUT = t)."""
    if int(t) != t or not 0 <= t <= 31:
        raise ValueError(f"t={t!r} must be an integer in [0, 31]")
    return 4.096e-6 * 2**int(t)


def _check_loss(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p={p!r} must be a loss probability in [0, 1)")


# ---------------------------------------------------------------------------- compute

# Dense (no 2:4 sparsity) bf16 tensor-core peaks, FLOP/s, from the vendors' datasheets.
GPU_PRESETS = {
    "h100": 989.4e12,       # H100 SXM5
    "h100-pcie": 756e12,
    "h200": 989.4e12,       # H200 SXM
    "a100": 312e12,
    "b200": 2.25e15,        # HGX B200
    "l4": 121e12,
    "mi300x": 1307.4e12,
}
DEFAULT_MFU = 0.4           # large-scale bf16 training reports sit at 0.38-0.46


@dataclass(frozen=True)
class Compute:
    """Modelled compute: a GPU's dense bf16 peak FLOP/s times a model FLOPs utilisation."""
    gpu: str
    peak_flops: float
    mfu: float = DEFAULT_MFU

    def __post_init__(self):
        if not _NAME.match(str(self.gpu)):
            raise ValueError(f"name={self.gpu!r} must be letters, digits, '_', '.' or '-'")
        if not (math.isfinite(self.peak_flops) and self.peak_flops > 0):
            raise ValueError(f"flops={self.peak_flops!r} must be a finite FLOP/s > 0")
        if not 0.0 < self.mfu <= 1.0:
            raise ValueError(f"mfu={self.mfu!r} must be in (0, 1]")
        object.__setattr__(self, "peak_flops", float(self.peak_flops))
        object.__setattr__(self, "mfu", float(self.mfu))

    def step_time(self, parameters: float, tokens: float, tp_size: int = 1) -> float:
        """t = 6 N T / tp / (peak * mfu): forward 2NT plus backward 4NT, split over tp ranks."""
        if parameters < 0 or tokens < 0 or tp_size < 1:
            raise ValueError(f"parameters={parameters}, tokens={tokens}, tp_size={tp_size}: "
                             "need >= 0, >= 0, >= 1")
        return 6.0 * parameters * tokens / tp_size / (self.peak_flops * self.mfu)

    @property
    def spec(self) -> str:
        """A string ``parse_compute`` turns back into this exact model."""
        mfu = [] if self.mfu == DEFAULT_MFU else [f"mfu={_number(self.mfu)}"]
        if GPU_PRESETS.get(self.gpu) == self.peak_flops:
            return ",".join([self.gpu] + mfu)
        named = [] if self.gpu == "custom" else [f"name={self.gpu}"]
        return ",".join(named + [f"flops={_number(self.peak_flops)}"] + mfu)


@dataclass(frozen=True)
class Measured:
    """Compute time measured on the GPU that runs the simulation (refused on a CPU)."""
    spec = "measured"


MEASURED = Measured()
_FLOPS_PREFIX = {"": 1.0, "g": 1e9, "t": 1e12, "p": 1e15}


def _parse_flops(text: str) -> float:
    match = re.match(r"^\s*([0-9.e+-]+)\s*(?:([gtp]?)flop(?:s|/s))?\s*$", text, re.IGNORECASE)
    try:
        if match:
            return float(match.group(1)) * _FLOPS_PREFIX[(match.group(2) or "").lower()]
    except ValueError:
        pass
    raise ValueError(f"flops={text!r} is not a FLOP/s figure (e.g. 989e12 or 989TFLOPS)")


def _parse_fraction(field: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{field}={text!r} is not a number") from None


def parse_compute(spec: Union[str, Compute, Measured]) -> Union[Compute, Measured]:
    """``measured``, ``h100``, ``h100,mfu=0.35`` or ``flops=1e15,mfu=0.5``."""
    if isinstance(spec, (Compute, Measured)):
        return spec
    text = str(spec).strip()
    if text == "measured":
        return MEASURED
    try:
        preset, values = _split_spec(text, ("flops", "mfu", "name"), GPU_PRESETS)
        if preset is None and "flops" not in values:
            raise ValueError("flops is missing (measured, a GPU name or flops=..[,mfu=..])")
        compute = Compute(preset, GPU_PRESETS[preset]) if preset else Compute("custom", 1.0)
        changes = {}
        if "name" in values:
            changes["gpu"] = values["name"]
        if "flops" in values:
            changes["peak_flops"] = _parse_flops(values["flops"])
        if "mfu" in values:
            changes["mfu"] = _parse_fraction("mfu", values["mfu"])
        return replace(compute, **changes)
    except ValueError as err:
        raise ValueError(f"bad compute spec {text!r}: {err}") from None


__all__ = ["Link", "LINK_PRESETS", "parse_link", "packet_count", "step_time", "schedule",
           "schedule_time", "ALGORITHMS", "ring_all_reduce_time", "ring_all_gather_time",
           "tree_all_reduce_time", "direct_all_reduce_time", "direct_all_gather_time", "algbw",
           "busbw", "selective_repeat_transmissions", "go_back_n_transmissions", "window_packets",
           "TCP_RTO_MIN_S", "IB_TIMEOUT_DEFAULT", "ib_timeout_s", "Compute", "GPU_PRESETS",
           "DEFAULT_MFU", "Measured", "MEASURED", "parse_compute"]
