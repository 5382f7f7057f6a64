"""Links under a fabric: a packet between two nodes is lost where any cable on its route loses it.

One call site and direction (``CableChains``, in a ``Channel`` where ``Chains`` is without a fabric) keeps
one loss chain per lossy cable its links cross, created on first use, each from its own stream
``stream_seed(site's seed, cable's name, "cable")``; NVLink links inside a node keep the site's per-link
chains (``Chains``, the site's own stream), as without a fabric. In a call, a cable's chain is stepped once
per packet that crosses it, in time order (packet position first, then the link), so flows that share a
cable share its bursts; flows on other cables never see them. Because every stream is named by the site,
the direction and the cable, any process draws the same fates for the same call whatever else it runs
(sim and dist alike). Under ``drop`` with link events (``cable_events``), every packet of a flow that crosses
a cable down at the call's time is lost too, beside (and without changing) the lossy cables' draws. The price
(docs/fabric.md): a cable's chain is the site's alone, so a burst on one
cable does not carry from one call site's traffic (or one group's network) to another's.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ..util import stream_seed
from .links import Chains


class CableChains:
    """One call site and direction on a fabric: its NVLink links' chains and one chain per lossy cable."""

    def __init__(self, spec, links: list[tuple[int, int]], seed: int, device):
        self.placement, self.links, self.seed = spec.cables, links, seed
        self.nvlink = Chains(spec.loss, len(links), seed, device)
        self.generator = self.nvlink.generator
        self.device = self.generator.device
        topology = spec.topology
        self.intra = {i for i, (s, d) in enumerate(links) if topology.link_class(s, d) == "intra"}
        self.cables: dict[int, Chains] = {}
        self.spec = spec

    def cable(self, cable: int) -> Chains:
        """A lossy cable's chain at this site (its loss model: ``Placement.model``)."""
        chain = self.cables.get(cable)
        if chain is None:
            chain = self.cables[cable] = Chains(self.placement.model(cable), 1,
                                                stream_seed(self.seed, self.placement.name(cable), "cable"),
                                                self.device)
        return chain

    def draw(self, link_ids: torch.Tensor, lossy_rows: Sequence[int], width: int,
             lengths: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, Callable]:
        """``Chains.draw``'s fates, each packet lost on any lossy cable of its route. Without ``lengths``
        (go-back-N), the NVLink chains move past what ``advance(used)`` says went out; a cable's chain
        moves past every packet drawn (exact for memoryless cables)."""
        rows = len(link_ids)
        lost = torch.zeros(rows, width, dtype=torch.bool, device=self.device)
        in_bad = torch.zeros_like(lost)
        if not lossy_rows or not width:
            return lost, in_bad, lambda used: None
        ids = link_ids.tolist()
        on_nvlink = [r for r in lossy_rows if ids[r] in self.intra]
        advance = lambda used: None   # noqa: E731
        if on_nvlink:
            drawn, bad, advance = self.nvlink.draw(link_ids, on_nvlink, width, lengths)
            lost |= drawn
            in_bad |= bad
        sent = [width] * rows if lengths is None else lengths.tolist()
        for row, position, hit, bad in self._cables(ids, lossy_rows, width, sent):
            row, position = torch.from_numpy(row).to(self.device), torch.from_numpy(position).to(self.device)
            lost[row[hit], position[hit]] = True
            in_bad[row[bad], position[bad]] = True
        return lost, in_bad, advance

    def _cables(self, ids: list, rows: Sequence[int], width: int, sent: Sequence[int]):
        """Per lossy cable the rows' packets cross: their (row, position) in time order (the links send side
        by side) and which of them its chain loses (and finds in its bad state)."""
        crossing: dict[int, list] = {}
        for r in rows:
            if ids[r] in self.intra:
                continue
            src, dst = self.links[ids[r]]
            for cable, modulus, residue in self.placement.lossy(src, dst):
                position = np.arange(residue, min(int(sent[r]), width), modulus)
                if len(position):
                    crossing.setdefault(cable, []).append((r, position))
        for cable in sorted(crossing):
            parts = crossing[cable]
            row = np.concatenate([np.full(len(p), r) for r, p in parts])
            position = np.concatenate([p for _, p in parts])
            order = np.lexsort((row, position))
            n = len(order)
            drawn, bad, _ = self.cable(cable).draw(torch.zeros(1, dtype=torch.long, device=self.device), [0], n,
                                                   torch.tensor([n], device=self.device))
            yield row[order], position[order], drawn[0].cpu(), bad[0].cpu()
        outage = self._down(ids, rows, width, sent)
        if outage is not None:
            yield outage

    def _down(self, ids: list, rows: Sequence[int], width: int, sent: Sequence[int]):
        """The rows' packets on flows that cross a cable down now (link events under ``drop``), all lost and
        none in a bad state (drawn from no stream); None without such a cable."""
        from . import cable_events
        down = cable_events.ACTIVE.down(self.spec) if cable_events.ACTIVE is not None else ()
        if not down:
            return None
        parts = []
        for r in rows:
            if ids[r] in self.intra:
                continue
            src, dst = self.links[ids[r]]
            for cables, modulus, residue in self.placement.paths(src, dst):
                if any(c in down for c in cables):
                    parts.append((r, np.arange(residue, min(int(sent[r]), width), modulus)))
        parts = [(r, p) for r, p in parts if len(p)]
        if not parts:
            return None
        row = np.concatenate([np.full(len(p), r) for r, p in parts])
        position = np.concatenate([p for _, p in parts])
        return row, position, torch.ones(len(row), dtype=torch.bool), torch.zeros(len(row), dtype=torch.bool)

    def lost_positions(self, link_ids: torch.Tensor, lossy: Optional[np.ndarray], width: int,
                       used: np.ndarray) -> np.ndarray:
        """``sparse.lost_positions``'s sorted flat indices ``row * width + column``: the same draws as
        ``draw`` with ``lengths=used`` (memoryless cables), the NVLink links' as without a fabric."""
        from .sparse import lost_positions
        ids = link_ids.tolist()
        rows = range(len(ids)) if lossy is None else lossy.tolist()
        on_nvlink = np.array([r for r in rows if ids[r] in self.intra], dtype=np.int64)
        flats = [lost_positions(self.nvlink.model, self.nvlink, link_ids, on_nvlink, width, used)] \
            if len(on_nvlink) else []
        for row, position, hit, _ in self._cables(ids, rows, width, used):
            hit = hit.numpy()
            flats.append(row[hit] * width + position[hit])
        return np.unique(np.concatenate(flats)) if flats else np.zeros(0, dtype=np.int64)

    def state_dict(self) -> dict:
        return {**self.nvlink.state_dict(),
                "cables": {self.placement.name(c): chain.state_dict() for c, chain in sorted(self.cables.items())}}

    def load_state_dict(self, state: dict) -> None:
        self.nvlink.load_state_dict(state)
        self.cables = {}
        for name, saved in (state.get("cables") or {}).items():
            self.cable(self.placement.fabric.cable(name)).load_state_dict(saved)
