"""Where a network keeps its packets' fates, chosen once per device: as the positions of the losses
(``Positions``: numpy, for what ``sparse.applies`` to) or as masks (``Masks``: torch, on any device,
for any loss model and transport). Either draws a call's fates from the same streams and counts them;
the repairs are one rule (``transport.selective``, or go-back-N over masks) that takes each round's
losses from whichever keeps them. The network asks the one it chose and never which it is.

``drop`` returns the lost packets of each send as ``sparse.Losses`` or a ``[sends, max_packets]`` mask;
``repair`` the packets still missing the same way (None where the transport repairs every packet)
and the seconds the repairs added (configured nic, ideal nic).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from . import sparse
from .transport import Result, run_step, selective

Lost = Union[sparse.Losses, torch.Tensor]


def choose(spec, device: torch.device) -> Union["Positions", "Masks"]:
    """The fates' keeper for a network of ``spec`` on ``device``."""
    return Positions(spec) if sparse.applies(spec, device) else Masks(spec)


@dataclass
class HostStep:
    """What a keeper needs of one step (``transfer.Step``) on the host, built once per transfer."""
    link_ids: torch.Tensor      # [sends] network link of each send (the counters' key), on the device
    links: np.ndarray           # the same on the host (the congestion windows' key)
    lossy: Optional[np.ndarray]  # indices of the sends whose links lose packets (None: every send's)
    slots: np.ndarray           # counter slot of each send
    sends: np.ndarray           # the sends' indices in the schedule

    @classmethod
    def steps(cls, transfer) -> list:
        """Every step of ``transfer``; steps on the same links share one ``link_ids`` (the counters batch
        the draws of one set of links, and compare them by identity first)."""
        shared, out, lossy_rows = {}, [], set(transfer.lossy_rows)
        for step in transfer.steps:
            link_ids = transfer.link_ids[step.rows]
            link_ids = shared.setdefault(tuple(link_ids.tolist()), link_ids)
            lossy = np.array([i for i, r in enumerate(step.rows) if r in lossy_rows], dtype=np.int64)
            out.append(cls(link_ids, link_ids.cpu().numpy(), None if len(lossy) == len(step.rows) else lossy,
                           step.slots.cpu().numpy(), np.asarray(step.sends, dtype=np.int64)))
        return out


class _Keeper:
    """What both keepers share: a call's steps through the transport, one at a time, and their counts."""

    def __init__(self, spec):
        self.spec = spec

    def repair(self, channel, transfer, device, windows=None) -> tuple[Optional[Lost], torch.Tensor]:
        """Every step of the call through the transport (``_step``: each keeper feeds the one rule its
        fates), then what the repairs add to the counters and the clock; ``windows``: the network's TCP
        congestion windows (``net.windows``), which each step reads and moves on."""
        if transfer.host_steps is None:
            transfer.host_steps = HostStep.steps(transfer)
        extra = shadow = 0.0
        per_step = []   # (slots, resent, missing, timeouts, failures) of each step's sends
        missing = []    # (sends, packets) never delivered, step by step
        for step, host in zip(transfer.steps, transfer.host_steps):
            result = self._step(channel, step, host, None if windows is None else windows.rows(host.links))
            if windows is not None:
                windows.put(host.links, result.windows)
            missing.append((host.sends[result.missing_row], result.missing_packet))
            per_step.append((host.slots, result.transmissions - step.transport.host().packets,
                             np.bincount(result.missing_row, minlength=len(host.sends)), result.timeouts,
                             result.failed.astype(np.int64)))
            extra, shadow = extra + result.extra, shadow + result.shadow
        slots, *values = (np.concatenate(column) for column in zip(*per_step))
        channel.counters.add(("resent", "missing", "timeouts", "failures"), slots, values)
        repairs = torch.tensor([extra, shadow], dtype=torch.float64, device=device)
        if self.spec.transport_model.exact:
            return None, repairs
        send, packet = (np.concatenate(column) for column in zip(*missing))
        return self._lost(transfer.sched, send, packet, device), repairs

    def _step(self, channel, step, host: HostStep, start: Optional[np.ndarray]) -> Result:
        raise NotImplementedError

    def _lost(self, sched, send: np.ndarray, packet: np.ndarray, device) -> Lost:
        raise NotImplementedError


class Masks(_Keeper):
    """Fates as ``[rows, width]`` masks on the tensors' device."""

    def _bad(self, in_bad: torch.Tensor) -> Optional[torch.Tensor]:
        """``in_bad`` when the loss model has a hidden state to be in (else nothing to count)."""
        return in_bad if self.spec.loss.hidden_state else None

    def drop(self, channel, transfer) -> Lost:
        lost, in_bad, _ = channel.chains.draw(transfer.link_ids, transfer.lossy_rows, transfer.width,
                                              transfer.lengths)
        channel.counters.record(transfer.link_ids, lost, self._bad(in_bad), transfer.lengths, transfer.slots,
                                transfer.sent)
        per_send = lost.flatten()[transfer.sched.gather(lost.device)]
        # A few losses: what arrives follows from them (on a CPU, where reading them is no host sync).
        if lost.device.type == "cpu" and sparse.works_out(transfer.sched):
            return sparse.Losses.of(transfer.sched, per_send)
        return per_send

    def _step(self, channel, step, host: HostStep, start: Optional[np.ndarray]) -> Result:
        """The step through ``transport.run_step``, each round's fates drawn as a mask."""
        link_ids = host.link_ids
        lossy = range(len(link_ids)) if host.lossy is None else host.lossy.tolist()

        def draw(lengths, known=True):
            width = int(lengths.max()) if lengths.numel() else 0
            lost, in_bad, advance = channel.chains.draw(link_ids, lossy, width, lengths if known else None)

            def commit(used):
                if not known:
                    advance(used)
                channel.counters.record(link_ids, lost, self._bad(in_bad), used.to(lost.device), step.phase)
            return lost, commit

        return run_step(self.spec.transport_model, self.spec.nic_model, step.transport, draw, step.budget, start)

    def _lost(self, sched, send: np.ndarray, packet: np.ndarray, device) -> Lost:
        missing = torch.zeros(len(sched.sends), sched.max_packets, dtype=torch.bool, device=device)
        missing[torch.from_numpy(send).to(device), torch.from_numpy(packet).to(device)] = True
        return missing


class Positions(_Keeper):
    """Fates as the positions of the losses, in numpy (``sparse``): a memoryless or simple Gilbert loss on a
    CPU."""

    def drop(self, channel, transfer) -> Lost:
        return sparse.Losses(transfer.sched, *sparse.drop(self.spec.loss, channel.chains, channel.counters, transfer))

    def _step(self, channel, step, host: HostStep, start: Optional[np.ndarray]) -> Result:
        """Selective repeat (``transport.selective``), each round's losses drawn as positions."""
        spec, chains, counters = self.spec, channel.chains, channel.counters
        bad = spec.loss.hidden_state

        def draw(to_send: np.ndarray, width: int) -> np.ndarray:
            return sparse.lost_positions(spec.loss, chains, host.link_ids, host.lossy, width, to_send)

        def count(row: np.ndarray, column: np.ndarray, to_send: np.ndarray) -> None:
            counters.record_lost(host.link_ids, row, column, to_send, step.phase, bad=bad)

        return selective(spec.nic_model, step.transport.host(), draw, count, step.budget,
                         give_up=spec.transport_model.kind == "deadline", windows=start)

    def _lost(self, sched, send: np.ndarray, packet: np.ndarray, device) -> Lost:
        return sparse.Losses(sched, send, packet)
