"""The front door: which transport (``Transport``: drop, retransmit or deadline; selective repeat or
go-back-N; checked once) and ``run_step``, which carries a step's sends through the rule its NIC repairs by."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ...timing.retransmission import Nic
from .gobackn import go_back_n
from .selective import selective
from .sends import Count, Draw, PositionsDraw, Result, Sends

TRANSPORTS = ("drop", "retransmit", "deadline")
MODES = ("selective", "go_back_n")


@dataclass(frozen=True)
class Transport:
    kind: str = "drop"           # drop | retransmit | deadline
    mode: str = "selective"      # selective | go_back_n (retransmit and deadline)
    deadline: float = 1.5        # deadline: a collective's budget as a multiple of its loss-free time

    def __post_init__(self):
        if self.kind not in TRANSPORTS:
            raise ValueError(f"transport={self.kind!r} must be one of {', '.join(TRANSPORTS)}")
        if self.mode not in MODES:
            raise ValueError(f"retransmit={self.mode!r} must be one of {', '.join(MODES)}")
        if not self.deadline >= 1.0:
            raise ValueError(f"deadline={self.deadline} must be >= 1 (a multiple of the loss-free time)")
        if self.kind == "deadline" and self.mode == "go_back_n":
            raise ValueError("go-back-N (retransmit=go_back_n, nic=roce-gbn) with transport=deadline is not supported: "
                             "at the deadline a go-back-N receiver holds only the packets before the first gap; use a "
                             "selective repeat nic")

    @property
    def repairs(self) -> bool:
        """Whether lost packets are sent again."""
        return self.kind != "drop"

    @property
    def exact(self) -> bool:
        """Whether tensors always arrive exact (only time is lost)."""
        return self.kind == "retransmit"


def run_step(transport: Transport, nic: Nic, sends: Sends, draw: Draw, budget: float,
             windows: Optional[np.ndarray] = None) -> Result:
    """Carry one step's sends (each on its own link) through the transport, their fates drawn as masks;
    ``budget``: the seconds the step's repairs may take (``deadline`` only); ``windows``: TCP's congestion
    states of the sends' connections before the step (None: never cut)."""
    if nic.mode == "selective":
        return selective(nic, sends.host(), *_as_positions(draw, sends.packets.device), budget,
                         give_up=transport.kind == "deadline", windows=windows)
    return go_back_n(nic, sends, draw)


def _as_positions(draw: Draw, device: torch.device) -> tuple[PositionsDraw, Count]:
    """A mask draw as selective repeat takes it: each round's mask is counted whole on its device, and only
    the positions of its losses come to the host (one ``nonzero``, a host sync, per round: the rounds go on
    while something is pending, which the host must know anyway)."""
    drawn = []   # the round's (lengths, commit)

    def positions(to_send: np.ndarray, width: int) -> np.ndarray:
        lengths = torch.tensor(to_send, device=device)   # a copy: the counters keep it until they flush
        lost, commit = draw(lengths)
        drawn[:] = lengths, commit
        return lost.flatten().nonzero().squeeze(1).cpu().numpy()

    def count(row: np.ndarray, column: np.ndarray, to_send: np.ndarray) -> None:
        lengths, commit = drawn
        commit(lengths)
    return positions, count
