"""Activation checkpointing's recording and replay: a recomputed forward sends again what the first
forward sent, so each call's outcome (its delivery, loss-free seconds, repairs and policy compute) is
recorded in call order per (site, direction) and replayed: the same masks, nothing drawn or counted,
the time charged again (the recomputed all-reduces do run again)."""
from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

from ..util import swapped


class Outcome(NamedTuple):
    delivery: object              # what the receivers held (None: the exact result)
    ideal: float                  # the call's loss-free seconds
    repairs: object               # its repairs' seconds (configured nic, ideal nic), or None
    recovered: float              # the recovery policy's compute


class Replay:
    """What a network records (``recording``) or replays (``replaying``); ``also``: the replays swapped
    with it (a policy's side path)."""

    def __init__(self, also: tuple = ()):
        self.recording: Optional[dict] = None
        self.replaying: Optional[dict] = None
        self.also = also

    @contextlib.contextmanager
    def swapped(self, name: str, record: dict):
        with contextlib.ExitStack() as stack:
            for replay in (self, *self.also):
                stack.enter_context(swapped(replay, name, record))
            yield record

    def next(self, key: tuple) -> Outcome:
        return self.replaying[key].popleft()

    def keep(self, key: tuple, outcome: Outcome) -> None:
        if self.recording is not None:
            self.recording[key].append(outcome)
