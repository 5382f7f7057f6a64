"""One call of a network without its data (``LossyNetwork.simulate``): replayed under activation
checkpointing, or its transfer built once per shape, its packets' fates drawn and repaired, the
recovery policy's draw made, the counters and the clock moved on, and a policy's side path sent."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import cable_events
from . import exchange
from . import sparse
from . import transfer as transfers
from .fates import choose as choose_fates
from .replay import Outcome


def simulate(network, site: str, direction: str, numel: int, dtype: torch.dtype, collective: str,
             device, deliver: bool, pair: Optional[tuple[int, int]], counts: Optional[Sequence[int]]):
    """``network.simulate``'s work (see there): what the receivers hold, None for the exact result."""
    key = (site, direction)
    if network.ranks == 1:   # nothing to send (and nothing recorded to replay)
        return None
    if network.replay.replaying is not None:  # a recomputed forward sends again: its time counts again
        outcome = network.replay.next(key)
        network.time.ideal += outcome.ideal
        network.time.recovery_s += outcome.recovered
        if outcome.repairs is not None:
            network.time.tick(outcome.repairs)
        if outcome.delivery is not None:   # the policy acted: its side path sends again too (replayed)
            _side_traffic(network, site, direction, collective, numel, dtype, device)
        return outcome.delivery
    device = torch.device(device)
    if pair is not None:
        pair = (int(pair[0]), int(pair[1]))
    if counts is not None:   # an all-to-all's sizes are its routing's: built per call (``exchange``)
        transfer = exchange.build(network.spec, tuple(int(n) for n in counts), dtype, device)
        # its choice by the bytes every rank sends together (the routing moves them, not their sum): the last
        # call's of that size
        network._choices[(site, direction, collective, sum(int(n) for n in counts) * dtype.itemsize)] = \
            transfer.choice
    else:
        shape = (collective, int(numel), dtype, device, pair)
        transfer = network._transfers.get(shape)
        if transfer is None:
            transfer = transfers.build(network.spec, network.links, *shape)   # (a bad pair is refused here)
            network._transfers[shape] = transfer
        network._choices[(site, direction, collective, int(numel) * dtype.itemsize)] = transfer.choice
    events = cable_events.ACTIVE
    if events is not None:   # under drop, the rows crossing a cable an event takes down can lose packets
        events.widen(network, transfer)
    channel = network.channels.get(site, direction, device)
    channel.counters.calls += 1
    ideal = transfer.ideal * network.time.stretch   # (1.0 but in training on shared cables: exact, unchanged)
    network.time.ideal += ideal
    delivery, repairs, recovery_before = None, None, network.time.recovery_s
    fates = network._fates.get(device)
    if fates is None:
        fates = network._fates[device] = choose_fates(network.spec, device)
    if not network.drops(direction, site) or not transfer.steps:   # (an empty message has nothing to lose)
        channel.counters.count_sent(transfer.sent)
    else:
        if network.transport.repairs:
            lost, repairs = fates.repair(channel, transfer, device, network._windows)
            network.time.tick(repairs)
        else:
            lost = fates.drop(channel, transfer)
        policy = network.recovery.on(direction)
        if lost is not None and isinstance(lost, sparse.Losses) and \
                not (deliver or policy.keeps_memory or policy.computes):
            delivery = lost   # the lost packets stand for the Delivery: no one needs more, no draw changes a thing
        elif lost is not None:   # (None: every packet repaired, the exact result)
            network.time.charge_policy(policy, transfer, collective, numel, dtype)
            delivery = policy.draw(transfer, lost, collective, numel, dtype, channel.memory)
    later = events.charge(network, transfer) if events is not None else None
    if later is not None:   # a link event held or slowed the call (``cable_events``)
        network.time.tick(later)
        repairs = later if repairs is None else repairs + later
    network.replay.keep(key, Outcome(delivery, ideal, repairs, network.time.recovery_s - recovery_before))
    if delivery is not None:   # the policy acts on this call
        _side_traffic(network, site, direction, collective, numel, dtype, device)
    return delivery


def _side_traffic(network, site: str, direction: str, collective: str, numel: int, dtype: torch.dtype,
                  device) -> None:
    """The policy's side path beside one collective (none for most policies): an all-gather of
    ``side_bytes`` per rank, as bytes, retransmitted until it arrives."""
    nbytes = network.recovery.on(direction).side_bytes(numel, dtype) if collective == "all_reduce" else 0
    if nbytes:
        network._side.simulate(f"{site}/outliers", direction, nbytes, torch.uint8, "all_gather", device)
