"""The lossy network between ranks: one object that runs collectives, counts and keeps the clock.

A collective moves a message (one rank's tensor) by the sends of its algorithm's schedule
(``algorithms``) over directed links between ranks placed on nodes (``topology``). Per call:

1. its ``Transfer`` (packets, sends, links, loss-free step times; built once per shape),
2. the links draw which packets are lost (``links``: one chain per directed link),
3. the transport repairs what it repairs and charges the time it takes (``transport``),
4. the recovery policy (``recovery``) says what each receiver holds (``receivers.combine``) and
   applies it to the tensors (``delivery``),
5. the counters (``stats``) and the simulated clock move on (the policy's compute included).

A point-to-point send (``send``: pipeline stages' activations and gradients) is a collective of one
send of the whole message over one directed link: the same draws, repairs, policies, counters and
clock (phase ``send``; its loss-free time is NCCL's p2p time, ``timing.nccl.p2p_time``).

A policy with a side path (``outliers``) sends part of every message reliably: that traffic runs on a
sibling network (the same spec, ``transport=retransmit``, ``recovery=zero``) at call site
``<site>/outliers``, with its own streams, counters and rows, merged into this network's clock,
statistics and saved state.

Statistics and the clock stay on the tensors' device (no host sync per call with the ``drop``
transport) until ``stats()`` / ``clock()``. The class is the front door (collectives, sends, statistics);
its parts live apart: one call's draw, repairs, counts and time (``call``), the call sites' chains and
counters (``channels``), the clock (``clock``), activation checkpointing's recording and replay
(``replay``), where the fates are kept (``fates``).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..timing.nccl import Estimate
from . import cable_events
from . import call
from . import delivery as deliver
from . import exchange
from . import gaps
from . import recovery as recoveries
from . import transfer as transfers
from .algorithms import chunk_bounds
from .channels import Channels
from .clock import Clock
from .receivers import Delivery
from .replay import Replay
from .spec import DIRECTIONS, NetworkSpec
from .stats import summarise
from .windows import Windows


class LossyNetwork:
    """Links between ranks with a loss model, an algorithm, a transport, statistics and a clock.

    ``LossyNetwork(spec)`` takes a ``NetworkSpec``; ``LossyNetwork(ranks, loss_model, **settings)``
    builds one (``settings``: any of ``NetworkSpec``'s fields, e.g. ``seed``, ``algorithm``,
    ``transport``, ``recovery``). ``transfer_cache``: each call shape's transfer (derived from the spec,
    never from its seed) shared with networks alike but for their seeds, as an estimate's groups are.
    """

    def __init__(self, ranks: Union[int, NetworkSpec], loss_model="none",
                 transfer_cache: Optional[dict] = None, **settings):
        self.spec = spec = ranks if isinstance(ranks, NetworkSpec) else NetworkSpec(ranks, loss_model, **settings)
        self.ranks, self.loss_model, self.lossy = spec.ranks, spec.loss, spec.lossy
        self.topology, self.transport, self.recovery = spec.topology, spec.transport_model, spec.recovery_model
        self.links = [(src, dst) for src in range(self.ranks) for dst in range(self.ranks) if src != dst]
        # under a fabric, only a network some link of which crosses a lossy cable (or NVLink's loss) draws
        self._can_lose = not spec.loss.lossless if spec.cables is None else spec.can_lose
        self.channels = Channels(spec, self.links)
        self.time = Clock(spec.compute)
        # (link events widen a transfer's lossy rows for this network's cables: never shared then)
        shared = transfer_cache is not None and cable_events.ACTIVE is None
        self._transfers: dict[tuple, transfers.Transfer] = transfer_cache if shared else {}
        self._fates: dict = {}                      # per device: where the packets' fates are kept (``fates``)
        self._choices: dict = {}                    # per (site, direction, collective, bytes): how NCCL runs it
        # TCP's congestion windows, per link and connection, shared by every call site (one communicator)
        self._windows = Windows(len(self.links), spec.connections) if spec.nic_model.window else None
        # The reliable side path of a policy that has one: its own network, recorded and replayed alongside.
        self._side: Optional[LossyNetwork] = None
        if self.recovery.side_path:
            self._side = LossyNetwork(spec.replace(transport="retransmit", recovery="zero", lossy_layers="all",
                                                   lossy_sites="all"))
        self.replay = Replay(() if self._side is None else (self._side.replay,))

    # -- what the spec says ------------------------------------------------------
    def packets(self, numel: int, dtype: torch.dtype) -> tuple[int, int]:
        """(elements per packet, packets per message) for a message of ``numel`` elements."""
        return transfers.packets(self.spec.payload_bytes, numel, dtype)

    def drops(self, direction: str, site: Optional[str] = None) -> bool:
        """Whether traffic in this direction (at call site ``site``; None: at some site) can lose packets."""
        can_lose = self._can_lose or (cable_events.ACTIVE is not None and cable_events.ACTIVE.losing(self))
        return direction in self.lossy and can_lose and (site is None or self.spec.selection.covers(site))

    def exact(self, direction: str, site: Optional[str] = None) -> bool:
        """Whether tensors in this direction (at ``site``; None: at every site) always arrive exact (no
        loss, or retransmitted)."""
        return not self.drops(direction, site) or self.transport.exact

    # -- collectives -------------------------------------------------------------
    def all_reduce(self, site: str, direction: str, contributions: torch.Tensor,
                   receivers: Sequence[int], out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Sum every rank's contribution (``[ranks, *shape]``, rank j's message at j) as each receiver
        sees it: ``[len(receivers), *shape]``, written into ``out`` when given (``contributions`` itself
        for an in-place all-reduce, as DDP runs its buckets)."""
        _check(contributions, self.ranks)
        shape = contributions.shape[1:]
        delivery = _call(self, site, direction, "all_reduce", contributions[0])
        if delivery is None:
            total = contributions.sum(0)
            self.watch(site, direction, total)
            every = total.unsqueeze(0).expand(len(receivers), *shape)
            return deliver.into(out, every)
        per_packet, _ = self.packets(shape.numel(), contributions.dtype)
        held = self.recovery.on(direction).all_reduce(
            delivery, contributions.reshape(self.ranks, -1), receivers, per_packet,
            watch=lambda seen: self.watch(site, direction, seen),
            memory=self.channels.by_key[(site, direction)].memory,
            update=self.replay.replaying is None, out=None if out is None else out.view(len(receivers), -1))
        return held.view(len(receivers), *shape)

    def reduce_scatter(self, site: str, direction: str, contributions: torch.Tensor,
                       receivers: Sequence[int]) -> torch.Tensor:
        """Sum every rank's contribution and leave chunk c of the sum at rank c only (the ring
        all-reduce's first half, whatever ``algorithm`` says: NCCL reduce-scatters on rings).

        ``contributions`` is ``[ranks, n]``; rank c's chunk is ``shard_bounds(spec, n, dtype)[c]`` (whole
        packets). Returns ``[len(receivers), n]``: each receiver's chunk as it arrived (``zero`` or
        ``rescale``), zeros elsewhere. Only ``zero`` and ``rescale`` act on a reduce-scatter: the other
        policies need the whole reduced message at every rank."""
        _check(contributions, self.ranks)
        recoveries.require(self.recovery.name, "reduce_scatter")
        n = contributions[0].numel()
        delivery = _call(self, site, direction, "reduce_scatter", contributions[0])
        if delivery is None:
            total = contributions.reshape(self.ranks, -1).sum(0)
            self.watch(site, direction, total)
            out = total.unsqueeze(0).repeat(len(receivers), 1)
            bounds = shard_bounds(self.spec, n, contributions.dtype)
            for k, r in enumerate(receivers):
                first, count = bounds[r]
                out[k, :first] = 0
                out[k, first + count:] = 0
            return out
        per_packet, _ = self.packets(n, contributions.dtype)
        return self.recovery.on(direction).all_reduce(
            delivery, contributions.reshape(self.ranks, -1), receivers, per_packet,
            watch=lambda seen: self.watch(site, direction, seen), memory=None,
            update=self.replay.replaying is None)

    def all_gather(self, site: str, direction: str, shards: torch.Tensor,
                   receivers: Sequence[int]) -> torch.Tensor:
        """Every rank's shard as each receiver sees it: ``[len(receivers), ranks, *shape]``; lost packets
        of a shard arrive as zeros whatever the policy (a shard is not a sum: policies act on all-reduces)."""
        _check(shards, self.ranks)
        delivery = _call(self, site, direction, "all_gather", shards[0])
        if delivery is None:
            return shards.unsqueeze(0).expand(len(receivers), *shards.shape)
        per_packet, _ = self.packets(shards[0].numel(), shards.dtype)
        out = deliver.all_gather(shards.reshape(self.ranks, -1), delivery, receivers, per_packet)
        self.watch(site, direction, out)
        return out.view(len(receivers), *shards.shape)

    def send(self, site: str, direction: str, message: torch.Tensor, src: int, dst: int) -> torch.Tensor:
        """Rank ``src`` sends ``message`` to rank ``dst`` over their directed link (ncclSend/ncclRecv): what
        ``dst`` holds (``message`` itself when it arrives exact). A collective of one send: the link's
        chain of this site and direction, the transport's repairs, the policy (one of ``SEND_POLICIES``).
        A site's links share its stream in call order: a process that runs some of the sends (dist)
        draws the others' with ``simulate(..., collective="send", pair=(src, dst))``."""
        recoveries.require(self.recovery.name, "send")
        delivery = _call(self, site, direction, "send", message, (src, dst))
        if delivery is None:
            self.watch(site, direction, message)
            return message
        per_packet, _ = self.packets(message.numel(), message.dtype)
        held = self.recovery.on(direction).send(
            delivery, message.reshape(-1), per_packet, watch=lambda seen: self.watch(site, direction, seen),
            memory=self.channels.by_key[(site, direction)].memory, update=self.replay.replaying is None)
        return held.view(message.shape)

    def all_to_all(self, site: str, direction: str, messages: Sequence[Sequence[torch.Tensor]],
                   receivers: Optional[Sequence[int]] = None) -> list[list[torch.Tensor]]:
        """Every rank's message to every other (``messages[src][dst]``, sizes of their own; a rank's to
        itself stays home), as each of ``receivers`` (default all) holds them: ``[receiver][src]``.
        NCCL's grouped sends, drawn, repaired, counted and timed as every call (``exchange``); the
        messages to other receivers may be meta tensors (dist: their sizes alone move the streams)."""
        return exchange.all_to_all(self, site, direction, messages, receivers)
    def with_gaps(self, site: str, direction: str, collective: str, message: torch.Tensor,
                  receivers: Sequence[int] = (0,), pair: Optional[tuple[int, int]] = None):
        """A ``send`` (``pair``: src, dst) or an ``all_gather`` (``message``: [ranks, ...], ``receivers``)
        whose receivers learn which packets they missed: (what they hold, as those calls return it;
        ``[receivers, senders, packets]`` bool, True where a packet did not arrive, or None), drawn,
        repaired, counted and timed as those calls are (``net/gaps.py``: context parallelism's keys and
        values under ``recovery: mask``)."""
        recoveries.require(self.recovery.name, "kv_exchange")
        if collective != "send":
            _check(message, self.ranks)
        delivery = _call(self, site, direction, collective, message if collective == "send" else message[0], pair)
        return gaps.held(self, site, direction, collective, message, delivery, receivers)

    def account(self, site: str, direction: str, message: torch.Tensor, collective: str = "all_reduce",
                pair: Optional[tuple[int, int]] = None) -> None:
        """Count and time one collective whose data a real library moves (dist, loss-free or
        retransmitted): ``message`` is one rank's tensor (a send's: from ``pair[0]`` to ``pair[1]``)."""
        if _call(self, site, direction, collective, message, pair) is not None:
            raise RuntimeError(f"{site} {direction}: traffic is lossy, it must go through the network")

    def watch(self, site: str, direction: str, delivered: torch.Tensor) -> None:
        """Remember (on the device, no sync) whether this call's delivered tensor is finite (a replayed
        call delivers what was watched already)."""
        if self.replay.replaying is None:
            self.channels.watch(site, direction, delivered)

    # -- activation checkpointing: a recomputed forward replays its masks -----
    def recording(self, record: dict):
        """Append the outcomes of the calls inside to ``record[(site, direction)]``."""
        return self.replay.swapped("recording", record)

    def replaying(self, record: dict):
        """Reuse the outcomes of ``record`` in call order; draw and count nothing, time them again."""
        return self.replay.swapped("replaying", record)

    # -- one collective: draw, repair, time ------------------------------------------
    def simulate(self, site: str, direction: str, numel: int, dtype: torch.dtype, collective: str = "all_reduce",
                 device="cpu", deliver: bool = True, pair: Optional[tuple[int, int]] = None,
                 counts: Optional[Sequence[int]] = None):
        """One collective of a message of ``numel`` elements of ``dtype`` (a send: from ``pair[0]`` to
        ``pair[1]``; an all-to-all: ``counts[s * ranks + d]`` elements from rank s to rank d), without its
        data: draw the packets' fates, repair, count and move the clock exactly as a call with tensors would
        (every collective goes through here). Returns what the receivers hold (None: the exact result).

        ``deliver=False`` (an estimate: no tensors to apply it to): where the recovery policy's draw has
        no side effects, may return the lost packets of each send (``sparse.Losses``) instead."""
        return call.simulate(self, site, direction, numel, dtype, collective, device, deliver, pair, counts)

    # -- statistics ------------------------------------------------------------------
    def stats(self) -> list[dict]:
        """One record per (site, direction, phase, link) that carried traffic: ready for
        ``pandas.DataFrame``. ``bursts`` counts runs of consecutive losses begun in that
        phase (a run still open at the end counts); ``lost / bursts`` is the observed mean
        burst length. ``resent`` counts retransmissions, ``missing`` packets never delivered,
        ``failures`` collectives the transport gave up on.
        """
        return self.channels.rows(self.topology.link_class) + (self._side.stats() if self._side is not None else [])

    def burst_histogram(self) -> list[dict]:
        """Records (site, direction, src, dst, length, count) of loss runs, open runs included."""
        return self.channels.histogram() + (self._side.burst_histogram() if self._side is not None else [])

    def configured_loss_rate(self, direction: str, src: int, dst: int, site: Optional[str] = None) -> float:
        """The loss rate a link is configured with for one direction's traffic (at ``site``, if given)."""
        lossy = direction in self.lossy and (site is None or self.spec.selection.covers(site))
        if self.spec.cables is not None:
            return self.spec.link_rate(src, dst) if lossy else 0.0
        lossy = lossy and self.topology.lossy(src, dst)
        return self.loss_model.loss_rate if lossy else 0.0

    def summary(self, by: Sequence[str] = ("direction",)) -> list[dict]:
        """Totals grouped by any of site/direction/phase/src/dst/link_class, with configured
        (packet-weighted over the group's links) and observed loss rates and mean bursts."""
        return summarise(self.stats(), by, lambda row: self.configured_loss_rate(row["direction"], row["src"],
                                                                                 row["dst"], row["site"]) > 0,
                         self.loss_model.loss_rate, self.loss_model.mean_burst)

    def choices(self) -> list[dict]:
        """How each call site's collectives ran, one record per (site, direction, collective, message
        bytes) seen: NCCL's ``algorithm`` (``ring``, ``tree``, ``nvls``, ``nvls_tree``; ``p2p`` for a send,
        ``direct``), ``protocol`` (LL, LL128, Simple; empty for direct), ``channels`` and the loss-free
        ``seconds`` one call takes. Under ``algorithm: auto`` these are the tuner's picks; ready for
        ``pandas.DataFrame`` or a summary's JSON."""
        rows = [{"site": site, "direction": direction, "collective": collective, "bytes": nbytes,
                 "algorithm": c.algorithm, "protocol": c.protocol, "channels": c.channels, "seconds": c.seconds}
                for (site, direction, collective, nbytes), c in self._choices.items()]
        return rows + (self._side.choices() if self._side is not None else [])

    def clock(self) -> dict:
        """Simulated communication time so far (syncs): with loss, repairs and the recovery policy's compute
        (``comm_s``), without loss (``ideal_comm_s``), the repairs alone (``retransmit_s``), the policy's
        compute alone (``recovery_s``), and ``comm_s`` with the repairs the ideal nic preset would take
        (one resend and one round trip per loss: ``comm_s_ideal_nic``). A side path's loss-free time is
        the policy's (``recovery_s``: a loss-free run sends none), its repairs are repairs."""
        return self.time.seconds(self._side.clock() if self._side is not None else None)

    def totals(self) -> dict:
        """Every counter (sent, lost, ..., ``failures``: collectives the transport gave up on) summed over
        call sites, directions, phases and links (syncs): ``summary()``'s totals without a record per link."""
        totals = self.channels.totals()
        if self._side is not None:
            totals = {name: value + self._side.totals()[name] for name, value in totals.items()}
        return totals

    def reset_stats(self) -> None:
        """Zero every counter and the clock; chain states, random streams and what recovery policies
        keep go on."""
        self.channels.reset()
        self.time.reset()
        if self._side is not None:
            self._side.reset_stats()

    # -- save and restore ----------------------------------------------------------
    def state_dict(self) -> dict:
        """Every channel's chains, streams, counters and policy memory, the clock, and what each call ran
        (so a resumed run's summary names the collectives seen before it)."""
        state = {"config": self.spec.as_dict(), "channels": self.channels.state_dict(),
                 "watch_index": self.channels.watched, "clock": self.time.state_dict(),
                 "choices": [[*key, *choice] for key, choice in self._choices.items()]}
        if self._windows is not None:
            state["windows"] = self._windows.state_dict()
        if self._side is not None:
            state["side"] = self._side.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        saved, expected = _upgraded(state["config"], self.spec.as_dict()), self.spec.as_dict()
        if saved != expected:
            raise ValueError(f"network state was saved with {saved}, this network is {expected}")
        self.channels.load_state_dict(state["channels"])
        self.channels.watched = state.get("watch_index", 0)
        self.time.load_state_dict(state["clock"], self.channels.device)
        self._choices = {tuple(entry[:4]): Estimate(*entry[4:]) for entry in state.get("choices", [])}
        if self._windows is not None:   # saved before windows were carried: every connection fresh
            self._windows = Windows(len(self.links), self.spec.connections)
            if "windows" in state:
                self._windows.load_state_dict(state["windows"])
        if self._side is not None and "side" in state:
            self._side.load_state_dict(state["side"])

    def __repr__(self) -> str:
        return "LossyNetwork(" + ", ".join(f"{k}={v!r}" for k, v in self.spec.as_dict().items()) + ")"


