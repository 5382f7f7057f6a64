"""The lossy network between ranks: one object that runs collectives, counts and keeps the clock.

A collective moves a message (one rank's tensor) by the sends of its algorithm's schedule
(``algorithms``) over directed links between ranks placed on nodes (``topology``). Per call:

1. its ``Transfer`` (packets, sends, links, loss-free step times; built once per shape),
2. the links draw which packets are lost (``links``: one chain per directed link),
3. the transport repairs what it repairs and charges the time it takes (``transport``),
4. the recovery policy (``recovery``) says what each receiver holds (``algorithms.combine``) and
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
transport) until ``stats()`` / ``clock()``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from ..timing.nccl import Estimate
from ..util import one_of, stream_seed, swapped
from . import delivery as deliver
from . import recovery as recoveries
from . import sparse
from . import transfer as transfers
from .algorithms import PHASES, Delivery, chunk_bounds
from .links import Chains
from .spec import DIRECTIONS, NetworkSpec
from .fates import choose as choose_fates
from .stats import COUNTERS, Counters, NonFinite, summarise
from .windows import Windows


@dataclass
class _Channel:
    """One call site and direction: its link chains, its counters, its non-finite watch and what the
    recovery policy keeps there."""
    chains: Chains
    counters: Counters
    watch: NonFinite = field(default_factory=NonFinite)
    memory: Optional[recoveries.Memory] = None


class LossyNetwork:
    """Links between ranks with a loss model, an algorithm, a transport, statistics and a clock.

    ``LossyNetwork(spec)`` takes a ``NetworkSpec``; ``LossyNetwork(ranks, loss_model, **settings)``
    builds one (``settings``: any of ``NetworkSpec``'s fields, e.g. ``seed``, ``algorithm``,
    ``transport``, ``recovery``).
    """

    def __init__(self, ranks: Union[int, NetworkSpec], loss_model="none", **settings):
        self.spec = ranks if isinstance(ranks, NetworkSpec) else NetworkSpec(ranks, loss_model, **settings)
        spec = self.spec
        self.ranks = spec.ranks
        self.loss_model = spec.loss
        self.topology, self.transport = spec.topology, spec.transport_model
        self.lossy = spec.lossy
        self.recovery = spec.recovery_model
        self.links = [(src, dst) for src in range(self.ranks) for dst in range(self.ranks) if src != dst]
        self._channels: dict[tuple[str, str], _Channel] = {}
        self._transfers: dict[tuple, transfers.Transfer] = {}
        self._recording: Optional[dict] = None
        self._replaying: Optional[dict] = None
        self._watched = 0                           # calls watched so far: orders the first non-finite one
        self._repairs: Optional[torch.Tensor] = None  # seconds repairs added: configured nic, ideal nic
        self._ideal = 0.0                             # all the traffic without loss
        self._recovery_s = 0.0                      # simulated seconds of the recovery policy's compute
        self._recovery_cost: dict[tuple, float] = {}   # per policy and message shape: seconds per call
        self._fates: dict = {}                      # per device: where the packets' fates are kept (``fates``)
        self._choices: dict = {}                    # per (site, direction, collective, bytes): how NCCL runs it
        # TCP's congestion windows, per link and connection, shared by every call site (one communicator)
        self._windows = Windows(len(self.links), spec.connections) if spec.nic_model.window else None
        # The reliable side path of a policy that has one: built with this network, so that it is
        # swapped into every recording and replaying alongside.
        self._side: Optional[LossyNetwork] = None
        if self.recovery.side_path:
            self._side = LossyNetwork(spec.replace(transport="retransmit", recovery="zero", lossy_layers="all",
                                                   lossy_sites="all"))

    # -- what the spec says ------------------------------------------------------
    def packets(self, numel: int, dtype: torch.dtype) -> tuple[int, int]:
        """(elements per packet, packets per message) for a message of ``numel`` elements."""
        return transfers.packets(self.spec.payload_bytes, numel, dtype)

    def drops(self, direction: str, site: Optional[str] = None) -> bool:
        """Whether traffic in this direction (at call site ``site``; None: at some site) can lose packets."""
        return (direction in self.lossy and not self.loss_model.lossless
                and (site is None or self.spec.selection.covers(site)))

    def exact(self, direction: str, site: Optional[str] = None) -> bool:
        """Whether tensors in this direction (at ``site``; None: at every site) always arrive exact (no
        loss, or retransmitted)."""
        return not self.drops(direction, site) or self.transport.exact

    def link_class(self, src: int, dst: int) -> str:
        return self.topology.link_class(src, dst)

    # -- collectives -------------------------------------------------------------
    def all_reduce(self, site: str, direction: str, contributions: torch.Tensor,
                   receivers: Sequence[int], out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Sum every rank's contribution as each receiver sees it.

        ``contributions`` is ``[ranks, *shape]`` (rank j's message at j). Returns
        ``[len(receivers), *shape]``: what the algorithm leaves at each receiver, written into ``out``
        when given (``contributions`` itself for an in-place all-reduce, as DDP runs its buckets:
        no receivers' tensor to allocate, the same values).
        """
        self._check(contributions)
        shape = contributions.shape[1:]
        delivery = self._deliver(site, direction, "all_reduce", contributions[0])
        if delivery is None:
            total = contributions.sum(0)
            self.watch(site, direction, total)
            every = total.unsqueeze(0).expand(len(receivers), *shape)
            return deliver.into(out, every)
        per_packet, _ = self.packets(shape.numel(), contributions.dtype)
        held = self.recovery.on(direction).all_reduce(
            delivery, contributions.reshape(self.ranks, -1), receivers, per_packet,
            watch=lambda seen: self.watch(site, direction, seen), memory=self._channels[(site, direction)].memory,
            update=self._replaying is None, out=None if out is None else out.view(len(receivers), -1))
        return held.view(len(receivers), *shape)

    def reduce_scatter(self, site: str, direction: str, contributions: torch.Tensor,
                       receivers: Sequence[int]) -> torch.Tensor:
        """Sum every rank's contribution and leave chunk c of the sum at rank c only (the ring
        all-reduce's first half, whatever ``algorithm`` says: NCCL reduce-scatters on rings).

        ``contributions`` is ``[ranks, n]``; rank c's chunk is ``shard_bounds(n, dtype)[c]`` (whole
        packets). Returns ``[len(receivers), n]``: each receiver's chunk as it arrived (``zero`` or
        ``rescale``), zeros elsewhere. Only ``zero`` and ``rescale`` act on a reduce-scatter: the other
        policies need the whole reduced message at every rank."""
        self._check(contributions)
        if not self.recovery.acts_on_shards:
            raise ValueError(f"recovery={self.recovery.name} does not act on reduce-scatters "
                             f"({' or '.join(recoveries.SHARD_POLICIES)} do)")
        n = contributions[0].numel()
        delivery = self._deliver(site, direction, "reduce_scatter", contributions[0])
        if delivery is None:
            total = contributions.reshape(self.ranks, -1).sum(0)
            self.watch(site, direction, total)
            out = total.unsqueeze(0).repeat(len(receivers), 1)
            bounds = self.shard_bounds(n, contributions.dtype)
            for k, r in enumerate(receivers):
                first, count = bounds[r]
                out[k, :first] = 0
                out[k, first + count:] = 0
            return out
        per_packet, _ = self.packets(n, contributions.dtype)
        return self.recovery.on(direction).all_reduce(
            delivery, contributions.reshape(self.ranks, -1), receivers, per_packet,
            watch=lambda seen: self.watch(site, direction, seen), memory=None, update=self._replaying is None)

    def shard_bounds(self, numel: int, dtype: torch.dtype) -> list[tuple[int, int]]:
        """(first element, elements) of each rank's chunk of a reduce-scatter of ``numel`` elements:
        the ring's chunks of whole packets."""
        per_packet, n_packets = self.packets(numel, dtype)
        ends = [(min(first * per_packet, numel), min((first + count) * per_packet, numel))
                for first, count in chunk_bounds(n_packets, self.ranks)]
        return [(start, end - start) for start, end in ends]

    def all_gather(self, site: str, direction: str, shards: torch.Tensor,
                   receivers: Sequence[int]) -> torch.Tensor:
        """Every rank's shard as each receiver sees it: ``[len(receivers), ranks, *shape]``.

        Lost packets of a shard arrive as zeros whatever the recovery policy (a gathered shard is not
        a sum: recovery policies act on all-reduces).
        """
        self._check(shards)
        delivery = self._deliver(site, direction, "all_gather", shards[0])
        if delivery is None:
            return shards.unsqueeze(0).expand(len(receivers), *shards.shape)
        per_packet, _ = self.packets(shards[0].numel(), shards.dtype)
        out = deliver.all_gather(shards.reshape(self.ranks, -1), delivery, receivers, per_packet)
        self.watch(site, direction, out)
        return out.view(len(receivers), *shards.shape)

    def send(self, site: str, direction: str, message: torch.Tensor, src: int, dst: int) -> torch.Tensor:
        """Rank ``src`` sends ``message`` (any shape) to rank ``dst`` over their directed link (NCCL's
        ncclSend/ncclRecv): what ``dst`` holds, the same shape and dtype (``message`` itself, not a
        copy, when it arrives exact).

        A collective of one send: its packets lose on the link's chain of this call site and
        direction, the transport repairs and charges, the recovery policy (one of ``SEND_POLICIES``)
        says what the receiver holds. The seconds one call takes are the difference of
        ``clock()["comm_s"]`` before and after it (its repairs and the policy's compute included).
        A call site's links share its random stream in call order: a process that runs some of the
        sends (dist) draws the others' with ``simulate(..., collective="send", pair=(src, dst))``."""
        if not self.recovery.acts_on_sends:
            raise ValueError(f"recovery={self.recovery.name} does not act on point-to-point sends: use "
                             f"{one_of(recoveries.SEND_POLICIES)}")
        delivery = self._deliver(site, direction, "send", message, (src, dst))
        if delivery is None:
            self.watch(site, direction, message)
            return message
        per_packet, _ = self.packets(message.numel(), message.dtype)
        held = self.recovery.on(direction).send(
            delivery, message.reshape(-1), per_packet, watch=lambda seen: self.watch(site, direction, seen),
            memory=self._channels[(site, direction)].memory, update=self._replaying is None)
        return held.view(message.shape)

    def account(self, site: str, direction: str, message: torch.Tensor, collective: str = "all_reduce",
                pair: Optional[tuple[int, int]] = None) -> None:
        """Count and time one collective whose data a real library moves (dist, loss-free or
        retransmitted): ``message`` is one rank's tensor (a send's: from ``pair[0]`` to ``pair[1]``)."""
        if self._deliver(site, direction, collective, message, pair) is not None:
            raise RuntimeError(f"{site} {direction}: traffic is lossy, it must go through the network")

    def watch(self, site: str, direction: str, delivered: torch.Tensor) -> None:
        """Remember (on the device, no sync) whether this call's delivered tensor is finite."""
        if self._replaying is not None:
            return
        self._watched += 1
        self._channel(site, direction, delivered.device).watch.see(self._watched, delivered)

    def first_nonfinite(self) -> Optional[dict]:
        """The site and direction whose delivered data first became non-finite, if any (syncs)."""
        seen = [(ch.watch.settle(), site, direction) for (site, direction), ch in self._channels.items()]
        seen = [s for s in seen if s[0] >= 0]
        if not seen:
            return None
        _, site, direction = min(seen)
        return {"site": site, "direction": direction}

    # -- activation checkpointing: a recomputed forward replays its masks -----
    def recording(self, record: dict):
        """Append the deliveries drawn inside to ``record[(site, direction)]``."""
        return self._swapped("_recording", record)

    def replaying(self, record: dict):
        """Reuse the deliveries of ``record`` in call order; draw, count and time nothing."""
        return self._swapped("_replaying", record)

    @contextlib.contextmanager
    def _swapped(self, name: str, record: dict):
        with swapped(self, name, record), \
                (swapped(self._side, name, record) if self._side is not None else contextlib.nullcontext()):
            yield record

    def _side_traffic(self, site: str, direction: str, collective: str, numel: int, dtype: torch.dtype,
                      device) -> None:
        """The policy's side path beside one collective (none for most policies): an all-gather of
        ``side_bytes`` per rank, as bytes, retransmitted until it arrives."""
        nbytes = self.recovery.on(direction).side_bytes(numel, dtype) if collective == "all_reduce" else 0
        if nbytes:
            self._side.simulate(f"{site}/outliers", direction, nbytes, torch.uint8, "all_gather", device)

    # -- one collective: draw, repair, time ------------------------------------------
    def _deliver(self, site: str, direction: str, collective: str, message: torch.Tensor,
                 pair: Optional[tuple[int, int]] = None) -> Optional[Delivery]:
        """What the receivers hold (None: the exact result; the recovery policy's draw, a Delivery for
        zero and rescale), counting and timing the traffic."""
        return self.simulate(site, direction, message.numel(), message.dtype, collective, message.device, pair=pair)

    def simulate(self, site: str, direction: str, numel: int, dtype: torch.dtype, collective: str = "all_reduce",
                 device="cpu", deliver: bool = True, pair: Optional[tuple[int, int]] = None):
        """One collective of a message of ``numel`` elements of ``dtype`` (a send: from ``pair[0]`` to
        ``pair[1]``), without its data: draw the packets' fates, repair, count and move the clock exactly
        as a call with tensors would (every collective goes through here). Returns what the receivers
        hold (None: the exact result).

        ``deliver=False`` (an estimate: no tensors to apply it to): where the recovery policy's draw has
        no side effects, may return the lost packets of each send (``sparse.Losses``) instead."""
        key = (site, direction)
        if self._replaying is not None:  # a recomputed forward sends again: its time counts again
            delivery, ideal, repairs, recovered = self._replaying[key].popleft()
            self._ideal += ideal
            self._recovery_s += recovered
            if repairs is not None:
                self._tick(repairs)
            if delivery is not None:   # the policy acted: its side path sends again too (replayed)
                self._side_traffic(site, direction, collective, numel, dtype, device)
            return delivery
        if self.ranks == 1:
            return None
        device = torch.device(device)
        if pair is not None:
            pair = (int(pair[0]), int(pair[1]))
        shape = (collective, int(numel), dtype, device, pair)
        transfer = self._transfers.get(shape)
        if transfer is None:
            transfer = transfers.build(self.spec, self.links, *shape)   # (a bad pair is refused here)
            self._transfers[shape] = transfer
        self._choices[(site, direction, collective, int(numel) * dtype.itemsize)] = transfer.choice
        channel = self._channel(site, direction, device)
        channel.counters.calls += 1
        self._ideal += transfer.ideal
        delivery, repairs, recovery_before = None, None, self._recovery_s
        fates = self._fates.get(device)
        if fates is None:
            fates = self._fates[device] = choose_fates(self.spec, device)
        if not self.drops(direction, site) or not transfer.steps:   # (an empty message has nothing to lose)
            channel.counters.count_sent(transfer.sent)
        else:
            if self.transport.repairs:
                lost, repairs = fates.repair(channel, transfer, device, self._windows)
                self._tick(repairs)
            else:
                lost = fates.drop(channel, transfer)
            if lost is not None:   # None: every packet repaired, the exact result
                delivery = lost if isinstance(lost, sparse.Losses) and self._no_delivery(direction, deliver) else \
                    self._draw(channel, transfer, lost, collective, direction, numel, dtype)
        if self._recording is not None:
            self._recording[key].append((delivery, transfer.ideal, repairs, self._recovery_s - recovery_before))
        if delivery is not None:   # the policy acts on this call
            self._side_traffic(site, direction, collective, numel, dtype, device)
        return delivery

    def _no_delivery(self, direction: str, deliver: bool) -> bool:
        """Whether the lost packets as ``sparse.Losses`` may stand for the Delivery: the caller needs none
        and the policy's draw changes nothing (no memory, no compute)."""
        policy = self.recovery.on(direction)
        return not (deliver or policy.keeps_memory or policy.computes)

    def _draw(self, channel: _Channel, transfer, lost: torch.Tensor, collective: str, direction: str,
              numel: int, dtype: torch.dtype):
        """What arrives where, given the lost packets of each send (the policy's view of it), and the
        clock charged with the compute the policy adds to the collective."""
        policy = self.recovery.on(direction)
        if policy.computes and collective in ("all_reduce", "send"):
            key = (policy.name, collective, numel, dtype)
            seconds = self._recovery_cost.get(key)
            if seconds is None:
                flops = policy.flops(transfer.sched, transfer.per_packet, numel)
                seconds = self._recovery_cost[key] = self.spec.compute.seconds(flops)
            self._recovery_s += seconds
        return policy.draw(transfer, lost, collective, numel, dtype, channel.memory)

    def _tick(self, repairs: torch.Tensor) -> None:
        """Add a call's repair time (and the same repairs under the ideal preset) to the clock."""
        self._repairs = repairs.clone() if self._repairs is None else self._repairs + repairs

    def _check(self, tensor: torch.Tensor) -> None:
        if tensor.shape[0] != self.ranks:
            raise ValueError(f"expected {self.ranks} ranks along dim 0, got shape {tuple(tensor.shape)}")

    def _channel(self, site: str, direction: str, device) -> _Channel:
        key = (site, direction)
        channel = self._channels.get(key)
        if channel is None:
            chains = Chains(self.loss_model, len(self.links), stream_seed(self.spec.seed, site, direction), device)
            channel = self._channels[key] = _Channel(chains, Counters(len(self.links), self.spec.max_burst, device))
            if self.recovery.keeps_memory:
                channel.memory = recoveries.Memory(self.spec.seed, site, direction, device)
        elif channel.counters.device != torch.device(device):
            raise RuntimeError(f"site {site!r} moved from {channel.counters.device} to {device}; "
                               "create the network after moving the model")
        return channel

    # -- statistics ------------------------------------------------------------------
    def stats(self) -> list[dict]:
        """One record per (site, direction, phase, link) that carried traffic: ready for
        ``pandas.DataFrame``. ``bursts`` counts runs of consecutive losses begun in that
        phase (a run still open at the end counts); ``lost / bursts`` is the observed mean
        burst length. ``resent`` counts retransmissions, ``missing`` packets never delivered.
        """
        rows = []
        for (site, direction), ch in self._channels.items():
            ch.counters.flush()
            counts = ch.counters.counts.tolist()
            for p, phase in enumerate(PHASES):
                for i, (src, dst) in enumerate(self.links):
                    values = {name: counts[c][p][i] for c, name in enumerate(COUNTERS)}
                    if values["sent"] == 0:
                        continue
                    rows.append({"site": site, "direction": direction, "phase": phase, "src": src, "dst": dst,
                                 "link_class": self.link_class(src, dst), "calls": ch.counters.calls, **values})
        return rows + (self._side.stats() if self._side is not None else [])

    def burst_histogram(self) -> list[dict]:
        """Records (site, direction, src, dst, length, count) of loss runs, open runs included."""
        rows = []
        for (site, direction), ch in self._channels.items():
            hist = ch.counters.closed_histogram()
            for i, (src, dst) in enumerate(self.links):
                for length, count in enumerate(hist[i].tolist()):
                    if length and count:
                        rows.append({"site": site, "direction": direction, "src": src, "dst": dst,
                                     "length": length, "count": count})
        return rows + (self._side.burst_histogram() if self._side is not None else [])

    def configured_loss_rate(self, direction: str, src: int, dst: int, site: Optional[str] = None) -> float:
        """The loss rate a link is configured with for one direction's traffic (at ``site``, if given)."""
        lossy = (direction in self.lossy and self.topology.lossy(src, dst)
                 and (site is None or self.spec.selection.covers(site)))
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
        repairs = self._repairs.tolist() if self._repairs is not None else [0.0, 0.0]
        recovery_s = self._recovery_s
        if self._side is not None:
            side = self._side.clock()
            recovery_s += side["ideal_comm_s"]
            repairs = [repairs[0] + side["retransmit_s"], repairs[1] + side["comm_s_ideal_nic"] - side["ideal_comm_s"]]
        return {"comm_s": self._ideal + repairs[0] + recovery_s, "ideal_comm_s": self._ideal,
                "retransmit_s": repairs[0], "recovery_s": recovery_s,
                "comm_s_ideal_nic": self._ideal + repairs[1] + recovery_s}

    def totals(self) -> dict:
        """Every counter summed over call sites, directions, phases and links (syncs): ``summary()``'s
        totals without a record per link."""
        sums = torch.zeros(len(COUNTERS), dtype=torch.long)
        for ch in self._channels.values():
            ch.counters.flush()
            sums += ch.counters.counts.sum((1, 2)).cpu()
        totals = dict(zip(COUNTERS, sums.tolist()))
        if self._side is not None:
            totals = {name: value + self._side.totals()[name] for name, value in totals.items()}
        return totals

    def failures(self) -> int:
        """Collectives the transport gave up on so far (syncs)."""
        index = COUNTERS.index("failures")
        return (sum(int(ch.counters.counts[index].sum()) for ch in self._channels.values())
                + (self._side.failures() if self._side is not None else 0))

    def reset_stats(self) -> None:
        """Zero every counter and the clock; chain states, random streams and what recovery policies
        keep go on."""
        for ch in self._channels.values():
            ch.counters.reset()
            ch.watch = NonFinite()
        self._repairs = None
        self._ideal = 0.0
        self._recovery_s = 0.0
        if self._side is not None:
            self._side.reset_stats()

    # -- save and restore ----------------------------------------------------------
    def state_dict(self) -> dict:
        channels = {}
        for (site, direction), ch in self._channels.items():
            counters = ch.counters.state_dict()
            chains = ch.chains.state_dict()
            channels[f"{site}|{direction}"] = {
                "counts": counters["counts"], "histogram": counters["histogram"], "open_run": counters["open_run"],
                "nonfinite_at": torch.tensor(ch.watch.settle()), "generator": chains["generator"],
                "calls": counters["calls"], "started": chains["started"], "device": str(ch.counters.device),
                "chain": chains["chain"], "recovery": None if ch.memory is None else ch.memory.state_dict()}
        state = {"config": self.config(), "channels": channels, "watch_index": self._watched,
                 "clock": {"repairs_s": None if self._repairs is None else self._repairs.cpu().clone(),
                           "ideal_comm_s": self._ideal,
                           "recovery_s": self._recovery_s},
                 # what each call ran, so a resumed run's summary names the collectives seen before it
                 "choices": [[*key, *choice] for key, choice in self._choices.items()]}
        if self._windows is not None:
            state["windows"] = self._windows.state_dict()
        if self._side is not None:
            state["side"] = self._side.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        saved = dict(state["config"])
        if "tp_size" in saved:  # written before 0.4, when a group's ranks were called tp_size
            saved["ranks"] = saved.pop("tp_size")
        if "nic" not in saved:  # written by 0.2: no nic, its selective repeat is the nic's own
            saved = {**self.config(), **saved, "retransmit": None if saved.get("retransmit") == "selective"
                     else saved.get("retransmit")}
        if saved != self.config():
            raise ValueError(f"network state was saved with {saved}, this network is {self.config()}")
        self._channels = {}
        for key, entry in state["channels"].items():
            site, direction = key.rsplit("|", 1)
            counts = entry["counts"]
            if counts.shape[1] < len(PHASES):   # saved before sends had a phase: they had sent nothing
                grown = counts.new_zeros(counts.shape[0], len(PHASES), counts.shape[2])
                grown[:, :counts.shape[1]] = counts
                entry = {**entry, "counts": grown}
            ch = self._channel(site, direction, torch.device(entry["device"]))
            ch.chains.load_state_dict(entry)
            ch.counters.load_state_dict(entry)
            ch.watch = NonFinite(int(entry["nonfinite_at"]))
            if ch.memory is not None and entry.get("recovery") is not None:
                ch.memory.load_state_dict(entry["recovery"])
        self._watched = state.get("watch_index", 0)
        device = next(iter(self._channels.values())).counters.device if self._channels else "cpu"
        clock = state["clock"]
        if "repairs_s" in clock:
            repairs = clock["repairs_s"]
        else:  # written by 0.2: its clock kept the loss-free and the repaired steps apart
            comm = clock["fixed_comm_s"] + (float(clock["comm_s"]) if clock["comm_s"] is not None else 0.0)
            extra = comm - clock["ideal_comm_s"]
            repairs = torch.tensor([extra, extra], dtype=torch.float64) if extra > 0 else None
        self._repairs = None if repairs is None else repairs.to(device)
        self._ideal = clock["ideal_comm_s"]
        self._recovery_s = clock.get("recovery_s", 0.0)
        self._choices = {tuple(entry[:4]): Estimate(*entry[4:]) for entry in state.get("choices", [])}
        if self._windows is not None:   # saved before windows were carried: every connection fresh
            self._windows = Windows(len(self.links), self.spec.connections)
            if "windows" in state:
                self._windows.load_state_dict(state["windows"])
        if self._side is not None and "side" in state:
            self._side.load_state_dict(state["side"])

    def config(self) -> dict:
        return self.spec.as_dict()

    def __repr__(self) -> str:
        return "LossyNetwork(" + ", ".join(f"{k}={v!r}" for k, v in self.config().items()) + ")"


__all__ = ["LossyNetwork", "NetworkSpec", "DIRECTIONS"]
