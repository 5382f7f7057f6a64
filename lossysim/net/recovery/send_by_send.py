"""The policies that act on every send as it arrives, so a collective runs its schedule send by send
(``delivery.send_by_send``) and a call site keeps per-send buffers in its ``Memory``:

- ``stale``: a lost packet of a send is replaced by the last values that arrived on that send (the
  same step, link and packets of this call site and direction); nothing yet: zero.
- ``error_feedback``: a sender keeps what a send failed to deliver and adds it to what that send
  carries at the next call of the call site, so the sum over calls is conserved at every receiver.
  It feeds gradients back: on activations (direction ``fwd``) it is ``zero``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .. import delivery as deliver
from ..algorithms import Schedule
from ..sparse import Losses
from .base import Policy


@dataclass
class Hops:
    """A draw of a send-by-send policy: the schedule, the lost packets of every send, and which
    message size's buffers apply."""
    sched: Schedule
    lost: torch.Tensor          # [sends, max_packets]
    key: str
    held: Optional[torch.Tensor] = None   # what every rank held after the call, for a replay


def _elements(sched: Schedule, per_packet: int, numel: int, end: str) -> int:
    """The most elements one rank sends (``end="src"``) or receives (``"dst"``) in the schedule."""
    count = [0] * sched.ranks
    for s in sched.sends:
        count[getattr(s, end)] += max(0, min(numel, (s.first + s.packets) * per_packet) - s.first * per_packet)
    return max(count, default=0)


class SendBySend(Policy):
    """A policy acting on every send: ``arrive`` says what a round's receivers take."""
    keeps_memory = True
    computes = True
    send_by_send = True
    acts_on_shards = False   # its all-reduce replays every hop of the ring
    acts_on_exchanges = False
    acts_on_keys = False     # what it keeps between calls is not a receiver's gaps
    buffers: tuple[str, ...] = ()   # per-send buffers, one payload each, zeros until written
    remembers = False               # a replay returns what the call delivered (it cannot recompute it)

    def draw(self, transfer, lost, collective, numel, dtype, memory):
        if collective not in ("all_reduce", "send"):
            return super().draw(transfer, lost, collective, numel, dtype, memory)
        mask = lost.mask() if isinstance(lost, Losses) else lost
        key = f"{numel}:{str(dtype).removeprefix('torch.')}"
        if collective == "send":   # each link's messages keep their own buffers
            key = "send{}>{}:{}".format(*transfer.sched.pair, key)
        return Hops(transfer.sched, mask, key)

    def all_reduce(self, drawn, x, receivers, per_packet, watch, memory, update, out=None):
        sched = drawn.sched

        def fresh() -> dict:
            shape = (len(sched.sends), sched.max_packets, per_packet)
            return {name: torch.zeros(shape, dtype=x.dtype, device=x.device) for name in self.buffers}

        state = memory.sends(drawn.key, fresh)
        held = None if update else drawn.held
        if held is None:
            held = deliver.send_by_send(x, sched, drawn.lost, per_packet,
                                        lambda hop, payload, lost: self.arrive(state, hop, payload, lost, update))
            if self.remembers:
                drawn.held = held
        held = held[list(receivers)]
        watch(held)
        return deliver.into(out, held)

    def send(self, drawn, x, per_packet, watch, memory, update):
        n, n_packets = x.numel(), drawn.sched.n_packets
        state = memory.sends(drawn.key, lambda: {name: x.new_zeros(1, n_packets, per_packet)
                                                 for name in self.buffers})
        held = None if update else drawn.held
        if held is None:
            payload = x.new_zeros(n_packets * per_packet)
            payload[:n] = x
            taken = self.arrive(state, _whole(n_packets, x.device), payload.view(1, n_packets, per_packet),
                                drawn.lost[:, :n_packets], update)
            held = taken.reshape(-1)[:n]
            if self.remembers:
                drawn.held = held
        watch(held)
        return held

    def arrive(self, state: dict, hop: deliver.Round, payload: torch.Tensor, lost: torch.Tensor,
               update: bool) -> torch.Tensor:
        raise NotImplementedError


class Stale(SendBySend):
    """A lost packet of a send takes the last values that arrived on that send; nothing yet: zero.
    The receiver keeps one buffer per send it receives (``last``: zeros until a packet arrives, and
    zeros on padding, which never arrives)."""
    name = "stale"
    buffers = ("last",)

    def arrive(self, state, hop, payload, lost, update):
        width = payload.shape[1]
        taken = torch.where((hop.valid & ~lost).unsqueeze(-1), payload, state["last"][hop.sends, :width])
        if update:
            state["last"][hop.sends, :width] = taken
        return taken

    def flops(self, sched, per_packet, numel):
        return 2.0 * _elements(sched, per_packet, numel, "dst")   # choose, and keep, what arrived


class ErrorFeedback(SendBySend):
    """A send carries what it failed to deliver at the call site's previous call (``owed``) on top of
    its payload; what it fails to deliver now is owed next time. Gradients only: on activations it is
    ``zero``."""
    name = "error_feedback"
    buffers = ("owed",)
    remembers = True    # the call moved what is owed on: replaying it must not add it again
    on_activations = False

    def arrive(self, state, hop, payload, lost, update):
        width = payload.shape[1]
        payload = payload + state["owed"][hop.sends, :width]
        if update:
            state["owed"][hop.sends, :width] = torch.where(lost.unsqueeze(-1), payload, 0)
        return torch.where((hop.valid & ~lost).unsqueeze(-1), payload, 0)

    def flops(self, sched, per_packet, numel):
        return 2.0 * _elements(sched, per_packet, numel, "src")   # add what is owed, keep what is lost


STALE, ERROR_FEEDBACK = Stale(), ErrorFeedback()


@functools.lru_cache(maxsize=64)
def _whole(n_packets: int, device: torch.device) -> deliver.Round:
    """A send as one round: its only send, every packet of it (no padding); ``arrive`` reads no ranks."""
    column = torch.zeros(1, 1, dtype=torch.long, device=device)
    return deliver.Round(torch.zeros(1, dtype=torch.long, device=device), column, column,
                         torch.arange(n_packets, device=device).unsqueeze(0),
                         torch.ones(1, n_packets, dtype=torch.bool, device=device), adds=False)
