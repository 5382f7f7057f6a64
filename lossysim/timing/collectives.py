"""Collectives on links: how long each step of a schedule takes, and the closed forms.

A collective is a sequence of steps (``lossysim.net.algorithms`` says which sends each step
makes). Within a step the sends of a rank on one link class share its egress port and the
receives share its ingress port; a step ends when its slowest send ends, and steps do not
overlap. ``step_time`` is what the network charges for a loss-free direct collective (a ring's or a
tree's is NCCL's model, ``lossysim.timing.nccl``; repairs are charged by ``lossysim.net.transport``);
the closed forms below are the textbook alpha-beta costs of the same schedules.
"""
from __future__ import annotations

from collections import Counter
from typing import NamedTuple, Sequence

from .links import Link


def packet_count(payload_bytes: int, packet_payload: int) -> int:
    """P = ceil(S / packet_payload): the last packet may be partial."""
    if packet_payload < 1:
        raise ValueError(f"packet_payload={packet_payload} must be >= 1 byte")
    return -(-int(payload_bytes) // int(packet_payload))


class SendTime(NamedTuple):
    """A send's loss-free cost: ``seconds = alpha + packets * tau``, tau the wire time of one packet
    on its (shared) port."""
    alpha: float
    tau: float
    seconds: float


def send_times(sends: Sequence[tuple]) -> list[SendTime]:
    """The cost of every send of one step, its ports shared.

    A send is ``(src, dst, payload_bytes, packets, link[, port])``: ``link`` is the Link of that pair
    and ``port`` names the port class it uses (default: the link itself; the network passes
    ``intra`` or ``inter``). Within the step a rank's sends on one port class share its egress and
    its receives share its ingress, so a send moves ``wire(S, P) * share`` bytes' worth of time,
    ``share = max(out_degree(src), in_degree(dst))``: ``t = alpha + wire(S, P) * share / B``.
    """
    sends = [tuple(send) for send in sends]
    for send in sends:
        if len(send) not in (5, 6):
            raise ValueError(f"send={send!r} must be (src, dst, payload_bytes, packets, link[, port])")
        if send[0] == send[1]:
            raise ValueError(f"a rank cannot send to itself (src=dst={send[0]})")
    port = [send[5] if len(send) == 6 else send[4] for send in sends]
    out_degree = Counter((send[0], p) for send, p in zip(sends, port))
    in_degree = Counter((send[1], p) for send, p in zip(sends, port))
    times = []
    for (src, dst, size, packets, link, *_), p in zip(sends, port):
        share = max(out_degree[src, p], in_degree[dst, p])
        wire = link.wire_bytes(size, packets) if packets else 0
        times.append(SendTime(link.latency_s, wire * share / link.bandwidth_Bps / packets if packets else 0.0,
                              link.send_time(size, packets, share) if packets else 0.0))
    return times


def step_time(sends: Sequence[tuple]) -> float:
    """A step ends when its slowest send ends: max over ``send_times``; an empty step takes no time."""
    return max((t.seconds for t in send_times(sends)), default=0.0)


def _sizes(R: int, M: int) -> tuple[int, int]:
    if int(R) != R or R < 1 or int(M) != M or M < 0:
        raise ValueError(f"R={R}, M={M}: need a whole number of ranks >= 1 and of bytes >= 0")
    return int(R), int(M)


def _depth(rank: int) -> int:
    return (rank + 1).bit_length() - 1


def _send(link: Link, size: int, packet_payload: int, share: int = 1) -> float:
    return link.send_time(size, packet_count(size, packet_payload), share) if size > 0 else 0.0


def _largest_chunk(R: int, M: int, packet_payload: int) -> int:
    """Bytes of the largest ring chunk: chunks are whole packets, split as evenly as they go, so the
    first holds ceil(P / R) packets (or the whole message when it is shorter)."""
    return min(-(-packet_count(M, packet_payload) // R) * packet_payload, M)


def ring_all_reduce_time(R: int, M: int, link: Link, packet_payload: int = 1450) -> float:
    """2(R-1) (alpha + wire(C, ceil(C / pp)) / B), C = min(ceil(P / R) pp, M) the largest chunk, P =
    ceil(M / pp) packets; = 2(R-1)(alpha + M / (R B)) with no headers and chunks of whole packets."""
    R, M = _sizes(R, M)
    return 2 * (R - 1) * _send(link, _largest_chunk(R, M, packet_payload), packet_payload)


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
