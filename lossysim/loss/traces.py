"""Measured loss traces: reading them, their runs, and replaying one per link (``trace:PATH``)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from .models import LossModel
from .sampling import _flat_chains, _shape, _zeros


def load_trace(path: Union[str, Path]) -> np.ndarray:
    """A per-packet loss indicator (bool array) from a trace file.

    ``.npy``: an array of bools (or 0/1). ``.runs`` (text): run lengths that
    alternate delivered, lost, delivered, ... starting with delivered (0 allowed).
    Any other file: text of 0/1 per packet, separated by whitespace or commas or not
    at all; lines starting with # are comments.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file {str(path)!r} does not exist")
    if path.suffix == ".npy":
        try:   # never unpickled: numpy's own message would suggest allow_pickle, which runs the file's code
            values = np.load(path, allow_pickle=False).ravel()
        except (ValueError, OSError, EOFError):
            raise ValueError(f"trace {str(path)!r} is not a valid .npy trace: save an array of bools or 0/1 "
                             "with numpy.save") from None
        if values.dtype != np.bool_ and not np.isin(values, (0, 1)).all():
            raise ValueError(f"trace {str(path)!r}: a .npy trace holds bools or 0/1")
        return _nonempty(values.astype(bool), path)
    try:
        text = path.read_text()
    except UnicodeDecodeError as err:
        raise ValueError(f"trace {str(path)!r} is not a text trace (byte {err.object[err.start]:#04x} at offset "
                         f"{err.start}): write 0/1 per packet as text, run lengths as .runs, or a .npy array") from None
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    tokens = text.replace(",", " ").split()
    if path.suffix == ".runs":
        try:
            runs = np.array([int(t) for t in tokens], dtype=np.int64)
        except ValueError:
            raise ValueError(f"trace {str(path)!r}: run lengths must be integers") from None
        if (runs < 0).any():
            raise ValueError(f"trace {str(path)!r}: negative run length {int(runs[runs < 0][0])}")
        return _nonempty(np.repeat(np.arange(runs.size) % 2 == 1, runs), path)
    digits = "".join(tokens)
    if digits.strip("01"):
        bad = next(c for c in digits if c not in "01")
        raise ValueError(f"trace {str(path)!r}: expected 0/1 per packet, found {bad!r}")
    return _nonempty(np.frombuffer(digits.encode(), dtype=np.uint8) == ord("1"), path)


def _nonempty(lost: np.ndarray, path: Path) -> np.ndarray:
    if lost.size == 0:
        raise ValueError(f"trace {str(path)!r} holds no packets")
    return lost


def trace_runs(lost: np.ndarray, circular: bool = False):
    """(burst lengths, gap lengths) of a loss indicator; ``circular`` joins the ends."""
    lost = np.asarray(lost, dtype=bool)
    if circular and lost.size and lost.any() and not lost.all():
        first = int(np.argmax(lost != lost[-1]))
        lost = np.roll(lost, -first)   # start at a change, so no run wraps around
    edges = np.flatnonzero(np.diff(lost.astype(np.int8))) + 1
    bounds = np.concatenate([[0], edges, [lost.size]])
    lengths = np.diff(bounds)
    values = lost[bounds[:-1]] if lost.size else np.zeros(0, dtype=bool)
    return lengths[values], lengths[~values]


class Trace(LossModel):
    """Replays a measured per-packet loss trace (``trace:PATH``).

    Each chain replays the trace from its own offset (drawn from the generator
    for a fresh chain) and wraps around; the state is the offset of the next
    packet. ``loss_rate`` and ``mean_burst`` are the trace's own (runs counted
    around the wrap). A trace has no hidden state, so ``in_bad`` is all False.
    """

    def __init__(self, path: str, lost: Optional[np.ndarray] = None):
        self.path = str(path)
        self.lost = load_trace(self.path) if lost is None else np.asarray(lost, dtype=bool)
        if self.lost.size == 0:
            raise ValueError(f"trace {self.path!r} is empty")
        self.spec = f"trace:{self.path}"
        self._tensors = {}
        bursts, _ = trace_runs(self.lost, circular=True)
        self._rate = float(self.lost.mean())
        self._burst = float(bursts.mean()) if bursts.size else (math.inf if self.lost.all() else 0.0)

    @property
    def loss_rate(self) -> float:
        return self._rate

    @property
    def mean_burst(self) -> float:
        return self._burst

    @property
    def variance_per_packet(self) -> float:
        # Bartlett-weighted sum of the trace's circular autocovariance up to a quarter of its length.
        x = self.lost.astype(np.float64) - self._rate
        spectrum = np.abs(np.fft.rfft(x)) ** 2
        acov = np.fft.irfft(spectrum, n=x.size) / x.size
        lags = max(1, x.size // 4)
        weights = 1.0 - np.arange(1, lags) / lags
        return float(max(acov[0] + 2.0 * (weights * acov[1:lags]).sum(), 0.0))

    def _on(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._tensors:
            self._tensors[key] = torch.from_numpy(self.lost.copy()).to(device)
        return self._tensors[key]

    rewindable = True

    def state_after(self, in_bad, next_state, used):
        return (next_state - in_bad.shape[-1] + used.to(next_state.device)) % self.lost.size

    def sample_with_states(self, n, generator, state=None, used=None):
        shape = _shape(n)
        device = generator.device
        chains, packets, state, used = _flat_chains(shape, state, used, device)
        size = self.lost.size
        if state is None:
            state = torch.randint(0, size, (chains,), generator=generator, device=device)
        state = state.to(torch.int64)
        index = (state.unsqueeze(-1) + torch.arange(packets, device=device)) % size
        lost = self._on(device)[index]
        next_state = (state + used) % size
        return lost.view(shape), _zeros(chains * packets, device).view(shape), next_state.view(shape[:-1])
