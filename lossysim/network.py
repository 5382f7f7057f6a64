"""The lossy network between tensor-parallel ranks: where packets are dropped.

Ranks are fully connected by directed links (sender -> receiver). A message is a
rank's tensor, cut into packets of ``payload_bytes`` (elements per packet follow
from the dtype; the last packet may be partial). Each collective call site (a
name such as ``h.3.attn.reduce``) and direction (``fwd`` activations, ``bwd``
gradients) owns a random stream seeded from (seed, site, direction), so the
masks a site draws depend neither on call order elsewhere nor on whether one
process simulates every rank or each rank runs in its own process: every
process draws every link's mask (cheap next to the tensors) and keeps the rows
it receives. Each link has its own loss chain whose state persists across calls.

Statistics stay on the tensors' device (no host sync per call) until ``stats()``.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .loss_models import LossModel, parse_loss_model

DIRECTIONS = ("fwd", "bwd")
RECOVERY_POLICIES = ("zero", "rescale")


def stream_seed(seed: int, site: str, direction: str) -> int:
    """A stable 63-bit seed for one (seed, site, direction) random stream."""
    digest = hashlib.blake2b(f"{seed}\0{site}\0{direction}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass
class _Channel:
    """One site and direction: a generator, every link's chain and its counters."""
    generator: torch.Generator
    chain: Optional[torch.Tensor]      # [links] bool state the next packet arrives in
    sent: torch.Tensor                 # [links] packets sent
    lost: torch.Tensor                 # [links] packets lost
    sent_bad: torch.Tensor             # [links] packets sent in the Bad state
    bursts: torch.Tensor               # [links] runs of consecutive losses begun
    histogram: torch.Tensor            # [links, max_burst + 1] completed runs by length
    open_run: torch.Tensor             # [links] length of the run still open at the end
    nonfinite_at: torch.Tensor         # [] network call index of the first non-finite output, -1 none
    calls: int = 0

    def counters(self):
        return ("sent", "lost", "sent_bad", "bursts", "histogram", "open_run", "nonfinite_at")


