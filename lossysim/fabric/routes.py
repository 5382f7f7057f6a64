"""Routes: which cables the packets between two ranks cross.

A flow is one queue pair of one connection NCCL opens between two ranks on one channel. RoCE routes a
flow by ECMP on its 5-tuple, and a queue pair's UDP source port is its entropy, so the flow keeps one
path: at each switch with several equal-cost cables ahead, a hash of the flow picks one. Each switch
salts the hash with its own name (switches seed their hash functions apart, or every tier would pick
alike), and the hash is blake2b of the names (``util.stream_seed``): the same path in every call and
every process. NCCL opens ``qps_per_connection`` queue pairs per connection (NCCL_IB_QPS_PER_CONNECTION,
default 1) and splits each message over them; they send side by side, so packet i of a message rides
queue pair ``i mod q``. ``spray`` puts each packet on its own path (UEC's packet spraying): at a hop of
k choices, packet i of a connection takes choice ``(i // m + offset) mod k``, m the product of the choices
before it, so over each cycle every path carries one packet and equal paths carry equal counts (within
one). With ``pxn`` (NCCL's PXN, on by default since 2.12) a message to a GPU on another rail first moves
over NVLink to the sender's node's GPU on that rail, so it crosses the fabric on the destination's rail.
Ranks of one node talk over NVLink: no route.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..util import stream_seed
from .graph import Fabric, nic


@dataclass(frozen=True)
class Route:
    """The cables crossed by the packets ``i`` of a message with ``i % modulus == residue``."""
    cables: tuple[int, ...]
    modulus: int = 1
    residue: int = 0

    def packets(self, count: int) -> int:
        """How many of a message's ``count`` packets take this route."""
        return max(0, -(-(count - self.residue) // self.modulus))


class Routes:
    """Every route of one fabric under one hash seed: ranks ``ranks_per_node`` to a node in order, a
    node's local rank i on rail ``i mod rails``; routes are worked out once per connection."""

    def __init__(self, fabric: Fabric, ranks_per_node: int, seed: int = 0, qps_per_connection: int = 1,
                 pxn: bool = True, spray: bool = False):
        if isinstance(qps_per_connection, bool) or int(qps_per_connection) != qps_per_connection \
                or not 1 <= qps_per_connection <= 128:
            raise ValueError(f"qps_per_connection={qps_per_connection!r} must be a whole number from 1 to 128")
        self.fabric, self.per_node, self.seed = fabric, int(ranks_per_node), int(seed)
        self.qps, self.pxn, self.spray = int(qps_per_connection), bool(pxn), bool(spray)
        self._routes: dict[tuple[int, int, int], tuple[Route, ...]] = {}

    def nics(self, src: int, dst: int) -> Optional[tuple[str, str]]:
        """The NICs a message from rank ``src`` to rank ``dst`` leaves and enters by (None: one node)."""
        (src_node, src_local), (dst_node, dst_local) = divmod(src, self.per_node), divmod(dst, self.per_node)
        if src_node == dst_node:
            return None
        rails = self.fabric.rails
        rail = dst_local % rails
        return nic(src_node, rail if self.pxn else src_local % rails), nic(dst_node, rail)

    def connection(self, src: int, dst: int, channel: int = 0) -> tuple[Route, ...]:
        """The routes of one connection's packets: one per queue pair under ECMP, one per path sprayed."""
        key = (src, dst, channel)
        if key not in self._routes:
            ends = self.nics(src, dst)
            if ends is None:
                self._routes[key] = ()
            elif self.spray:
                self._routes[key] = tuple(self._sprayed(*ends, f"{src}>{dst}#c{channel}"))
            else:
                self._routes[key] = tuple(Route(self._hashed(*ends, f"{src}>{dst}#c{channel}q{qp}"), self.qps, qp)
                                          for qp in range(self.qps))
        return self._routes[key]

    def _hashed(self, at: str, dst: str, flow: str) -> tuple[int, ...]:
        path = []
        while at != dst:
            choices = self.fabric.next_hops(at, dst)
            # one choice needs no hash (the same cable whatever it gives)
            cable = choices[0] if len(choices) == 1 else \
                choices[stream_seed(self.seed, f"{at}|{flow}", "ecmp") % len(choices)]
            path.append(cable)
            at = self.fabric.cables[cable].dst
        return tuple(path)

    def _sprayed(self, at: str, dst: str, flow: str, modulus: int = 1, residue: int = 0,
                 before: tuple[int, ...] = ()) -> list[Route]:
        if at == dst:
            return [Route(before, modulus, residue)]
        choices = self.fabric.next_hops(at, dst)
        k = len(choices)
        offset = stream_seed(self.seed, f"{at}|{flow}", "spray") % k
        out = []
        for c, cable in enumerate(choices):
            out += self._sprayed(self.fabric.cables[cable].dst, dst, flow, modulus * k,
                                 residue + modulus * ((c - offset) % k), (*before, cable))
        return out
