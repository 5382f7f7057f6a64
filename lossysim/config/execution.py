"""How a process runs, never what it computes: torch's intra-op threads (``threads``) and how many of a
sweep's runs go side by side (``jobs``).

One thread is the default: the runner's models are small, so a step is bound by its kernels' launches,
and torch's own default (a thread per core) spins waiting for cores that another program holds
(benchmarks/bench_sweep.py measures it). A sweep uses the other cores by running more runs at once.
"""
from __future__ import annotations

import os
import sys

DEFAULT_THREADS = 1


def cores() -> int:
    """The cores this process may run on (its affinity, which a Slurm task or ``taskset`` narrows)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):   # no affinity on this platform
        return max(1, os.cpu_count() or 1)


def default_jobs() -> int:
    return cores()


def check_count(name: str, value) -> int:
    """``threads`` and ``jobs``: a whole number >= 1, or a one-line ValueError naming the setting."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a whole number >= 1")
    return value


def set_threads(threads: int) -> int:
    """Set torch's intra-op threads for this process; returns what torch then uses."""
    import torch   # only a process that computes pays for torch
    check_count("threads", threads)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def use_threads(threads: int) -> None:
    """``threads`` for this process and those it starts: OMP_NUM_THREADS, which torch reads when it loads (a
    command that never loads torch pays nothing), and torch's own setting if it is loaded already."""
    check_count("threads", threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:
        set_threads(threads)
