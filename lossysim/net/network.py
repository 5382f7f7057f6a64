"""The lossy network between tensor-parallel ranks: where packets are dropped.

A collective moves a message (one rank's tensor, cut into packets of
``payload_bytes``; elements per packet follow from the dtype, the last packet may be
partial) by the sends of its algorithm's schedule (``lossysim.algorithms``) over
directed links between ranks placed on nodes (``lossysim.topology``). Each link has
its own loss chain whose state persists across calls, stepped once per packet put on
that link, in the order the link sends them. Each collective call site (a name such
as ``h.3.attn.reduce``) and direction (``fwd`` activations, ``bwd`` gradients) owns a
random stream seeded from (seed, site, direction), so the masks a site draws depend
neither on call order elsewhere nor on whether one process simulates every rank or
each rank runs in its own process: every process draws every link's mask and keeps
what its receivers hold. The transport (``lossysim.transport``) decides whether lost
packets are repaired and what that costs; the time model (``lossysim.timing``) times
every step, so the network keeps a simulated clock of its communication.

Statistics and the clock stay on the tensors' device (no host sync per call with the
``drop`` transport) until ``stats()`` / ``clock()``.
"""
from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .. import timing
from .algorithms import ALGORITHMS, PHASES, Delivery, Schedule, combine, schedule
from ..loss import LossModel, parse_loss_model
from .topology import Topology
from .links import stream_seed
from .transport import Transport, run_step

DIRECTIONS = ("fwd", "bwd")
RECOVERY_POLICIES = ("zero", "rescale")
COUNTERS = ("sent", "lost", "sent_bad", "bursts", "resent", "missing")
# A selective-repeat transport's timer for a tail loss: an assumption (configurable with rto_s),
# far below go-back-N's IB timeout, as a NIC built for selective repeat would set it.
SELECTIVE_RTO_S = 1e-3


@dataclass
class _Channel:
    """One site and direction: a generator, every link's chain and its counters."""
    generator: torch.Generator
    chain: Optional[torch.Tensor]      # [links] state the next packet arrives in (None: memoryless)
    counts: torch.Tensor               # [counters, phases, links]
    histogram: torch.Tensor            # [links, max_burst + 1] completed runs of losses by length
    open_run: torch.Tensor             # [links] length of the run still open at the end
    nonfinite_at: torch.Tensor         # [] network call index of the first non-finite output, -1 none
    calls: int = 0
    started: bool = False              # chains initialised from the stationary distribution

    def tensors(self):
        return ("counts", "histogram", "open_run", "nonfinite_at")


@dataclass
class _Plan:
    """Per (collective, message size, dtype): the schedule and everything derived from it."""
    sched: Schedule
    link_ids: torch.Tensor             # [rows] network link id of each schedule link
    lossy_rows: list                   # schedule rows whose links can lose packets
    factor: torch.Tensor               # [sends] weight of a delivered packet under rescale
    flat_phase: torch.Tensor           # [rows, width] phase * links + link id, per packet position
    lengths: torch.Tensor              # [rows] packets per link
    width: int                         # max(lengths)
    static_counts: torch.Tensor        # [phases, links] packets a call sends (loss-free)
    steps: list                        # per step with traffic: _Step
    ideal: float                       # loss-free duration of the collective


@dataclass
class _Step:
    """One step's sends and what the transport needs of them, built once per plan."""
    sends: list                        # send indices
    rows: list                         # their schedule link rows
    phase: int
    packets: torch.Tensor              # [sends]
    alpha: torch.Tensor                # [sends] seconds
    tau: torch.Tensor                  # [sends] wire seconds per packet, port sharing included
    rto: torch.Tensor                  # [sends] seconds
    window: torch.Tensor               # [sends] packets in flight during a round trip
    counter_index: torch.Tensor        # [sends] phase * links + link id
    ideal: float                       # loss-free duration


