"""A network's call sites: for each (site, direction), its links' loss chains, its counters, its
non-finite watch and what the recovery policy keeps there (a ``Channel``), and the statistics read off
all of them (``Channels``): packets per link and phase, runs of losses, the first non-finite delivery.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from . import recovery as recoveries
from .algorithms import PHASES
from .cables import CableChains
from .links import Chains
from .stats import COUNTERS, Counters, NonFinite
from ..util import stream_seed


@dataclass
class Channel:
    """One call site and direction: its link chains, its counters, its non-finite watch and what the
    recovery policy keeps there."""
    chains: Chains                 # (CableChains under a fabric)
    counters: Counters
    watch: NonFinite = field(default_factory=NonFinite)
    memory: Optional[recoveries.Memory] = None


class Channels:
    """Every call site and direction a network has carried, created on first use on the tensors' device."""

    def __init__(self, spec, links: list[tuple[int, int]]):
        self.spec, self.links = spec, links
        self.by_key: dict[tuple[str, str], Channel] = {}
        self.watched = 0                     # calls watched so far: orders the first non-finite one

    def get(self, site: str, direction: str, device) -> Channel:
        """The channel of ``site`` and ``direction``, on ``device`` (created there on first use)."""
        key = (site, direction)
        channel = self.by_key.get(key)
        if channel is None:
            spec = self.spec
            seed = stream_seed(spec.seed, site, direction)
            chains = Chains(spec.loss, len(self.links), seed, device) if spec.cables is None else \
                CableChains(spec, self.links, seed, device)
            channel = self.by_key[key] = Channel(chains, Counters(len(self.links), spec.max_burst, device))
            if spec.recovery_model.keeps_memory:
                channel.memory = recoveries.Memory(spec.seed, site, direction, device)
        elif channel.counters.device != torch.device(device):
            raise RuntimeError(f"site {site!r} moved from {channel.counters.device} to {device}; "
                               "create the network after moving the model")
        return channel

    def watch(self, site: str, direction: str, delivered: torch.Tensor) -> None:
        """Remember (on the device, no sync) whether this call's delivered tensor is finite."""
        self.watched += 1
        self.get(site, direction, delivered.device).watch.see(self.watched, delivered)

    def first_nonfinite(self) -> Optional[dict]:
        """The site and direction whose delivered data first became non-finite, if any (syncs)."""
        seen = [(ch.watch.settle(), site, direction) for (site, direction), ch in self.by_key.items()]
        seen = [s for s in seen if s[0] >= 0]
        if not seen:
            return None
        _, site, direction = min(seen)
        return {"site": site, "direction": direction}

    def rows(self, link_class) -> list[dict]:
        """One record per (site, direction, phase, link) that carried traffic (``LossyNetwork.stats``)."""
        rows = []
        for (site, direction), ch in self.by_key.items():
            ch.counters.flush()
            counts = ch.counters.counts.tolist()
            for p, phase in enumerate(PHASES):
                for i, (src, dst) in enumerate(self.links):
                    values = {name: counts[c][p][i] for c, name in enumerate(COUNTERS)}
                    if values["sent"] == 0:
                        continue
                    rows.append({"site": site, "direction": direction, "phase": phase, "src": src, "dst": dst,
                                 "link_class": link_class(src, dst), "calls": ch.counters.calls, **values})
        return rows

    def histogram(self) -> list[dict]:
        """Records (site, direction, src, dst, length, count) of loss runs, open runs included."""
        rows = []
        for (site, direction), ch in self.by_key.items():
            hist = ch.counters.closed_histogram()
            for i, (src, dst) in enumerate(self.links):
                for length, count in enumerate(hist[i].tolist()):
                    if length and count:
                        rows.append({"site": site, "direction": direction, "src": src, "dst": dst,
                                     "length": length, "count": count})
        return rows

    def totals(self) -> dict:
        """Every counter summed over call sites, directions, phases and links (syncs)."""
        sums = torch.zeros(len(COUNTERS), dtype=torch.long)
        for ch in self.by_key.values():
            ch.counters.flush()
            sums += ch.counters.counts.sum((1, 2)).cpu()
        return dict(zip(COUNTERS, sums.tolist()))

    def reset(self) -> None:
        """Zero every counter and watch; chain states, random streams and what policies keep go on."""
        for ch in self.by_key.values():
            ch.counters.reset()
            ch.watch = NonFinite()

    def state_dict(self) -> dict:
        """Each channel's chains, counters, watch and policy memory, keyed ``site|direction``."""
        channels = {}
        for (site, direction), ch in self.by_key.items():
            counters, chains = ch.counters.state_dict(), ch.chains.state_dict()
            channels[f"{site}|{direction}"] = {
                "counts": counters["counts"], "histogram": counters["histogram"], "open_run": counters["open_run"],
                "nonfinite_at": torch.tensor(ch.watch.settle()), "generator": chains["generator"],
                "calls": counters["calls"], "started": chains["started"], "device": str(ch.counters.device),
                "chain": chains["chain"], "recovery": None if ch.memory is None else ch.memory.state_dict(),
                **({"cables": chains["cables"]} if "cables" in chains else {})}
        return channels

    def load_state_dict(self, channels: dict) -> None:
        self.by_key = {}
        for key, entry in channels.items():
            site, direction = key.rsplit("|", 1)
            counts = entry["counts"]
            if counts.shape[1] < len(PHASES):   # saved before sends had a phase: they had sent nothing
                grown = counts.new_zeros(counts.shape[0], len(PHASES), counts.shape[2])
                grown[:, :counts.shape[1]] = counts
                entry = {**entry, "counts": grown}
            ch = self.get(site, direction, torch.device(entry["device"]))
            ch.chains.load_state_dict(entry)
            ch.counters.load_state_dict(entry)
            ch.watch = NonFinite(int(entry["nonfinite_at"]))
            if ch.memory is not None and entry.get("recovery") is not None:
                ch.memory.load_state_dict(entry["recovery"])

    @property
    def device(self):
        """The device of the first channel (cpu when there is none)."""
        return next(iter(self.by_key.values())).counters.device if self.by_key else "cpu"
