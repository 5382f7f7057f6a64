"""Collectives on links: how long each step of a schedule takes, and the closed forms.

A collective is a sequence of steps (``lossysim.net.algorithms`` says which sends each step
makes). Within a step the sends of a rank on one link class share its egress port and the
receives share its ingress port; a step ends when its slowest send ends, and steps do not
overlap. ``step_time`` is what the network charges; the closed forms below are the textbook
alpha-beta costs of the same schedules, which the tests hold against the network's clock.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable, Union

from .links import Link

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
