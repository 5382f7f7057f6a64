"""The two backends of an expert-parallel group, as one member sees it: ``share`` (every member's routing
counts, reliably) and ``exchange`` (an all-to-all of rows through the group's lossy network of a traffic
class, ``ep_dispatch`` or ``ep_combine``).

``SimGroup``: every member is a replica in this process. Their tasks run side by side (``Lockstep``): the
last member to reach a call makes it over every member's rows. Outside a lockstep (evaluation: replica
0 alone) the members that do not run route nothing and compute their experts for it (``solo``).

``DistGroup``: one member per process. The counts are all-gathered; the rows move by a real all-to-all
(gloo's ``all_to_all_single``); loss-free or retransmitted, the network counts and times the call; lossy,
it draws every link's packets from the same streams as ``sim`` (the other receivers' messages as meta
tensors: their sizes alone move the streams) and applies its own receiver's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..net import LossyNetwork
from .lockstep import Lockstep, solo


class Networks:
    """One group's networks: per traffic class, for training and for evaluation."""

    def __init__(self, train: dict[str, LossyNetwork], evaluation: dict[str, LossyNetwork]):
        self.train, self.eval = train, evaluation

    def of(self, traffic: str, training: bool) -> LossyNetwork:
        return (self.train if training else self.eval)[traffic]

    def state_dict(self) -> dict:
        return {kind: {name: n.state_dict() for name, n in nets.items()}
                for kind, nets in (("train", self.train), ("eval", self.eval))}

    def load_state_dict(self, state: dict) -> None:
        for kind, nets in (("train", self.train), ("eval", self.eval)):
            for name, network in nets.items():
                network.load_state_dict(state[kind][name])


def _messages(rows: list[torch.Tensor], matrix) -> list[list[torch.Tensor]]:
    """``messages[s][d]``: member s's rows for member d (its rows cut by ``matrix[s]``)."""
    return [list(x.split(list(matrix[s]))) for s, x in enumerate(rows)]


class SimShared:
    """What the members of one sim group share: its networks, the lockstep, and (for ``solo``) each
    layer's members' experts and what each member received last."""

    def __init__(self, networks: Networks, lockstep: Lockstep, members: int):
        self.networks, self.lockstep, self.members = networks, lockstep, members
        self.experts: dict[str, list] = {}          # layer site -> every member's ExpertParallel
        self._solo: dict = {}                         # solo: the last share's counts, the last dispatch's rows


class SimGroup:
    """Member ``member`` of a sim group (one per replica and TP rank)."""

    def __init__(self, shared: SimShared, member: int, training=lambda: True):
        self.shared, self.member = shared, member
        self.training = training      # whether the member's model is training (its networks; solo or not)

    def share(self, site: str, counts: torch.Tensor) -> torch.Tensor:
        shared = self.shared

        def stack(every: list) -> list:
            together = torch.stack(every)
            return [together] * shared.members
        if shared.lockstep.active:
            return shared.lockstep.meet((id(shared), "share"), shared.members, self.member, counts, stack)
        every = solo(shared.members, self.member, counts, stack, lambda m: torch.zeros_like(counts))
        shared._solo = {"counts": every}
        return every

    def gather(self, site: str, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        """Every member's parameter ``leaf`` of layer ``site`` (this member's: ``tensor``), concatenated in
        member order."""
        return torch.cat([getattr(m, leaf).detach() for m in self.shared.experts[site]])

    def exchange(self, traffic: str, site: str, direction: str, x: torch.Tensor, matrix) -> torch.Tensor:
        shared = self.shared
        network = shared.networks.of(traffic, self.training())

        def move(rows: list) -> list:
            held = network.all_to_all(site, direction, _messages(rows, matrix))
            return [torch.cat(row) for row in held]
        if shared.lockstep.active:
            return shared.lockstep.meet((id(shared), traffic, direction), shared.members, self.member, x, move)
        return solo(shared.members, self.member, x, self._solo_move(traffic, site, move),
                    self._others(traffic, site, x, matrix))

    def _solo_move(self, traffic: str, site: str, move):
        """The solo call, keeping what each member received of a dispatch (their experts' input)."""
        def moved(rows: list) -> list:
            held = move(rows)
            if traffic == "ep_dispatch":
                self.shared._solo["received"] = held
            return held
        return moved

    def _others(self, traffic: str, site: str, x: torch.Tensor, matrix):
        """What the members that do not run bring to a solo call: nothing to dispatch; their experts'
        outputs on what they received to combine."""
        def other(m: int) -> torch.Tensor:
            if traffic == "ep_dispatch":
                return x.new_zeros(0, *x.shape[1:])
            layer = site.rsplit(".", 1)[0]
            expert = self.shared.experts[layer][m]
            mine = expert.first, expert.first + expert.per_rank
            return expert.compute(self.shared._solo["received"][m], self.shared._solo["counts"][:, mine[0]:mine[1]])
        return other


class DistGroup:
    """This process's member of its group: ``process_group`` holds the members."""

    def __init__(self, networks: Networks, process_group, training=lambda: True):
        self.networks, self.process_group, self.training = networks, process_group, training
        self.member = dist.get_rank(process_group)
        self.members = dist.get_world_size(process_group)

    def share(self, site: str, counts: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.members * counts.numel(), dtype=counts.dtype, device=counts.device)
        dist.all_gather_into_tensor(out, counts.contiguous(), group=self.process_group)
        return out.view(self.members, -1)

    def gather(self, site: str, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.new_empty(self.members * tensor.shape[0], *tensor.shape[1:])
        dist.all_gather_into_tensor(out, tensor.contiguous(), group=self.process_group)
        return out

    def exchange(self, traffic: str, site: str, direction: str, x: torch.Tensor, matrix) -> torch.Tensor:
        network = self.networks.of(traffic, self.training())
        me, width = self.member, tuple(x.shape[1:])
        sizes_in = [int(matrix[s][me]) for s in range(self.members)]
        received = x.new_empty(sum(sizes_in), *width)
        dist.all_to_all_single(received, x.contiguous(), sizes_in, [int(n) for n in matrix[me]],
                               group=self.process_group)
        blocks = list(received.split(sizes_in))
        messages = [[blocks[s] if d == me else torch.empty(int(matrix[s][d]), *width, dtype=x.dtype, device="meta")
                     for d in range(self.members)] for s in range(self.members)]
        (held,) = network.all_to_all(site, direction, messages, receivers=[me])
        return torch.cat(held)
