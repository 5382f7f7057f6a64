"""Collective algorithms: who sends which part of a message to whom, step by step.

A message of ``n_packets`` packets (the packetising rule is the network's) is
moved by a *schedule*: a sequence of steps, each a set of sends on distinct
directed links. ``ring`` cuts the message into ``R`` chunks (one per rank) of whole packets
(split as evenly as ``torch.tensor_split`` splits; a chunk may be empty when the
message has fewer packets than ranks) and runs R-1 reduce-scatter steps then
R-1 all-gather steps around the ring 0 -> 1 -> ... -> R-1 -> 0. ``tree``
reduces up one binary tree in heap layout (the parent of rank r is (r-1)//2, rank 0
the root) level by level, then broadcasts back down. ``direct`` sends every rank's
whole message to every other rank in one step. A ``reduce_scatter`` is the ring
all-reduce's first half (every algorithm: NCCL runs reduce-scatters on rings): rank
c ends with chunk c's sum and holds nothing of the other chunks. A ``send`` (NCCL's
ncclSend/ncclRecv, point to point) runs no algorithm: one send of the whole message from one
rank to another, in one step; its receiver holds what arrived (a lost packet is a hole).
``nvls`` is NVLink SHARP (NCCL_ALGO_NVLS) on one node: every rank sends its whole message up to
the NVSwitch, which reduces it and multicasts the sum back down to every rank. The switch is no rank:
rank r's port up and the port down to rank r+1 are drawn on the directed link r -> r+1 of its node
(the up send first), so each port has its own loss chain and counters. ``nvls_tree`` (NCCL_ALGO_NVLS_TREE)
runs NVLS inside every node and a binary tree of nodes between them (heap layout over nodes; node k's
first rank sends its node's sum to node (k-1)//2's first rank, and the reduced sum comes back the same
way) before the switches multicast it. Across nodes ``nvls`` runs as ``nvls_tree``, ``nvls_tree`` on one
node as ``nvls``, and either with one rank per node (no switch to reduce in) as ``tree``; both run
all-reduces only (other collectives on rings). ``auto`` is no schedule: the network asks NCCL's tuner
(``lossysim.timing.nccl.choose``) which algorithm each collective runs.

What each receiver holds when packets of these sends are lost: ``receivers`` (``combine``,
``path_weights``, ``Delivery``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

ALGORITHMS = ("ring", "tree", "direct", "nvls", "nvls_tree", "auto")
IN_SWITCH = ("nvls", "nvls_tree")    # reduced in the NVSwitch: no rank adds what a send carries
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send")
PHASES = ("reduce_scatter", "all_gather", "reduce", "broadcast", "exchange", "send")


@dataclass(frozen=True)
class Send:
    """One message on one directed link in one step: packets [first, first + packets) of a part."""
    step: int
    phase: str
    src: int
    dst: int
    part: int        # ring chunk, or all-gather shard owner; 0 for the whole message
    first: int
    packets: int


def chunk_bounds(n_packets: int, parts: int) -> list[tuple[int, int]]:
    """(first, packets) of each part when n_packets are split as evenly as possible."""
    base, extra = divmod(n_packets, parts)
    return [(c * base + min(c, extra), base + (c < extra)) for c in range(parts)]


def depth(rank: int) -> int:
    """Depth of a rank in the heap-layout binary tree (root 0 at depth 0)."""
    return (rank + 1).bit_length() - 1


class Schedule:
    """The sends of one collective on one message size, and the index maps that
    turn per-send packet weights into what each receiver holds. A ``send`` names its ``pair``
    (source, destination)."""

    def __init__(self, algorithm: str, collective: str, ranks: int, n_packets: int,
                 pair: Optional[tuple[int, int]] = None, per_node: Optional[int] = None):
        if algorithm not in ALGORITHMS or algorithm == "auto":
            raise ValueError(f"algorithm={algorithm!r} must be one of {', '.join(ALGORITHMS)}")
        if collective not in COLLECTIVES:
            raise ValueError(f"collective={collective!r} must be one of {', '.join(COLLECTIVES)}")
        if (collective == "send") != (pair is not None):
            raise ValueError(f"pair={pair!r}: a send names its (source, destination), a collective none")
        # NCCL has no tree all-gather either: trees run all-reduce, rings the rest.
        if collective == "all_gather" and algorithm == "tree" or collective == "reduce_scatter":
            algorithm = "ring"
        per_node = int(ranks) if per_node is None else int(per_node)
        if algorithm in IN_SWITCH:
            if collective != "all_reduce":
                algorithm = "ring"
            elif per_node == 1:
                algorithm = "tree"
            else:
                algorithm = "nvls" if per_node >= ranks else "nvls_tree"
        if collective == "send":   # whatever the network's algorithm: one message on one link
            algorithm = "p2p"
        self.algorithm, self.collective, self.pair = algorithm, collective, pair
        self.per_node = min(per_node, int(ranks)) if algorithm in IN_SWITCH else None
        self.ranks, self.n_packets = int(ranks), int(n_packets)
        if pair is None:
            make = _SENDS[(algorithm, collective)]
            self.sends: tuple[Send, ...] = tuple(make(self.ranks, self.n_packets, self.per_node)
                                                 if algorithm in IN_SWITCH else make(self.ranks, self.n_packets))
        else:
            src, dst = pair
            if not (0 <= src < self.ranks and 0 <= dst < self.ranks and src != dst):
                raise ValueError(f"a send from rank {src} to rank {dst}: "
                                 f"need two distinct ranks of 0..{self.ranks - 1}")
            self.sends = (Send(0, "send", src, dst, 0, 0, self.n_packets),)
        self._lay_out()

    def _lay_out(self) -> None:
        """Where each send's packets sit: its link's row, its offset on it, the steps and widths."""
        self.steps = 1 + max((s.step for s in self.sends), default=-1)
        self.max_packets = max((s.packets for s in self.sends), default=0)
        # Each directed link carries its sends in step order: its packets are one chain segment.
        self.links = sorted({(s.src, s.dst) for s in self.sends})
        row = {link: i for i, link in enumerate(self.links)}
        self.link_packets = [0] * len(self.links)
        self.send_row, self.send_offset = [], []
        for s in self.sends:
            r = row[(s.src, s.dst)]
            self.send_row.append(r)
            self.send_offset.append(self.link_packets[r])
            self.link_packets[r] += s.packets
        self._tensors: dict = {}
        self._packet_layout: dict = {}

    def __repr__(self) -> str:
        pair = "" if self.pair is None else f", pair={self.pair}"
        return (f"Schedule({self.algorithm}, {self.collective}, ranks={self.ranks}{pair}, "
                f"n_packets={self.n_packets}, steps={self.steps}, sends={len(self.sends)})")

    # -- index tensors, built once per device ------------------------------------------
    def tensors(self, device) -> dict:
        """The paths' index maps (``_index_lists``) on ``device``."""
        device = torch.device(device)
        cached = self._tensors.get(device)
        if cached is None:
            cached = self._tensors[device] = {k: torch.as_tensor(v, device=device)
                                              for k, v in self._index_lists().items()}
        return cached

    def gather(self, device) -> torch.Tensor:
        """``[sends, max_packets]``: where each send's packets sit in the flattened ``[links, width]`` draw
        (a send shorter than the longest reads some real slot past its end, which nothing reads back).
        Built on first use: only a mask's drop reads it, and for a large collective it is the biggest
        tensor a schedule has (a 128-rank ring's 1 GB message: half a GB)."""
        device = torch.device(device)
        cached = self._packet_layout.get(("gather", device))
        if cached is None:
            width = max(self.link_packets, default=0)
            start = torch.tensor([r * width + o for r, o in zip(self.send_row, self.send_offset)],
                                 dtype=torch.long, device=device).reshape(-1, 1)
            cached = (start + torch.arange(self.max_packets, device=device)).clamp_(
                max=max(len(self.links) * width - 1, 0))
            self._packet_layout[("gather", device)] = cached
        return cached

    def packet_phases(self, device) -> torch.Tensor:
        """``[links, width]``: the phase (index in ``PHASES``) of every drawn packet, as int8; built on
        first use (a counter slot per packet is needed only where a call's draw is counted whole)."""
        device = torch.device(device)
        cached = self._packet_layout.get(("phase", device))
        if cached is None:
            cached = torch.zeros(len(self.links), max(self.link_packets, default=0), dtype=torch.int8)
            for s, row, first in zip(self.sends, self.send_row, self.send_offset):
                cached[row, first:first + s.packets] = PHASES.index(s.phase)
            cached = self._packet_layout[("phase", device)] = cached.to(device)
        return cached

    def _index_lists(self) -> dict:
        """Where, in the per-send layout ``[sends (+1 neutral row), max_packets]`` flattened, each
        packet's hops sit; and where each rank stands on each packet's path."""
        R, S, width = self.ranks, len(self.sends), self.max_packets
        out = {}
        none = S  # the neutral row appended to the per-send values (no send: nothing lost, factor 1)
        key = (self.algorithm, self.collective)
        if self.collective == "send":
            return out     # one path, the send itself: ``receivers._paths`` reads it as it is
        if key in (("ring", "all_reduce"), ("ring", "reduce_scatter")):
            index = {(s.step, s.src): i for i, s in enumerate(self.sends)}
            parts = [(c, pos) for c, (_, count) in enumerate(chunk_bounds(self.n_packets, R)) for pos in range(count)]
            # packet p of chunk c: its partial sum starts at rank c+1 (hop 0) and ends at the owner c;
            # then it travels c -> c+1 -> ... (all-gather hop h reaches the rank h+1 after the owner).
            out["rs"] = [[index[(h, (c + 1 + h) % R)] * width + pos for h in range(R - 1)] for c, pos in parts]
            out["contributor_pos"] = [[(j - c - 1) % R for j in range(R)] for c, _ in parts]  # owner: R - 1
            if self.collective == "reduce_scatter":   # receiver i holds packet p iff it owns p's chunk
                out["owner"] = [[c == i for c, _ in parts] for i in range(R)]
            else:
                out["ag"] = [[index[(R - 1 + h, (c + h) % R)] * width + pos for h in range(R - 1)]
                             for c, pos in parts]
                out["receiver_pos"] = [[(i - c) % R for i in range(R)] for c, _ in parts]     # owner: 0
        elif key == ("tree", "all_reduce"):
            up = {s.src: i for i, s in enumerate(self.sends) if s.phase == "reduce"}
            down = {s.dst: i for i, s in enumerate(self.sends) if s.phase == "broadcast"}
            out["up"] = [up.get(r, none) for r in range(R)]
            out["down"] = [down.get(r, none) for r in range(R)]
        elif self.algorithm in IN_SWITCH:
            last = self.steps - 1
            out["up"] = [next(i for i, s in enumerate(self.sends) if s.step == 0 and s.src == r) for r in range(R)]
            out["down"] = [next(i for i, s in enumerate(self.sends) if s.step == last and s.dst == r)
                           for r in range(R)]
            P = self.per_node
            heads = {s.src // P: i for i, s in enumerate(self.sends) if 0 < s.step < last and s.phase == "reduce"}
            below = {s.dst // P: i for i, s in enumerate(self.sends) if 0 < s.step < last and s.phase == "broadcast"}
            nodes = R // P
            out["node_up"] = [heads.get(k, none) for k in range(nodes)]
            out["node_down"] = [below.get(k, none) for k in range(nodes)]
            out["node"] = [r // P for r in range(R)]
        elif key == ("ring", "all_gather"):
            index = {(s.step, s.src): i for i, s in enumerate(self.sends)}
            out["hops"] = [[index[(h, (j + h) % R)] for h in range(R - 1)] for j in range(R)]
            out["receiver_pos"] = [[(i - j) % R for j in range(R)] for i in range(R)]
        else:  # direct
            index = {(s.src, s.dst): i for i, s in enumerate(self.sends)}
            out["pair"] = [[index.get((j, i), none) for j in range(R)] for i in range(R)]
        return out


@functools.lru_cache(maxsize=512)
def schedule(algorithm: str, collective: str, ranks: int, n_packets: int,
             pair: Optional[tuple[int, int]] = None, per_node: Optional[int] = None) -> Schedule:
    """The (cached) schedule of one collective (a send: from ``pair[0]`` to ``pair[1]``) on a message of
    ``n_packets`` packets; ``per_node`` (ranks per node, default all) places NVLS's switches."""
    return Schedule(algorithm, collective, ranks, n_packets, pair, per_node)


# -- the sends of each algorithm ---------------------------------------------------------

def _ring_all_reduce(R: int, n: int):
    chunks = chunk_bounds(n, R)
    for h in range(R - 1):  # reduce-scatter: chunk c's partial sum starts at c+1 and ends at its owner c
        for r in range(R):
            c = (r - 1 - h) % R
            yield Send(h, "reduce_scatter", r, (r + 1) % R, c, *chunks[c])
    for h in range(R - 1):  # all-gather: the owner's reduced chunk travels on round the ring
        for r in range(R):
            c = (r - h) % R
            yield Send(R - 1 + h, "all_gather", r, (r + 1) % R, c, *chunks[c])


def _ring_reduce_scatter(R: int, n: int):
    """The ring all-reduce's reduce-scatter half: chunk c's partial sum ends at its owner c."""
    for send in _ring_all_reduce(R, n):
        if send.phase == "reduce_scatter":
            yield send


def _tree_all_reduce(R: int, n: int):
    levels = depth(R - 1)
    for step, level in enumerate(range(levels, 0, -1)):  # deepest level first
        for r in range(R):
            if depth(r) == level:
                yield Send(step, "reduce", r, (r - 1) // 2, 0, 0, n)
    for level in range(1, levels + 1):
        for r in range(R):
            if depth(r) == level:
                yield Send(levels + level - 1, "broadcast", (r - 1) // 2, r, 0, 0, n)


def _direct_all_reduce(R: int, n: int):
    for src in range(R):
        for dst in range(R):
            if src != dst:
                yield Send(0, "exchange", src, dst, 0, 0, n)


def _switch_port(r: int, P: int) -> int:
    """The rank whose directed link from ``r`` stands for r's port to its node's switch (its successor
    inside the node; the port down to that successor is drawn on the same link, after it)."""
    first = r - r % P
    return first + (r - first + 1) % P


def _nvls_all_reduce(R: int, n: int, P: int):
    """NVLS inside each node of P ranks; between nodes a heap-layout binary tree of the nodes' first
    ranks."""
    nodes = R // P
    for r in range(R):                                    # up to the switch
        yield Send(0, "reduce", r, _switch_port(r, P), 0, 0, n)
    levels = depth(nodes - 1)
    for step, level in enumerate(range(levels, 0, -1)):   # the nodes' sums up the tree, deepest first
        for k in range(nodes):
            if depth(k) == level:
                yield Send(1 + step, "reduce", k * P, (k - 1) // 2 * P, 0, 0, n)
    for level in range(1, levels + 1):                    # the total back down
        for k in range(nodes):
            if depth(k) == level:
                yield Send(levels + level, "broadcast", (k - 1) // 2 * P, k * P, 0, 0, n)
    for r in range(R):                                    # the switch multicasts it
        first = r - r % P
        yield Send(2 * levels + 1, "broadcast", first + (r - first - 1) % P, r, 0, 0, n)


def _ring_all_gather(R: int, n: int):
    for h in range(R - 1):  # rank j's shard travels j -> j+1 -> ... -> j-1
        for r in range(R):
            yield Send(h, "all_gather", r, (r + 1) % R, (r - h) % R, 0, n)


def _direct_all_gather(R: int, n: int):
    for src in range(R):
        for dst in range(R):
            if src != dst:
                yield Send(0, "exchange", src, dst, src, 0, n)


_SENDS = {("ring", "all_reduce"): _ring_all_reduce, ("tree", "all_reduce"): _tree_all_reduce,
          ("direct", "all_reduce"): _direct_all_reduce, ("ring", "all_gather"): _ring_all_gather,
          ("direct", "all_gather"): _direct_all_gather, ("ring", "reduce_scatter"): _ring_reduce_scatter,
          ("nvls", "all_reduce"): _nvls_all_reduce, ("nvls_tree", "all_reduce"): _nvls_all_reduce}
