"""Collisions: the flows of one collective step share the cables they cross.

A step's flows (rank to rank, bytes, the channel NCCL sends them on) are routed by ``Routes`` (ECMP
per queue pair, ``qps_per_connection``, spraying, PXN); each directed cable then carries the bytes of
every flow on it, and the step lasts as long as its most loaded cable allows: max over cables of
bytes / speed. A fabric-free model charges each rank its own NIC's time, which is the same max taken
over the NIC cables alone; ``slowdown`` is the ratio of the two, the factor a loss-free step time is
multiplied by on this fabric (1 when no switch-to-switch cable carries more than a NIC's share). The
estimate multiplies each class's loss-free time by it, its concurrent groups' flows (``ring_flows``,
``send_flows``, ``all_to_all_flows``) on the networks' own routes (``estimate.collisions``).

What the hash predicts: k flows of equal size hashed uniformly over u equal cables put
M = the largest of u bin counts on one of them; ``max_flows_pmf(k, u)`` is M's distribution (exact up
to float rounding), and ``expected_max_flows(k, u, switches)`` the mean of the largest M over that many
switches hashing independently (each salts its hash with its own name), which is what a step whose
every leaf sends k flows up is held to.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from .graph import Fabric
from .routes import Routes

PACKET_BYTES = 4096   # RoCE / InfiniBand at MTU 4096: how a message is cut into the packets routes split


@dataclass(frozen=True)
class Flow:
    """``bytes`` from rank ``src`` to rank ``dst`` on NCCL channel ``channel`` (its own connection)."""
    src: int
    dst: int
    bytes: float
    channel: int = 0


def cable_loads(routes: Routes, flows: Iterable[Flow], packet_bytes: int = PACKET_BYTES) -> np.ndarray:
    """Bytes on each directed cable of ``routes.fabric`` (indexed as ``fabric.cables``): each flow's
    packets split over its connection's routes as the routes say (queue pair i mod q, or sprayed), a
    packet's bytes on every cable of its route. Flows inside one node (NVLink) load no cable."""
    if packet_bytes <= 0:
        raise ValueError(f"packet_bytes={packet_bytes!r} must be > 0")
    cables, shares = [], []   # summed once at the end (an estimate's all-to-alls are 10^5 flows)
    for flow in flows:
        if flow.bytes < 0:
            raise ValueError(f"flow {flow.src}->{flow.dst} has bytes={flow.bytes!r}; it must be >= 0")
        connection = routes.connection(flow.src, flow.dst, flow.channel)
        if not connection or flow.bytes == 0:
            continue
        packets = max(1, math.ceil(flow.bytes / packet_bytes))
        for route in connection:
            cables += route.cables
            shares += [flow.bytes * route.packets(packets) / packets] * len(route.cables)
    return np.bincount(np.asarray(cables, dtype=np.int64), weights=np.asarray(shares, dtype=float),
                       minlength=len(routes.fabric.cables)).astype(float)


