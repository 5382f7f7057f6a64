"""Where a network keeps its packets' fates, chosen once per device: as the positions of the losses
(``Positions``: numpy, for what ``sparse.applies`` to) or as masks (``Masks``: torch, on any device,
for any loss model and transport). Either draws a call's fates from the same streams, counts them,
and repairs them under the transport; the network asks the one it chose and never which it is.

``drop`` returns the lost packets of each send as ``sparse.Losses`` or a ``[sends, max_packets]`` mask;
``repair`` the packets still missing the same way (None where the transport repairs every packet)
and the seconds the repairs added (configured nic, ideal nic).
"""
from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch

from . import sparse
from .stats import COUNTERS
from .transport import run_step

Lost = Union[sparse.Losses, torch.Tensor]


def choose(spec, device: torch.device) -> Union["Positions", "Masks"]:
    """The fates' keeper for a network of ``spec`` on ``device``."""
    return Positions(spec) if sparse.applies(spec, device) else Masks(spec)


class Masks:
    """Fates as ``[rows, width]`` masks on the tensors' device."""

    def __init__(self, spec):
        self.spec = spec

    def _bad(self, in_bad: torch.Tensor) -> Optional[torch.Tensor]:
        """``in_bad`` when the loss model has a hidden state to be in (else nothing to count)."""
        return in_bad if self.spec.loss.hidden_state else None

    def drop(self, channel, transfer) -> Lost:
        lost, in_bad, _ = channel.chains.draw(transfer.link_ids, transfer.lossy_rows, transfer.width,
                                              transfer.lengths)
        channel.counters.record(transfer.link_ids, lost, self._bad(in_bad), transfer.lengths, transfer.slots,
                                transfer.sent)
        per_send = lost.flatten()[transfer.sched.packet_tensors(lost.device)["gather"]]
        # A few losses: what arrives follows from them (on a CPU, where reading them is no host sync).
        if lost.device.type == "cpu" and sparse.works_out(transfer.sched):
            return sparse.Losses.of(transfer.sched, per_send)
        return per_send

    def repair(self, channel, transfer, device) -> tuple[Optional[Lost], torch.Tensor]:
        """Every step through the transport (``transport.run_step``)."""
        sched, spec = transfer.sched, self.spec
        missing = torch.zeros(len(sched.sends), sched.max_packets, dtype=torch.bool, device=device)
        repairs = torch.zeros(2, dtype=torch.float64, device=device)
        for step in transfer.steps:
            link_ids = transfer.link_ids[step.rows]
            lossy = [i for i, r in enumerate(step.rows) if r in transfer.lossy_rows]

            def draw(lengths, known=True, link_ids=link_ids, lossy=lossy, phase=step.phase):
                width = int(lengths.max()) if lengths.numel() else 0
                lost, in_bad, advance = channel.chains.draw(link_ids, lossy, width, lengths if known else None)

                def commit(used):
                    if not known:
                        advance(used)
                    channel.counters.record(link_ids, lost, self._bad(in_bad), used.to(lost.device), phase)
                return lost, commit

            result = run_step(spec.transport_model, spec.nic_model, step.transport, draw, step.budget)
            missing[step.sends, :result.missing.shape[1]] = result.missing
            counters = channel.counters
            counters.add("resent", step.slots, result.transmissions - step.transport.packets)
            counters.add("missing", step.slots, result.missing.sum(1))
            counters.add("timeouts", step.slots, result.timeouts)
            counters.add("failures", step.slots, result.failed.long())
            repairs += torch.stack([result.extra, result.shadow])
        return (None if spec.transport_model.exact else missing), repairs


class Positions:
    """Fates as the positions of the losses, in numpy (``sparse``): a memoryless loss on a CPU."""

    def __init__(self, spec):
        self.spec = spec

    def drop(self, channel, transfer) -> Lost:
        return sparse.Losses(transfer.sched, *sparse.drop(self.spec.loss, channel.chains, channel.counters, transfer))

    def repair(self, channel, transfer, device) -> tuple[Optional[Lost], torch.Tensor]:
        """Selective repeat step by step (``sparse.selective``)."""
        if transfer.sparse is None:
            transfer.sparse = sparse.StepArrays.steps(transfer)
        spec, counters = self.spec, channel.counters
        give_up = spec.transport_model.kind == "deadline"
        extra = shadow = 0.0
        per_step = []   # (slots, resent, missing, timeouts, failures) of each step's sends
        missing = []    # (sends, packets) never delivered, step by step
        for step, arrays in zip(transfer.steps, transfer.sparse):
            result = sparse.selective(spec.nic_model, spec.loss, channel.chains, counters, arrays,
                                      step.phase, step.budget, give_up)
            missing.append((arrays.sends[result.missing_row], result.missing_packet))
            per_step.append((arrays.slots, result.transmissions - arrays.packets,
                             np.bincount(result.missing_row, minlength=len(arrays.packets)), result.timeouts,
                             result.failed.astype(np.int64)))
            extra, shadow = extra + result.extra, shadow + result.shadow
        slots, *values = (np.concatenate(column) for column in zip(*per_step))
        counts = counters.counts.view(len(COUNTERS), -1).numpy()
        for name, value in zip(("resent", "missing", "timeouts", "failures"), values):
            np.add.at(counts[COUNTERS.index(name)], slots, value)
        repairs = torch.tensor([extra, shadow], dtype=torch.float64, device=device)
        if spec.transport_model.exact:
            return None, repairs
        return sparse.Losses(transfer.sched, *(np.concatenate(column) for column in zip(*missing))), repairs