class LossyNetwork:
    """Links between ``tp_size`` ranks with a loss model, recovery policy and statistics.

    Args:
        tp_size: number of ranks.
        loss_model: a LossModel or a spec for ``parse_loss_model``.
        seed: root of every site's random stream.
        payload_bytes: bytes of tensor data per packet (1450 = UDP in a 1500-byte MTU).
        recovery: ``zero`` (a lost packet contributes nothing) or ``rescale``
            (surviving remote contributions divided by the delivery probability,
            an unbiased estimate of the sum).
        lossy: directions whose traffic can be lost (``fwd``, ``bwd``); the
            others are delivered intact but still counted.
        max_burst: burst-length histogram bins; the last one holds longer runs.
    """

    def __init__(self, tp_size: int, loss_model="none", seed: int = 0, payload_bytes: int = 1450,
                 recovery: str = "zero", lossy: Sequence[str] = DIRECTIONS, max_burst: int = 256):
        if int(tp_size) < 1:
            raise ValueError(f"tp_size={tp_size} must be >= 1")
        if int(payload_bytes) < 8:
            raise ValueError(f"payload_bytes={payload_bytes} must be >= 8")
        if recovery not in RECOVERY_POLICIES:
            raise ValueError(f"recovery={recovery!r} must be one of {RECOVERY_POLICIES}")
        lossy = (lossy,) if isinstance(lossy, str) else tuple(lossy)
        for direction in lossy:
            if direction not in DIRECTIONS:
                raise ValueError(f"lossy direction {direction!r} must be one of {DIRECTIONS}")
        self.tp_size = int(tp_size)
        self.loss_model: LossModel = parse_loss_model(loss_model)
        if recovery == "rescale" and self.loss_model.loss_rate >= 1.0:
            raise ValueError(f"recovery='rescale' needs a loss rate below 1, {self.loss_model.spec} loses "
                             "every packet")
        self.seed = int(seed)
        self.payload_bytes = int(payload_bytes)
        self.recovery = recovery
        self.lossy = tuple(d for d in DIRECTIONS if d in lossy)
        self.max_burst = int(max_burst)
        self.links = [(src, dst) for src in range(self.tp_size) for dst in range(self.tp_size)
                      if src != dst]
        self._channels: dict[tuple[str, str], _Channel] = {}
        self._recording: Optional[dict] = None
        self._replaying: Optional[dict] = None
        self._watch_index = 0

    # -- packets ---------------------------------------------------------------
    def packets(self, numel: int, dtype: torch.dtype) -> tuple[int, int]:
        """(elements per packet, packets per message) for a message of ``numel`` elements."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_packet = max(1, self.payload_bytes // itemsize)
        return per_packet, -(-int(numel) // per_packet)

    def drops(self, direction: str) -> bool:
        """Whether traffic in this direction can lose packets."""
        return direction in self.lossy and not self.loss_model.lossless

    # -- collectives -------------------------------------------------------------
    def all_reduce(self, site: str, direction: str, contributions: torch.Tensor,
                   receivers: Sequence[int]) -> torch.Tensor:
        """Sum every rank's contribution as each receiver sees it.

        ``contributions`` is ``[tp_size, *shape]`` (rank j's message at j).
        Returns ``[len(receivers), *shape]``: receiver i's own contribution plus
        every peer's with the packets lost on link peer->i recovered by policy.
        Senders are added in rank order, so every process computes the same bits.
        """
        self._check(contributions)
        shape = contributions.shape[1:]
        if not self.drops(direction):
            self.count(site, direction, contributions[0])
            total = contributions.sum(0)
            self.watch(site, direction, total)
            return total.unsqueeze(0).expand(len(receivers), *shape)
        weights = self._delivery(site, direction, contributions[0])[list(receivers)]
        per_packet, n_packets = self.packets(shape.numel(), contributions.dtype)
        packed = self._as_packets(contributions, per_packet, n_packets)
        # A lost packet contributes nothing, even if it held inf or NaN (0 * inf would be NaN).
        weights = weights.unsqueeze(-1)
        out = torch.where(weights[:, 0] > 0, packed[0], 0) * weights[:, 0]
        for sender in range(1, self.tp_size):
            out = out + torch.where(weights[:, sender] > 0, packed[sender], 0) * weights[:, sender]
        self.watch(site, direction, out)
        return out.flatten(1)[:, : shape.numel()].reshape(len(receivers), *shape)

    def all_gather(self, site: str, direction: str, shards: torch.Tensor,
                   receivers: Sequence[int]) -> torch.Tensor:
        """Every rank's shard as each receiver sees it: ``[len(receivers), tp_size, *shape]``.

        Lost packets of a peer's shard arrive as zeros (a gathered shard is not a
        sum, so ``rescale`` does not apply to it).
        """
        self._check(shards)
        shape = shards.shape[1:]
        if not self.drops(direction):
            self.count(site, direction, shards[0])
            return shards.unsqueeze(0).expand(len(receivers), *shards.shape)
        keep = self._delivery(site, direction, shards[0], rescale=False)[list(receivers)]
        per_packet, n_packets = self.packets(shape.numel(), shards.dtype)
        packed = self._as_packets(shards, per_packet, n_packets)
        out = torch.where(keep[..., None] > 0, packed.unsqueeze(0), 0)
        self.watch(site, direction, out)
        return out.flatten(2)[..., : shape.numel()].reshape(len(receivers), *shards.shape)

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

    def count(self, site: str, direction: str, message: torch.Tensor) -> None:
        """Count one message per link sent without loss."""
        if self._replaying is not None:
            return
        channel = self._channel(site, direction, message.device)
        channel.sent += self.packets(message.numel(), message.dtype)[1]
        channel.calls += 1

    # -- activation checkpointing: a recomputed forward replays its masks -----
    @contextlib.contextmanager
    def recording(self, record: dict):
        """Append the delivery weights drawn inside to ``record[(site, direction)]``."""
        previous, self._recording = self._recording, record
        try:
            yield record
        finally:
            self._recording = previous

    @contextlib.contextmanager
    def replaying(self, record: dict):
        """Reuse the weights of ``record`` in call order; draw and count nothing."""
        previous, self._replaying = self._replaying, record
        try:
            yield
        finally:
            self._replaying = previous

    # -- internals -----------------------------------------------------------------
    def _check(self, tensor: torch.Tensor) -> None:
        if tensor.shape[0] != self.tp_size:
            raise ValueError(f"expected {self.tp_size} ranks along dim 0, got shape {tuple(tensor.shape)}")

    @staticmethod
    def _as_packets(tensor: torch.Tensor, per_packet: int, n_packets: int) -> torch.Tensor:
        flat = tensor.reshape(tensor.shape[0], -1)
        pad = per_packet * n_packets - flat.shape[1]
        if pad:
            flat = F.pad(flat, (0, pad))
        return flat.view(tensor.shape[0], n_packets, per_packet)

    def _delivery(self, site: str, direction: str, message: torch.Tensor, rescale: bool = True):
        """Weights [receiver, sender, packet] for one message per link: 1 own, 0 lost."""
        key = (site, direction)
        if self._replaying is not None:
            return self._replaying[key].popleft()
        channel = self._channel(site, direction, message.device)
        n_packets = self.packets(message.numel(), message.dtype)[1]
        lost, in_bad, channel.chain = self.loss_model.sample_with_states(
            (len(self.links), n_packets), channel.generator, channel.chain)
        self._record(channel, lost, in_bad)
        delivered = 1.0
        if rescale and self.recovery == "rescale":
            delivered = 1.0 / (1.0 - self.loss_model.loss_rate)
        keep = (~lost).to(message.dtype) * delivered
        weights = torch.ones(self.tp_size, self.tp_size, n_packets, dtype=message.dtype,
                             device=message.device)
        src = torch.tensor([s for s, _ in self.links], device=message.device)
        dst = torch.tensor([d for _, d in self.links], device=message.device)
        weights[dst, src] = keep
        if self._recording is not None:
            self._recording[key].append(weights)
        return weights

    def _record(self, channel: _Channel, lost: torch.Tensor, in_bad: torch.Tensor) -> None:
        n_packets = lost.shape[-1]
        channel.calls += 1
        channel.sent += n_packets
        if n_packets == 0:
            return
        channel.lost += lost.sum(-1)
        channel.sent_bad += in_bad.sum(-1)
        # Runs of losses, continuing a run left open by the previous call.
        was_open = channel.open_run > 0
        previous = torch.cat([was_open.unsqueeze(-1), lost[:, :-1]], dim=-1)
        starts = lost & ~previous
        channel.bursts += starts.sum(-1)
        closed = was_open & ~lost[:, 0]  # the open run ended with the previous call
        channel.histogram.scatter_add_(1, channel.open_run.clamp(max=self.max_burst).unsqueeze(-1),
                                       closed.long().unsqueeze(-1))
        index = torch.arange(n_packets, device=lost.device)
        run_start = torch.where(starts, index, -1).cummax(-1).values
        length = torch.where(run_start >= 0, index - run_start + 1,
                             index + 1 + channel.open_run.unsqueeze(-1))
        ends = lost & ~torch.cat([lost[:, 1:], torch.ones_like(lost[:, :1])], dim=-1)
        bins = torch.where(ends, length.clamp(max=self.max_burst), 0)
        channel.histogram.scatter_add_(1, bins, ends.long())
        channel.open_run = torch.where(lost[:, -1], length[:, -1], 0)

    def _channel(self, site: str, direction: str, device: torch.device) -> _Channel:
        key = (site, direction)
        channel = self._channels.get(key)
        if channel is None:
            n = len(self.links)
            generator = torch.Generator(device=device)
            generator.manual_seed(stream_seed(self.seed, site, direction))
            zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)  # noqa: E731
            channel = _Channel(generator, None, zeros(n), zeros(n), zeros(n), zeros(n),
                               zeros(n, self.max_burst + 1), zeros(n), zeros(()) - 1)
            self._channels[key] = channel
        elif channel.lost.device != torch.device(device):
            raise RuntimeError(f"site {site!r} moved from {channel.lost.device} to {device}; "
                               "create the network after moving the model")
        return channel

    # -- statistics ------------------------------------------------------------------
    def stats(self) -> list[dict]:
        """One record per (site, direction, link): ready for ``pandas.DataFrame``.

        ``bursts`` counts runs of consecutive losses (a run still open at the
        end counts); ``lost / bursts`` is the observed mean burst length.
        """
        rows = []
        for (site, direction), ch in self._channels.items():
            values = {name: getattr(ch, name).tolist() for name in ("sent", "lost", "sent_bad", "bursts")}
            for i, (src, dst) in enumerate(self.links):
                rows.append({"site": site, "direction": direction, "src": src, "dst": dst,
                             "calls": ch.calls, **{k: v[i] for k, v in values.items()}})
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

    def summary(self, by: Sequence[str] = ("direction",)) -> list[dict]:
        """Totals grouped by any of site/direction/src/dst, with configured and observed rates."""
        totals: dict[tuple, dict] = {}
        for row in self.stats():
            key = tuple(row[k] for k in by)
            acc = totals.setdefault(key, {**dict(zip(by, key)), "sent": 0, "lost": 0,
                                          "sent_bad": 0, "bursts": 0})
            for name in ("sent", "lost", "sent_bad", "bursts"):
                acc[name] += row[name]
        for acc in totals.values():
            lossy = "direction" not in acc or acc["direction"] in self.lossy
            acc["configured_loss_rate"] = self.loss_model.loss_rate if lossy else 0.0
            acc["configured_mean_burst"] = self.loss_model.mean_burst if lossy else 0.0
            acc["observed_loss_rate"] = acc["lost"] / acc["sent"] if acc["sent"] else math.nan
            acc["observed_mean_burst"] = acc["lost"] / acc["bursts"] if acc["bursts"] else 0.0
        return list(totals.values())

    def reset_stats(self) -> None:
        """Zero every counter; chain states and random streams go on."""
        for ch in self._channels.values():
            for name in ch.counters():
                getattr(ch, name).zero_()
            ch.nonfinite_at.fill_(-1)
            ch.calls = 0

    # -- save and restore ----------------------------------------------------------
    def state_dict(self) -> dict:
        channels = {}
        for (site, direction), ch in self._channels.items():
            entry = {name: getattr(ch, name).cpu().clone() for name in ch.counters()}
            entry.update(generator=ch.generator.get_state(), calls=ch.calls,
                         device=str(ch.lost.device),
                         chain=None if ch.chain is None else ch.chain.cpu().clone())
            channels[f"{site}|{direction}"] = entry
        return {"config": self.config(), "channels": channels, "watch_index": self._watch_index}

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
            for name in ch.counters():
                setattr(ch, name, entry[name].to(device))
            ch.calls = entry["calls"]
        self._watch_index = state.get("watch_index", 0)

    def config(self) -> dict:
        return {"tp_size": self.tp_size, "loss_model": self.loss_model.spec, "seed": self.seed,
                "payload_bytes": self.payload_bytes, "recovery": self.recovery,
                "lossy": list(self.lossy), "max_burst": self.max_burst}

    def __repr__(self) -> str:
        return "LossyNetwork(" + ", ".join(f"{k}={v!r}" for k, v in self.config().items()) + ")"