def shard_bounds(spec: NetworkSpec, numel: int, dtype: torch.dtype) -> list[tuple[int, int]]:
    """(first element, elements) of each rank's chunk of a reduce-scatter of ``numel`` elements over a
    network of ``spec``: the ring's chunks of whole packets."""
    per_packet, n_packets = transfers.packets(spec.payload_bytes, numel, dtype)
    ends = [(min(first * per_packet, numel), min((first + count) * per_packet, numel))
            for first, count in chunk_bounds(n_packets, spec.ranks)]
    return [(start, end - start) for start, end in ends]


def _call(network: LossyNetwork, site: str, direction: str, collective: str, message: torch.Tensor,
          pair: Optional[tuple[int, int]] = None) -> Optional[Delivery]:
    """``network.simulate`` of one rank's ``message`` (its size, dtype and device): what arrives."""
    return network.simulate(site, direction, message.numel(), message.dtype, collective, message.device, pair=pair)


def _check(tensor: torch.Tensor, ranks: int) -> None:
    if tensor.shape[0] != ranks:
        raise ValueError(f"expected {ranks} ranks along dim 0, got shape {tuple(tensor.shape)}")


def _upgraded(saved: dict, current: dict) -> dict:
    """A network's saved settings as this version writes them: 0.2's ``tp_size`` is ``ranks``, and a
    state without ``nic`` (0.2's) had its selective repeat as the nic's own."""
    saved = dict(saved)
    if "tp_size" in saved:  # written before 0.4, when a group's ranks were called tp_size
        saved["ranks"] = saved.pop("tp_size")
    if "nic" not in saved:
        saved = {**current, **saved, "retransmit": None if saved.get("retransmit") == "selective"
                 else saved.get("retransmit")}
    return saved


__all__ = ["LossyNetwork", "NetworkSpec", "DIRECTIONS", "shard_bounds"]
