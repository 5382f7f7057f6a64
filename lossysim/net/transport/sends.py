"""What a step hands a repair rule and gets back: its sends (``Sends``, on the host ``HostSends``), the
draws that give each round's fates (``Draw`` as masks, ``PositionsDraw`` and ``Count`` as positions),
and its ``Result``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

# draw(lengths, known=True) -> (lost [n, max(lengths)], commit(used)): the next transmissions on
# each link; commit says how many were really sent (counters, and the chains when not known).
Draw = Callable[..., tuple]
# draw(to_send, width) -> lost: the next ``width`` transmissions on each link as the sorted flat positions
# ``row * width + column`` of the lost ones (numpy; the fates past ``to_send[row]`` included); then
# count(row, column, to_send) is given those that went out, to be counted.
PositionsDraw = Callable[[np.ndarray, int], np.ndarray]
Count = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


@dataclass
class Sends:
    """One step's sends as the transport sees them (per send unless said otherwise)."""
    packets: torch.Tensor        # packets of the message
    tau: torch.Tensor            # wire seconds of one packet on the link
    rtt: torch.Tensor            # round trip, seconds: what a NAK costs
    window: torch.Tensor         # packets in flight during a round trip (go-back-N's waste)
    final: torch.Tensor          # the link's last step in the collective: its tail losses wait for timers
    tails: torch.Tensor          # [sends, max packets] positions whose loss nothing behind reveals (round 0)
    tail_resends: torch.Tensor   # in later rounds, how many last resends are tails (final sends)
    connections: int = 1         # TCP: connections a send is spread over, each a contiguous share of it
    _host: Optional["HostSends"] = field(default=None, repr=False, compare=False)

    def host(self) -> "HostSends":
        """What selective repeat reads, as numpy arrays (copied once: a step lives as long as its network)."""
        if self._host is None:
            final = self.final.cpu().numpy()
            packets = self.packets.cpu().numpy().astype(np.int64)
            self._host = HostSends(packets, int(packets.max()) if len(packets) else 0, self.tau.cpu().numpy(),
                                   self.rtt.cpu().numpy(), final, self.tails.cpu().numpy() if final.any() else None,
                                   bool(final.any()), self.tail_resends.cpu().numpy().astype(np.int64),
                                   self.connections)
        return self._host


@dataclass
class HostSends:
    """``Sends`` as selective repeat reads them: numpy, on the host."""
    packets: np.ndarray
    width: int                  # the most packets of a send
    tau: np.ndarray
    rtt: np.ndarray
    final: np.ndarray
    tails: Optional[np.ndarray]  # [sends, width] bool: round 0's tail positions (None: no final send)
    any_final: bool             # some send is its link's last in the collective
    tail_resends: np.ndarray
    connections: int = 1
    # what a transport works out once from these sends and reads at every step that has them (a run's
    # steps repeat a few hundred sends thousands of times), keyed by the transport's own key
    cache: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class Result:
    """One step through the transport (per send unless said otherwise)."""
    missing_row: np.ndarray     # sends and packet indices never delivered (sorted; failed sends left out)
    missing_packet: np.ndarray
    transmissions: np.ndarray   # packets put on the wire, resends included
    extra: float                # the step's time beyond loss-free: its slowest send's repairs
    shadow: float               # the same under the ideal preset (every wait one round trip)
    timeouts: np.ndarray        # waits on a timer
    failed: np.ndarray          # gave up after the preset's retries (retransmit only)
    windows: Optional[np.ndarray] = None  # TCP: [sends, connections, 3] congestion states after the step


def slowest(seconds) -> float:
    """The largest of a step's per-send seconds (numpy or torch; small: Python's max over tolist() is the
    cheapest reduction)."""
    return max(seconds.tolist()) if len(seconds) else 0.0
