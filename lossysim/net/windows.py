"""The congestion windows of a network's TCP connections, which outlive every message.

NCCL keeps its connections for the whole job: one per peer (a directed link here) and channel, and its
socket transport opens ``NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD`` sockets per connection, each a
TCP connection with its own window (``NetworkSpec.connections``). A window cut by a loss in one call is
what the next call on that link starts from, whatever call site it comes from (they share the
communicator's connections). Each connection's state is ``timing.congestion``'s ``(w_max, cut, epoch)``;
the network saves it with its chains, and a replayed call (a recomputed forward) leaves it alone, as it
draws nothing.
"""
from __future__ import annotations

import numpy as np
import torch

from ..timing import congestion


class Windows:
    """``[links, connections, 3]`` congestion states, fresh (never cut) until a loss cuts them."""

    def __init__(self, links: int, connections: int):
        self.state = congestion.fresh(links, connections)

    def rows(self, link_ids: np.ndarray) -> np.ndarray:
        """The states of the connections of these links (a copy: the step works on it)."""
        return self.state[link_ids]

    def put(self, link_ids: np.ndarray, state: np.ndarray) -> None:
        """The states after a step on these links (one send per link in a step)."""
        self.state[link_ids] = state

    def state_dict(self) -> torch.Tensor:
        return torch.from_numpy(self.state.copy())

    def load_state_dict(self, state: torch.Tensor) -> None:
        if tuple(state.shape) != self.state.shape:
            raise ValueError(f"saved congestion windows have shape {tuple(state.shape)}, this network's "
                             f"{self.state.shape}")
        self.state = state.cpu().numpy().astype(np.float64, copy=True)
