"""Links: where a packet is dropped. One loss chain per directed link, seeded per call site.

Each collective call site (a name such as ``h.3.attn.reduce``) and direction (``fwd``
activations, ``bwd`` gradients) owns a random stream seeded from (seed, site, direction), so the
masks a site draws depend neither on call order elsewhere nor on whether one process simulates
every rank or each rank runs in its own process: every process draws every link's packets and
keeps what its receivers hold. Each link's chain is stepped once per packet put on that link, in
the order the link sends them, and its state carries over to the site's next call.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..loss import LossModel


class Chains:
    """One call site and direction: its random stream and the loss chain of every directed link."""

    def __init__(self, model: LossModel, links: int, seed: int, device):
        self.model = model
        self.links = links
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.state: Optional[torch.Tensor] = None   # [links] state the next packet arrives in (None: memoryless)
        self.started = False                          # chains drawn from the stationary distribution

    def draw(self, link_ids: torch.Tensor, lossy_rows: Sequence[int], width: int,
             lengths: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, Callable]:
        """The fates of the next ``width`` packets of each link in ``link_ids``.

        Only the rows in ``lossy_rows`` draw (the other links lose nothing). With ``lengths``, exactly
        ``lengths[row]`` packets go out on each link and the chains move past them; without, call the
        returned ``advance(used)`` once the transport knows how many it sent (go-back-N).
        Returns ``(lost, in_bad, advance)``, masks ``[rows, width]``.
        """
        device = self.generator.device
        rows = len(link_ids)
        every = len(lossy_rows) == rows
        if not lossy_rows:
            nothing = torch.zeros(rows, width, dtype=torch.bool, device=device)
            return nothing, nothing, lambda used: None
        if not self.started:  # every link's chain starts from the stationary distribution
            _, _, self.state = self.model.sample_with_states((self.links, 0), self.generator, None)
            self.started = True
        ids = link_ids if every else link_ids[list(lossy_rows)]
        state = None if self.state is None else self.state[ids]
        sent = None if lengths is None else (lengths if every else lengths[list(lossy_rows)])
        drawn, bad, after = self.model.sample_with_states((len(ids), width), self.generator, state, used=sent)
        if every:
            lost, in_bad = drawn, bad
        else:
            lost = torch.zeros(rows, width, dtype=torch.bool, device=device)
            in_bad = torch.zeros_like(lost)
            lost[list(lossy_rows)], in_bad[list(lossy_rows)] = drawn, bad

        def advance(used: torch.Tensor) -> None:
            if self.state is None:
                return
            moved = self.state.clone()
            moved[ids] = self.model.state_after(bad, after, used.to(device) if every
                                                else used.to(device)[list(lossy_rows)])
            self.state = moved

        if lengths is not None and self.state is not None:
            moved = self.state.clone()
            moved[ids] = after
            self.state = moved
        return lost, in_bad, advance

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "started": self.started,
                "chain": None if self.state is None else self.state.cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.started = state["started"]
        chain = state["chain"]
        self.state = None if chain is None else chain.to(self.generator.device)