def cable_seconds(fabric: Fabric, loads: np.ndarray, speed: Optional[np.ndarray] = None) -> np.ndarray:
    """Seconds each cable needs for its bytes at its speed (``speed``: a factor per cable, 1 = full;
    a cable at 0 that carries bytes never ends: inf)."""
    gbps = np.array([c.gbps for c in fabric.cables])
    if speed is not None:
        gbps = gbps * np.asarray(speed, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(loads > 0, loads * 8 / (gbps * 1e9), 0.0)
    return out


def step_seconds(fabric: Fabric, loads: np.ndarray, speed: Optional[np.ndarray] = None) -> float:
    """How long the step's bytes take: its most loaded cable's seconds."""
    seconds = cable_seconds(fabric, loads, speed)
    return float(seconds.max()) if len(seconds) else 0.0


def bottleneck(fabric: Fabric, loads: np.ndarray, speed: Optional[np.ndarray] = None) -> tuple[str, float]:
    """The cable that holds the step longest, and its seconds."""
    seconds = cable_seconds(fabric, loads, speed)
    i = int(np.argmax(seconds))
    return fabric.cables[i].name, float(seconds[i])


def nic_cables(fabric: Fabric) -> np.ndarray:
    """Whether each directed cable joins a NIC to its switch (the cables a fabric-free model charges)."""
    return np.array([fabric.tier(c.src) == "nic" or fabric.tier(c.dst) == "nic" for c in fabric.cables])


def slowdown(routes: Routes, flows: Sequence[Flow], packet_bytes: int = PACKET_BYTES) -> float:
    """The step's seconds on the fabric over its seconds with only the NIC cables holding it (>= 1; 1
    when no flow crosses the fabric): what to multiply a fabric-free loss-free time by."""
    fabric = routes.fabric
    seconds = cable_seconds(fabric, cable_loads(routes, flows, packet_bytes))
    nic = seconds[nic_cables(fabric)]
    base = float(nic.max()) if len(nic) else 0.0
    return float(seconds.max()) / base if base > 0 else 1.0


def ring_flows(groups: Iterable[Sequence[int]], bytes_per_rank: float, channels: int = 1) -> list[Flow]:
    """One step of ring collectives run at once, one per group (ranks in ring order): each rank sends
    ``bytes_per_rank`` to its successor, split evenly over ``channels`` (each its own connection)."""
    channels = _channels(channels)
    flows = []
    for group in groups:
        group = list(group)
        if len(group) < 2:
            continue
        for i, src in enumerate(group):
            dst = group[(i + 1) % len(group)]
            flows += [Flow(src, dst, bytes_per_rank / channels, c) for c in range(channels)]
    return flows


def tree_flows(groups: Iterable[Sequence[int]], bytes_per_rank: float, channels: int = 1,
               ranks_per_node: int = 1) -> list[Flow]:
    """One step of tree all-reduces run at once, one per group, as NCCL lays them out: a chain through each
    node's ranks (in the group's order) and, across nodes, a double binary tree of the nodes (``dtree_parents``)
    joining each node's first rank to its parent node's; each tree carries half the message, reduced up and
    broadcast down, so every tree edge carries ``bytes_per_rank / 2`` each way, split over ``channels``."""
    channels = _channels(channels)
    flows = []
    for group in groups:
        nodes: dict[int, list[int]] = {}
        for rank in group:
            nodes.setdefault(rank // ranks_per_node, []).append(rank)
        leaders = [ranks[0] for ranks in nodes.values()]
        # the chains (each message whole, both ways: NVLink, which loads no cable) and the trees' edges
        edges = [(a, b, 1.0) for ranks in nodes.values() for a, b in zip(ranks, ranks[1:])]
        edges += [(child, leaders[parent], 0.5) for tree in dtree_parents(len(leaders))
                  for child, parent in zip(leaders, tree) if parent >= 0]
        flows += [Flow(x, y, share * bytes_per_rank / channels, c) for a, b, share in edges
                  for x, y in ((a, b), (b, a)) for c in range(channels)]
    return flows


def _btree_parent(n: int, rank: int) -> int:
    """NCCL's binary tree over ``n`` ranks (root 0): the parent of ``rank`` (-1 for the root)."""
    if rank == 0:
        return -1
    bit = 1
    while bit < n and not bit & rank:
        bit <<= 1
    up = (rank ^ bit) | (bit << 1)
    return up if up < n else rank ^ bit


def dtree_parents(n: int) -> tuple[list[int], list[int]]:
    """NCCL's double binary tree over ``n`` ranks: each rank's parent in the first tree (the binary tree)
    and in the second (the first mirrored, rank r as n-1-r, for an even n; shifted by one for an odd n),
    -1 for a root."""
    first = [_btree_parent(n, r) for r in range(n)]
    if n % 2:
        second = [-1 if (p := _btree_parent(n, (r - 1) % n)) < 0 else (p + 1) % n for r in range(n)]
    else:
        second = [-1 if (p := first[n - 1 - r]) < 0 else n - 1 - p for r in range(n)]
    return first, second


def send_flows(pairs: Iterable[tuple[int, int]], bytes_per_send: float, channels: int = 1) -> list[Flow]:
    """Point-to-point sends run at once (a pipeline tick's, an all-to-all's): ``bytes_per_send`` from each
    pair's first rank to its second, split evenly over ``channels``."""
    channels = _channels(channels)
    return [Flow(src, dst, bytes_per_send / channels, c) for src, dst in pairs if src != dst for c in range(channels)]


def all_to_all_flows(groups: Iterable[Sequence[int]], bytes_per_pair: float, channels: int = 1) -> list[Flow]:
    """All-to-alls run at once, one per group: every rank sends ``bytes_per_pair`` to every other (uniform
    routing)."""
    return send_flows(((s, d) for group in groups for s in group for d in group), bytes_per_pair, channels)


def _channels(channels) -> int:
    if isinstance(channels, bool) or int(channels) != channels or channels < 1:
        raise ValueError(f"channels={channels!r} must be a whole number >= 1")
    return int(channels)


def ring_slowdown(routes: Routes, groups: Iterable[Sequence[int]], channels: int = 1,
                  bytes_per_rank: float = 64 * 2**20) -> float:
    """The factor by which one step of the rings ``groups`` (all at once, each rank's ``bytes_per_rank``
    over ``channels``) is slower on ``routes``' fabric than a fabric-free model says: multiply the
    loss-free ring time by it. The bytes cancel but for a packet's rounding."""
    return slowdown(routes, ring_flows(groups, bytes_per_rank, channels))


def max_flows_pmf(k: int, u: int) -> np.ndarray:
    """P(M = m), m = 0..k: M the most flows on one of ``u`` equal cables when ``k`` flows are hashed
    uniformly over them. P(every cable <= m) by conditioning cable by cable: the first of the j cables
    left takes Binomial(n, 1/j) of the n flows left."""
    if k < 0 or u < 1:
        raise ValueError(f"k={k!r} flows over u={u!r} cables: need k >= 0 and u >= 1")
    if k == 0:
        return np.array([1.0])
    from scipy import stats   # here: scipy.stats costs every process that imports this module 0.6 s
    n = np.arange(k + 1)
    below = np.zeros(k + 1)
    for m in range(k + 1):
        within = (n <= m).astype(float)          # one cable left: it holds all n, fine if n <= m
        for j in range(2, u + 1):
            take = np.arange(min(m, k) + 1)
            pmf = stats.binom.pmf(take[None, :], n[:, None], 1.0 / j)   # [n, taken by this cable]
            rest = np.clip(n[:, None] - take[None, :], 0, None)
            within = (pmf * np.where(take[None, :] <= n[:, None], within[rest], 0.0)).sum(axis=1)
        below[m] = within[k]
        if below[m] >= 1 - 1e-15:
            below[m:] = 1.0
            break
    return np.diff(np.concatenate([[0.0], below]))


def expected_max_flows(k: int, u: int, switches: int = 1) -> float:
    """E[the largest M over ``switches`` independent hashes of k flows over u cables]."""
    below = np.cumsum(max_flows_pmf(k, u)) ** switches
    pmf = np.diff(np.concatenate([[0.0], below]))
    return float((np.arange(len(pmf)) * pmf).sum())