class LossyNetwork:
    """Links between ``tp_size`` ranks with a loss model, an algorithm, a transport and statistics.

    Args:
        tp_size: number of ranks.
        loss_model: a LossModel or a spec for ``parse_loss_model``.
        seed: root of every site's random stream.
        payload_bytes: bytes of tensor data per packet (1450 = UDP in a 1500-byte MTU).
        recovery: ``zero`` (a lost packet contributes nothing) or ``rescale`` (what arrives
            is divided by the probability that it arrives: an unbiased estimate of the sum).
        lossy: directions whose traffic can be lost (``fwd``, ``bwd``); the others are
            delivered intact but still counted and timed.
        max_burst: burst-length histogram bins; the last one holds longer runs.
        algorithm: ``ring`` (default), ``tree`` or ``direct`` (see ``lossysim.algorithms``).
        ranks_per_node, lossy_links: the topology (see ``lossysim.topology``).
        transport: ``drop``, ``retransmit`` or ``deadline``; ``retransmit`` picks the flavour
            (``selective`` or ``go_back_n``); ``deadline`` the budget as a multiple of a step's
            loss-free time (see ``lossysim.transport``).
        link_intra, link_inter: link specs for the time model (``lossysim.timing.parse_link``).
        rto_s: retransmission timeout in seconds (None: the flavour's default).
    """

    def __init__(self, tp_size: int, loss_model="none", seed: int = 0, payload_bytes: int = 1450,
                 recovery: str = "zero", lossy: Sequence[str] = DIRECTIONS, max_burst: int = 256,
                 algorithm: str = "ring", ranks_per_node: Optional[int] = None, lossy_links: str = "all",
                 transport: str = "drop", retransmit: str = "selective", deadline: float = 1.5,
                 link_intra: str = "nvlink4", link_inter: str = "roce-200g", rto_s: Optional[float] = None):
        if int(payload_bytes) < 8:
            raise ValueError(f"payload_bytes={payload_bytes} must be >= 8")
        if recovery not in RECOVERY_POLICIES:
            raise ValueError(f"recovery={recovery!r} must be one of {RECOVERY_POLICIES}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={algorithm!r} must be one of {', '.join(ALGORITHMS)}")
        lossy = (lossy,) if isinstance(lossy, str) else tuple(lossy)
        for direction in lossy:
            if direction not in DIRECTIONS:
                raise ValueError(f"lossy direction {direction!r} must be one of {DIRECTIONS}")
        self.topology = Topology(int(tp_size), ranks_per_node, lossy_links)
        self.tp_size = self.topology.tp_size
        self.loss_model: LossModel = parse_loss_model(loss_model)
        self.transport = Transport(transport, retransmit, float(deadline))
        if recovery == "rescale" and self.loss_model.loss_rate >= 1.0:
            raise ValueError(f"recovery='rescale' needs a loss rate below 1, {self.loss_model.spec} loses "
                             "every packet")
        if recovery == "rescale" and self.transport.kind == "deadline":
            raise ValueError("recovery='rescale' with transport='deadline' is not supported: the probability "
                             "that a packet arrives by the deadline has no closed form")
        if self.transport.kind == "retransmit" and self.transport.mode == "go_back_n" \
                and not self.loss_model.rewindable:
            raise ValueError(f"retransmit=go_back_n is not supported with {self.loss_model.spec}: go-back-N "
                             "learns how many packets it sent only after drawing them; use selective")
        if self.transport.repairs and self.loss_model.loss_rate >= 1.0:
            raise ValueError(f"transport={transport!r} never finishes when {self.loss_model.spec} loses "
                             "every packet")
        self.seed = int(seed)
        self.payload_bytes = int(payload_bytes)
        self.recovery = recovery
        self.lossy = tuple(d for d in DIRECTIONS if d in lossy)
        self.max_burst = int(max_burst)
        self.algorithm = algorithm
        self.links = [(src, dst) for src in range(self.tp_size) for dst in range(self.tp_size)
                      if src != dst]
        self.link_specs = {"intra": timing.parse_link(link_intra), "inter": timing.parse_link(link_inter)}
        self.rto_s = None if rto_s is None else float(rto_s)
        if self.rto_s is not None and not self.rto_s > 0:
            raise ValueError(f"rto_s={rto_s} must be > 0")
        self._channels: dict[tuple[str, str], _Channel] = {}
        self._plans: dict[tuple, _Plan] = {}
        self._recording: Optional[dict] = None
        self._replaying: Optional[dict] = None
        self._watch_index = 0
        self._comm: Optional[torch.Tensor] = None   # simulated seconds of repaired steps, on the device
        self._comm_fixed = 0.0                      # simulated seconds of steps that took their loss-free time
        self._ideal = 0.0                           # all the traffic without loss

    # -- packets ---------------------------------------------------------------
    def packets(self, numel: int, dtype: torch.dtype) -> tuple[int, int]:
        """(elements per packet, packets per message) for a message of ``numel`` elements."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_packet = max(1, self.payload_bytes // itemsize)
        return per_packet, -(-int(numel) // per_packet)

    def drops(self, direction: str) -> bool:
        """Whether traffic in this direction can lose packets."""
        return direction in self.lossy and not self.loss_model.lossless

    def exact(self, direction: str) -> bool:
        """Whether tensors in this direction always arrive exact (no loss, or retransmitted)."""
        return not self.drops(direction) or self.transport.exact

    def link_class(self, src: int, dst: int) -> str:
        return self.topology.link_class(src, dst)

    # -- collectives -------------------------------------------------------------
    def all_reduce(self, site: str, direction: str, contributions: torch.Tensor,
                   receivers: Sequence[int]) -> torch.Tensor:
        """Sum every rank's contribution as each receiver sees it.

        ``contributions`` is ``[tp_size, *shape]`` (rank j's message at j). Returns
        ``[len(receivers), *shape]``: what the algorithm leaves at each receiver.
        """
        self._check(contributions)
        shape = contributions.shape[1:]
        delivery = self._deliver(site, direction, "all_reduce", contributions[0])
        if delivery is None:
            total = contributions.sum(0)
            self.watch(site, direction, total)
            return total.unsqueeze(0).expand(len(receivers), *shape)
        if delivery.weights is not None:
            out = self._weighted_sum(contributions, delivery.weights[list(receivers)])
            self.watch(site, direction, out)
        else:
            out, final = self._relay(contributions, delivery, list(receivers))
            self.watch(site, direction, final)  # receivers hold it or zeros: a tp_size-times cheaper check
        return out.reshape(len(receivers), *shape)

    def all_gather(self, site: str, direction: str, shards: torch.Tensor,
                   receivers: Sequence[int]) -> torch.Tensor:
        """Every rank's shard as each receiver sees it: ``[len(receivers), tp_size, *shape]``.

        Lost packets of a shard arrive as zeros (a gathered shard is not a sum, so
        ``rescale`` does not apply to it).
        """
        self._check(shards)
        shape = shards.shape[1:]
        delivery = self._deliver(site, direction, "all_gather", shards[0])
        if delivery is None:
            return shards.unsqueeze(0).expand(len(receivers), *shards.shape)
        keep = delivery.weights[list(receivers)]
        per_packet, n_packets = self.packets(shape.numel(), shards.dtype)
        packed = _as_packets(shards, per_packet, n_packets)
        out = torch.where(keep[..., None] > 0, packed.unsqueeze(0), 0)
        self.watch(site, direction, out)
        return out.flatten(2)[..., : shape.numel()].reshape(len(receivers), *shards.shape)

    def account(self, site: str, direction: str, message: torch.Tensor, collective: str = "all_reduce") -> None:
        """Count and time one collective whose data a real library moves (dist, loss-free or
        retransmitted): ``message`` is one rank's tensor."""
        if self._deliver(site, direction, collective, message) is not None:
            raise RuntimeError(f"{site} {direction}: traffic is lossy, it must go through the network")

    def watch(self, site: str, direction: str, delivered: torch.Tensor) -> None:
        """Remember (on the device, no sync) the first call whose delivered tensor is non-finite."""
        if self._replaying is not None:
            return
        channel = self._channel(site, direction, delivered.device)
        self._watch_index += 1
        # inf and NaN reach the sum; one reduction is half the cost of isfinite().all().
        bad = ~torch.isfinite(delivered.sum()) & (channel.nonfinite_at < 0)
        channel.nonfinite_at = torch.where(bad, self._watch_index, channel.nonfinite_at)

    def first_nonfinite(self) -> Optional[dict]:
        """The site and direction whose delivered data first became non-finite, if any (syncs)."""
        seen = [(int(ch.nonfinite_at), site, direction)
                for (site, direction), ch in self._channels.items() if int(ch.nonfinite_at) >= 0]
        if not seen:
            return None
        _, site, direction = min(seen)
        return {"site": site, "direction": direction}

    # -- activation checkpointing: a recomputed forward replays its masks -----
    @contextlib.contextmanager
    def recording(self, record: dict):
        """Append the deliveries drawn inside to ``record[(site, direction)]``."""
        previous, self._recording = self._recording, record
        try:
            yield record
        finally:
            self._recording = previous

    @contextlib.contextmanager
    def replaying(self, record: dict):
        """Reuse the deliveries of ``record`` in call order; draw, count and time nothing."""
        previous, self._replaying = self._replaying, record
        try:
            yield
        finally:
            self._replaying = previous

    # -- one collective: draw, repair, time ------------------------------------------
    def _deliver(self, site: str, direction: str, collective: str, message: torch.Tensor) -> Optional[Delivery]:
        """What the receivers hold (None: the exact result), counting and timing the traffic."""
        key = (site, direction)
        if self._replaying is not None:
            return self._replaying[key].popleft()
        if self.tp_size == 1:
            return None
        channel = self._channel(site, direction, message.device)
        plan = self._plan(collective, message.numel(), message.dtype, message.device)
        channel.calls += 1
        self._ideal += plan.ideal
        delivery = None
        if not self.drops(direction):
            channel.counts[0] += plan.static_counts
            self._tick(plan.ideal, message.device)
        elif not self.transport.repairs:
            lost, _ = self._draw(channel, plan, plan.lengths, plan.flat_phase)
            keep = ~lost.flatten()[plan.sched.tensors(lost.device)["gather"]]
            delivery = self._combine(plan, keep, collective, message.dtype)
            self._tick(plan.ideal, message.device)
        else:
            missing = self._repair(channel, plan, message.device)
            if not self.transport.exact:
                delivery = self._combine(plan, ~missing, collective, message.dtype)
        if self._recording is not None:
            self._recording[key].append(delivery)
        return delivery

    def _combine(self, plan: _Plan, keep: torch.Tensor, collective: str, dtype: torch.dtype) -> Delivery:
        sched = plan.sched
        keep = keep | sched.tensors(keep.device)["padding"]
        weights = keep.to(torch.promote_types(dtype, torch.float32))
        if self.recovery == "rescale" and collective == "all_reduce":
            weights = weights * plan.factor.to(weights.dtype).unsqueeze(1)
        return combine(sched, weights)

    def _repair(self, channel: _Channel, plan: _Plan, device) -> torch.Tensor:
        """Run every step through the transport; returns the missing packets per send."""
        sched = plan.sched
        missing = torch.zeros(len(sched.sends), sched.max_packets, dtype=torch.bool, device=device)
        for step in plan.steps:
            draw = self._draw_fn(channel, plan, step.rows, step.phase)
            result = run_step(self.transport, step.packets, draw, step.alpha, step.tau, step.rto, step.window,
                              budget=self.transport.deadline * step.ideal)
            missing[step.sends, :result.missing.shape[1]] = result.missing
            counts = channel.counts.view(len(COUNTERS), -1)
            counts[COUNTERS.index("resent")].index_add_(0, step.counter_index, result.transmissions - step.packets)
            counts[COUNTERS.index("missing")].index_add_(0, step.counter_index, result.missing.sum(1))
            self._tick(result.time, device)
        return missing

    def _tick(self, seconds, device) -> None:
        if isinstance(seconds, float):  # loss-free time: no device op
            self._comm_fixed += seconds
            return
        if self._comm is None:
            self._comm = torch.zeros((), dtype=torch.float64, device=device)
        self._comm += seconds

    # -- drawing from the links' chains -------------------------------------------------
    def _draw(self, channel: _Channel, plan: _Plan, lengths: torch.Tensor, phase, rows=None):
        """Draw the next ``lengths`` packets of each link in ``rows`` (default: all the plan's),
        record them, and return (lost [rows, max(lengths)], in_bad)."""
        lost, in_bad, commit = self._sample(channel, plan, lengths, rows)
        commit(lengths, phase)
        return lost, in_bad

    def _draw_fn(self, channel: _Channel, plan: _Plan, rows: list, phase: int):
        """A transport's view of some links: draw(lengths, known) -> (lost, commit(used)); with
        ``known`` False only commit says how many of the drawn packets were really sent."""
        def draw(lengths, known=True):
            lost, _, commit = self._sample(channel, plan, lengths, rows, known)
            return lost, lambda used: commit(used, phase)
        return draw

    def _sample(self, channel: _Channel, plan: _Plan, lengths: torch.Tensor, rows=None, known: bool = True):
        """Draw ``lengths`` packets per link. ``known``: exactly those are sent (the chains end
        after them); otherwise ``commit(used)`` rewinds each chain to its ``used``-th packet."""
        device = channel.counts.device
        if rows is None:  # the whole schedule: its width is known without a sync
            rows, link_ids, width = range(len(plan.sched.links)), plan.link_ids, plan.width
        else:
            link_ids = plan.link_ids[rows]
            width = int(lengths.max()) if lengths.numel() else 0
        lossy = [i for i, r in enumerate(rows) if r in plan.lossy_rows]
        lost = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
        in_bad = torch.zeros_like(lost)
        draw_ids = link_ids[lossy] if len(lossy) < len(rows) else link_ids
        state = None
        if lossy:
            if not channel.started:  # every link's chain starts from the stationary distribution
                _, _, channel.chain = self.loss_model.sample_with_states(
                    (len(self.links), 0), channel.generator, None)
                channel.started = True
            state = None if channel.chain is None else channel.chain[draw_ids]
            sent = (lengths[lossy] if len(lossy) < len(rows) else lengths) if known else None
            drawn, bad, after = self.loss_model.sample_with_states((len(lossy), width), channel.generator, state,
                                                                   used=sent)
            if len(lossy) < len(rows):
                lost[lossy], in_bad[lossy] = drawn, bad
            else:
                lost, in_bad = drawn, bad

        def commit(used, phase):
            used = used.to(device)
            if lossy and channel.chain is not None:
                sub = used[lossy] if len(lossy) < len(rows) else used
                channel.chain = channel.chain.clone()
                channel.chain[draw_ids] = after if known else self.loss_model.state_after(bad, after, sub)
            self._record(channel, link_ids, lost, in_bad, used, phase)
        return lost, in_bad, commit

    def _record(self, channel: _Channel, link_ids, lost, in_bad, used, phase) -> None:
        n_links = len(self.links)
        width = lost.shape[-1]
        if width == 0:
            return
        position = torch.arange(width, device=lost.device)
        valid = position < used.unsqueeze(1)
        lost = lost & valid
        if isinstance(phase, int):
            index = (phase * n_links + link_ids).unsqueeze(1).expand(-1, width)
        else:  # a static [rows, width] index of phase * links + link id
            index = phase
        index = index.reshape(-1)
        was_open = channel.open_run[link_ids] > 0
        previous = torch.cat([was_open.unsqueeze(-1), lost[:, :-1]], dim=-1)
        starts = lost & ~previous
        counts = channel.counts.view(len(COUNTERS), -1)
        for name, values in (("sent", valid), ("lost", lost), ("sent_bad", in_bad & valid), ("bursts", starts)):
            counts[COUNTERS.index(name)].index_add_(0, index, values.reshape(-1).long())
        # Runs of losses, continuing a run left open by this link's previous packets.
        closed = was_open & (used > 0) & ~lost[:, 0]
        open_run = channel.open_run[link_ids]
        bins = channel.histogram.shape[1]
        channel.histogram.view(-1).index_add_(
            0, link_ids * bins + open_run.clamp(max=self.max_burst), closed.long())
        run_start = torch.where(starts, position, -1).cummax(-1).values
        length = torch.where(run_start >= 0, position - run_start + 1, position + 1 + open_run.unsqueeze(-1))
        # A run reaching the last packet sent stays open.
        follows = torch.cat([lost[:, 1:], torch.ones_like(lost[:, :1])], dim=-1) | (position + 1 >= used.unsqueeze(1))
        ends = lost & ~follows
        channel.histogram.view(-1).index_add_(
            0, (link_ids.unsqueeze(1) * bins + torch.where(ends, length.clamp(max=self.max_burst), 0)).reshape(-1),
            ends.reshape(-1).long())
        last = (used - 1).clamp(min=0).unsqueeze(1)
        still = lost.gather(1, last).squeeze(1)
        new_open = torch.where(still, length.gather(1, last).squeeze(1), 0)
        channel.open_run = channel.open_run.clone()
        channel.open_run[link_ids] = torch.where(used > 0, new_open, open_run)

    # -- applying a delivery to data -------------------------------------------------
    def _relay(self, x: torch.Tensor, delivery: Delivery, receivers: list, dense: Optional[bool] = None):
        """Ring or tree all-reduce: the exact sum where every contribution reached the final
        packet, a weighted sum where some did not, times each receiver's gain (0: a hole).
        Returns (what the receivers hold [receivers, n], the final packets).

        On a CPU only the packets some contribution missed are recomputed (a list of them);
        on a GPU every packet's weighted sum is computed and selected (no host sync).
        """
        dense = x.device.type == "cuda" if dense is None else dense
        ranks, n = x.shape[0], x[0].numel()
        per_packet, n_packets = self.packets(n, x.dtype)
        flat = x.reshape(ranks, n)
        final = flat.new_empty(n_packets * per_packet)
        torch.sum(flat, 0, out=final[:n])
        final[n:] = 0
        final = final.view(n_packets, per_packet)
        coef = delivery.coef.to(x.dtype)
        if dense:
            packed = _as_packets(x, per_packet, n_packets)
            weight = coef.unsqueeze(-1)
            partial = (torch.where(weight > 0, packed, 0) * weight).sum(0)
            if self.recovery == "zero":
                final = torch.where((coef == 0).any(0).unsqueeze(-1), partial, final)
            else:
                final = partial
            patch = coef[:0, :0]
        elif self.recovery == "zero":
            patch = (coef == 0).any(0).nonzero().squeeze(1)
        else:
            patch = torch.arange(n_packets, device=x.device)
        if patch.numel():
            elements = patch.unsqueeze(1) * per_packet + torch.arange(per_packet, device=x.device)
            inside = elements < n
            parts = flat[:, elements.clamp(max=n - 1)]                       # [ranks, patched, per_packet]
            weight = coef[:, patch].unsqueeze(-1)
            # A lost packet contributes nothing, even if it held inf or NaN (0 * inf would be NaN).
            final[patch] = torch.where(inside, (torch.where(weight > 0, parts, 0) * weight).sum(0), 0)
        gain = delivery.gain[receivers].to(x.dtype)
        if self.recovery == "rescale":
            out = final * gain.unsqueeze(-1)
        else:  # a copy per receiver (torch.where costs several times a copy on a CPU)
            out = final.expand(len(receivers), *final.shape).clone()
        # A hole is zero, even where the final packet held inf or NaN (0 * inf would be NaN).
        if dense:
            out.masked_fill_((gain == 0).unsqueeze(-1), 0)
        else:
            holes = (gain == 0).nonzero()
            out[holes[:, 0], holes[:, 1]] = 0
        return out.flatten(1)[:, :n], final

    def _weighted_sum(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Direct all-reduce: receiver i adds every sender's packets with weights[i, j]."""
        n = x[0].numel()
        per_packet, n_packets = self.packets(n, x.dtype)
        packed = _as_packets(x, per_packet, n_packets)
        weights = weights.to(x.dtype).unsqueeze(-1)
        out = torch.where(weights[:, 0] > 0, packed[0], 0) * weights[:, 0]
        for sender in range(1, self.tp_size):
            out = out + torch.where(weights[:, sender] > 0, packed[sender], 0) * weights[:, sender]
        return out.flatten(1)[:, :n]

    # -- plans ------------------------------------------------------------------------
    def _plan(self, collective: str, numel: int, dtype: torch.dtype, device) -> _Plan:
        key = (collective, int(numel), dtype, torch.device(device))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(collective, int(numel), dtype, torch.device(device))
        return plan

    def _make_plan(self, collective: str, numel: int, dtype: torch.dtype, device) -> _Plan:
        per_packet, n_packets = self.packets(numel, dtype)
        sched = schedule(self.algorithm, collective, self.tp_size, n_packets)
        index = {link: i for i, link in enumerate(self.links)}
        link_ids = torch.tensor([index[link] for link in sched.links], dtype=torch.long, device=device)
        lossy_rows = [r for r, (src, dst) in enumerate(sched.links) if self.topology.lossy(src, dst)]
        rescale = 1.0 / (1.0 - self.loss_model.loss_rate) if self.loss_model.loss_rate < 1 else 0.0
        factor = torch.tensor([rescale if self.topology.lossy(s.src, s.dst) else 1.0 for s in sched.sends],
                              dtype=torch.float64, device=device)
        tensors = sched.tensors(device)
        flat_phase = tensors["phase"] * len(self.links) + link_ids.unsqueeze(1) \
            if tensors["phase"].numel() else tensors["phase"]
        lengths = tensors["link_packets"].to(torch.long)
        static = torch.zeros(len(PHASES), len(self.links), dtype=torch.long, device=device)
        for s, row in zip(sched.sends, sched.send_row):
            static[PHASES.index(s.phase), link_ids[row]] += s.packets
        itemsize = torch.empty((), dtype=dtype).element_size()
        # Port sharing: a rank's sends (receives) of one step on one link class share its port.
        out_deg, in_deg = defaultdict(int), defaultdict(int)
        for s in sched.sends:
            if s.packets:
                cls = self.link_class(s.src, s.dst)
                out_deg[(s.step, s.src, cls)] += 1
                in_deg[(s.step, s.dst, cls)] += 1
        alpha, tau, rto, window, durations = [], [], [], [], []
        for s in sched.sends:
            cls = self.link_class(s.src, s.dst)
            link = self.link_specs[cls]
            share = max(out_deg[(s.step, s.src, cls)], in_deg[(s.step, s.dst, cls)], 1)
            payload = (min(numel, (s.first + s.packets) * per_packet) - s.first * per_packet) * itemsize
            wire = link.wire_bytes(payload, s.packets) if s.packets else 0
            alpha.append(link.latency_s)
            tau.append(wire * share / link.bandwidth_Bps / s.packets if s.packets else 0.0)
            rto.append(self.rto_s if self.rto_s is not None else _default_rto(self.transport.mode))
            window.append(timing.window_packets(link, self.payload_bytes))
            durations.append(link.send_time(payload, s.packets, share) if s.packets else 0.0)
        steps = []
        for k in range(sched.steps):
            sends = [i for i, s in enumerate(sched.sends) if s.step == k and s.packets]
            if not sends:
                continue
            rows = [sched.send_row[i] for i in sends]
            phase = PHASES.index(sched.sends[sends[0]].phase)
            seconds = lambda values: torch.tensor([values[i] for i in sends], dtype=torch.float64,  # noqa: E731
                                                  device=device)
            steps.append(_Step(sends, rows, phase,
                               torch.tensor([sched.sends[i].packets for i in sends], device=device),
                               seconds(alpha), seconds(tau), seconds(rto),
                               torch.tensor([window[i] for i in sends], device=device),
                               phase * len(self.links) + link_ids[rows], max(durations[i] for i in sends)))
        return _Plan(sched, link_ids, lossy_rows, factor, flat_phase, lengths, max(sched.link_packets, default=0),
                     static, steps, sum(step.ideal for step in steps))

    # -- internals -----------------------------------------------------------------
    def _check(self, tensor: torch.Tensor) -> None:
        if tensor.shape[0] != self.tp_size:
            raise ValueError(f"expected {self.tp_size} ranks along dim 0, got shape {tuple(tensor.shape)}")

    def _channel(self, site: str, direction: str, device: torch.device) -> _Channel:
        key = (site, direction)
        channel = self._channels.get(key)
        if channel is None:
            n = len(self.links)
            generator = torch.Generator(device=device)
            generator.manual_seed(stream_seed(self.seed, site, direction))
            zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)  # noqa: E731
            channel = _Channel(generator, None, zeros(len(COUNTERS), len(PHASES), n),
                               zeros(n, self.max_burst + 1), zeros(n), zeros(()) - 1)
            self._channels[key] = channel
        elif channel.counts.device != torch.device(device):
            raise RuntimeError(f"site {site!r} moved from {channel.counts.device} to {device}; "
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
            counts = ch.counts.tolist()
            for p, phase in enumerate(PHASES):
                for i, (src, dst) in enumerate(self.links):
                    values = {name: counts[c][p][i] for c, name in enumerate(COUNTERS)}
                    if values["sent"] == 0:
                        continue
                    rows.append({"site": site, "direction": direction, "phase": phase, "src": src, "dst": dst,
                                 "link_class": self.link_class(src, dst), "calls": ch.calls, **values})
        return rows

    def burst_histogram(self) -> list[dict]:
        """Records (site, direction, src, dst, length, count) of loss runs, open runs included."""
        rows = []
        for (site, direction), ch in self._channels.items():
            hist = ch.histogram.clone()
            hist.scatter_add_(1, ch.open_run.clamp(max=self.max_burst).unsqueeze(-1),
                              (ch.open_run > 0).long().unsqueeze(-1))
            for i, (src, dst) in enumerate(self.links):
                for length, count in enumerate(hist[i].tolist()):
                    if length and count:
                        rows.append({"site": site, "direction": direction, "src": src, "dst": dst,
                                     "length": length, "count": count})
        return rows

    def configured_loss_rate(self, direction: str, src: int, dst: int) -> float:
        """The loss rate a link is configured with for one direction's traffic."""
        lossy = direction in self.lossy and self.topology.lossy(src, dst)
        return self.loss_model.loss_rate if lossy else 0.0

    def summary(self, by: Sequence[str] = ("direction",)) -> list[dict]:
        """Totals grouped by any of site/direction/phase/src/dst/link_class, with configured
        (packet-weighted over the group's links) and observed loss rates and mean bursts."""
        totals: dict[tuple, dict] = {}
        for row in self.stats():
            key = tuple(row[k] for k in by)
            acc = totals.setdefault(key, {**dict(zip(by, key)), **{name: 0 for name in COUNTERS}, "_lossy": 0})
            for name in COUNTERS:
                acc[name] += row[name]
            if self.configured_loss_rate(row["direction"], row["src"], row["dst"]) > 0:
                acc["_lossy"] += row["sent"]
        for acc in totals.values():
            lossy = acc.pop("_lossy")  # every link is configured with the model's rate, or 0
            acc["configured_loss_rate"] = self.loss_model.loss_rate * lossy / acc["sent"] if acc["sent"] else 0.0
            acc["configured_mean_burst"] = self.loss_model.mean_burst if lossy else 0.0
            acc["observed_loss_rate"] = acc["lost"] / acc["sent"] if acc["sent"] else math.nan
            acc["observed_mean_burst"] = acc["lost"] / acc["bursts"] if acc["bursts"] else 0.0
        return list(totals.values())

    def clock(self) -> dict:
        """Simulated communication time so far (syncs): with loss and repairs, and without loss."""
        comm = self._comm_fixed + (float(self._comm) if self._comm is not None else 0.0)
        return {"comm_s": comm, "ideal_comm_s": self._ideal, "retransmit_s": max(comm - self._ideal, 0.0)}

    def reset_stats(self) -> None:
        """Zero every counter and the clock; chain states and random streams go on."""
        for ch in self._channels.values():
            ch.counts.zero_()
            ch.histogram.zero_()
            ch.open_run.zero_()
            ch.nonfinite_at.fill_(-1)
            ch.calls = 0
        self._comm = None
        self._comm_fixed = 0.0
        self._ideal = 0.0

    # -- save and restore ----------------------------------------------------------
    def state_dict(self) -> dict:
        channels = {}
        for (site, direction), ch in self._channels.items():
            entry = {name: getattr(ch, name).cpu().clone() for name in ch.tensors()}
            entry.update(generator=ch.generator.get_state(), calls=ch.calls, started=ch.started,
                         device=str(ch.counts.device),
                         chain=None if ch.chain is None else ch.chain.cpu().clone())
            channels[f"{site}|{direction}"] = entry
        return {"config": self.config(), "channels": channels, "watch_index": self._watch_index,
                "clock": {"comm_s": None if self._comm is None else self._comm.cpu().clone(),
                          "fixed_comm_s": self._comm_fixed, "ideal_comm_s": self._ideal}}

    def load_state_dict(self, state: dict) -> None:
        if state["config"] != self.config():
            raise ValueError(f"network state was saved with {state['config']}, this network is {self.config()}")
        self._channels = {}
        for key, entry in state["channels"].items():
            site, direction = key.rsplit("|", 1)
            device = torch.device(entry["device"])
            ch = self._channel(site, direction, device)
            ch.generator.set_state(entry["generator"])
            ch.chain = None if entry["chain"] is None else entry["chain"].to(device)
            for name in ch.tensors():
                setattr(ch, name, entry[name].to(device))
            ch.calls, ch.started = entry["calls"], entry["started"]
        self._watch_index = state.get("watch_index", 0)
        comm = state["clock"]["comm_s"]
        self._comm = None if comm is None else comm.to(next(iter(self._channels.values())).counts.device
                                                      if self._channels else "cpu")
        self._comm_fixed = state["clock"]["fixed_comm_s"]
        self._ideal = state["clock"]["ideal_comm_s"]

    def config(self) -> dict:
        return {"tp_size": self.tp_size, "loss_model": self.loss_model.spec, "seed": self.seed,
                "payload_bytes": self.payload_bytes, "recovery": self.recovery,
                "lossy": list(self.lossy), "max_burst": self.max_burst, "algorithm": self.algorithm,
                "ranks_per_node": self.topology.ranks_per_node, "lossy_links": self.topology.lossy_links,
                "transport": self.transport.kind, "retransmit": self.transport.mode,
                "deadline": self.transport.deadline,
                "link_intra": self.link_specs["intra"].spec, "link_inter": self.link_specs["inter"].spec,
                "rto_s": self.rto_s}

    def __repr__(self) -> str:
        return "LossyNetwork(" + ", ".join(f"{k}={v!r}" for k, v in self.config().items()) + ")"


def _as_packets(tensor: torch.Tensor, per_packet: int, n_packets: int) -> torch.Tensor:
    flat = tensor.reshape(tensor.shape[0], -1)
    pad = per_packet * n_packets - flat.shape[1]
    if pad:
        flat = F.pad(flat, (0, pad))
    return flat.view(tensor.shape[0], n_packets, per_packet)


def _default_rto(mode: str) -> float:
    """The timeout a tail loss waits when none is configured (see docs/time_model.md)."""
    return timing.ib_timeout_s() if mode == "go_back_n" else SELECTIVE_RTO_S
