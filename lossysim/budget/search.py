"""Where a family's loss stops being harmless: a log grid scanned upward until the first rate whose
eval perplexity, paired with the loss-free run of the same seed, may exceed it by more than
``TOLERANCE_PCT`` (the 95% Student-t interval's upper end over seeds), then bisected in log space
between the last rate that passed and that first failure.

The budget is the last rate that passed. A grid whose lowest rate already fails, or whose highest
still passes, does not bracket the crossing: the budget says so (``bracketed`` False, ``below`` or
``above``) rather than printing the grid's end as if it were measured.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Generator, Optional, Sequence

GRID = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1)   # 0.01% .. 30%
TOLERANCE_PCT = 1.0
MIN_PAIRS = 3


@dataclass(frozen=True)
class Point:
    rate: float
    change_pct: float       # mean paired eval-perplexity change, percent
    half_width: float       # its 95% interval's half-width
    pairs: int

    @property
    def upper(self) -> float:
        return self.change_pct + self.half_width

    @property
    def passes(self) -> bool:
        return self.pairs >= MIN_PAIRS and math.isfinite(self.upper) and self.upper <= TOLERANCE_PCT


@dataclass(frozen=True)
class Budget:
    rate: Optional[float]       # the largest rate that passed (None: even the grid's lowest failed)
    failed_at: Optional[float]  # the smallest rate that failed (None: none did)
    points: tuple[Point, ...]

    @property
    def bracketed(self) -> bool:
        return self.rate is not None and self.failed_at is not None

    def describe(self) -> str:
        if self.rate is None:
            return f"< {100 * self.failed_at:.3g}% (fails at the grid's lowest rate)"
        if self.failed_at is None:
            return f">= {100 * self.rate:.3g}% (passes at the grid's highest rate)"
        return f"{100 * self.rate:.3g}% (fails at {100 * self.failed_at:.3g}%)"


def search(grid: Sequence[float] = GRID, refine: int = 2) -> Generator[float, Point, Budget]:
    """The search as a coroutine: it yields the next rate to measure, is sent that rate's ``Point`` and
    returns the ``Budget`` (``StopIteration.value``). Scans ``grid`` from its lowest rate up until a rate fails, then
    ``refine`` bisections (geometric means) between the last pass and the first failure. Several searches
    can so be advanced side by side, their runs trained together (``budget/command.py``)."""
    rates = sorted({float(r) for r in grid})
    if not rates or rates[0] <= 0 or rates[-1] >= 1:
        raise ValueError(f"a budget's grid needs rates in (0, 1), got {list(grid)}")
    if isinstance(refine, bool) or int(refine) != refine or refine < 0:
        raise ValueError(f"a budget's refine is a count of bisections, >= 0, got {refine!r}")
    return _search(rates, int(refine))


def _search(rates: list[float], refine: int) -> Generator[float, Point, Budget]:
    points: list[Point] = []
    passed, failed = None, None
    for rate in rates:
        point = yield rate
        points.append(point)
        if not point.passes:
            failed = rate
            break
        passed = rate
    if passed is not None and failed is not None:
        for _ in range(refine):
            mid = math.sqrt(passed * failed)
            point = yield mid
            points.append(point)
            passed, failed = (mid, failed) if point.passes else (passed, mid)
    return Budget(passed, failed, tuple(sorted(points, key=lambda p: p.rate)))


def find_budget(measure: Callable[[float], Point], grid: Sequence[float] = GRID, refine: int = 2) -> Budget:
    """``search`` driven by ``measure``, one rate at a time."""
    steps = search(grid, refine)
    try:
        rate = next(steps)
        while True:
            rate = steps.send(measure(rate))
    except StopIteration as done:
        return done.value
