"""Reading a PyTorch profiler trace (``torch.profiler``'s Chrome/Kineto JSON): a job's communication calls,
its steps and when each rank computed, as ``estimate.trace_replay`` replays them (docs/estimate.md, "Estimate
your own job").

One trace per rank (``export_chrome_trace``; ``.json`` or ``.json.gz``): a folder of them, or one file
whose peers mirror it. ``distributedInfo`` gives the rank, the world, the backend and the process groups
(``pg_config``). A call is read from either form c10d writes:

- NCCL (and every backend that records it): a ``record_param_comms`` CPU event with "Collective name",
  "In msg nelems", "Out msg nelems", "dtype", "Process Group Name" and, for a send or a receive, "Dst Rank"
  or "Src Rank" (global); where the GPU's NCCL kernel carries the same fields, it is the call's execution.
- gloo (CPU): a ``c10d::<op>`` CPU event (its issue, its sizes in "Input Dims") and the ``gloo:<op>``
  annotation the gloo thread records while it runs (its execution and dtype). gloo names no process group:
  a gloo trace with more than one is refused.

Plain ``json`` (and ``gzip``) read it: HolisticTraceAnalysis parses with the same ``json.loads`` and then
builds DataFrames this needs none of, and it would bring jupyterlab, plotly, networkx and pytest with it.
Nothing here imports torch: a message is its element count and dtype name.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# the calls and their limits live in trace_calls, a rank's file in trace_events: importers read them here
from .trace_calls import DTYPES, GLOO_RUNS, KINDS, MAX_CALL_BYTES, Call  # noqa: F401
from .trace_checks import one_job
from .trace_events import RankTrace, load, rank_trace  # noqa: F401


@dataclass
class Trace:
    """Every rank's trace (``mirrored``: one file whose peers ran the same)."""
    ranks: dict                  # rank -> RankTrace
    world: int
    backend: str
    groups: dict
    mirrored: bool

    @property
    def steps(self) -> int:
        return min(len(r.steps) for r in self.ranks.values())

    @property
    def unknown(self) -> Counter:
        out = Counter()
        for r in self.ranks.values():
            out.update(r.unknown)
        return out


def read(path) -> Trace:
    """The trace(s) at ``path``: a folder of one trace per rank, or one file (its peers mirror it).
    A file that is not a torch.distributed profiler trace, a rank twice or a rank missing: one-line
    ValueError."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith((".json", ".json.gz"))
                       and p.name != "job.json")
        if not files:
            raise ValueError(f"--trace {path}: no .json or .json.gz traces in this folder")
    elif path.is_file():
        files = [path]
    else:
        raise ValueError(f"--trace {path}: no such file or folder")
    ranks = {}
    for file in files:
        rank = rank_trace(file, load(file))
        if rank.rank in ranks:
            raise ValueError(f"{file}: rank {rank.rank} again (also {ranks[rank.rank].path}): one trace per rank")
        ranks[rank.rank] = rank
    mirrored = one_job(path, ranks)
    first = next(iter(ranks.values()))
    return Trace(ranks, first.world, first.backend, first.groups, mirrored)



def describe(trace: Trace) -> dict:
    """What was read, for the terminal and ``trace_read.json``: ranks, steps, process groups, calls and
    bytes per collective per step (the first rank's), and every communication event not understood."""
    first = trace.ranks[min(trace.ranks)]
    steps = trace.steps
    per: dict = {}
    for step in first.calls[:steps]:
        for call in step:
            row = per.setdefault((call.group, call.kind), {"calls": 0, "bytes": 0})
            row["calls"] += 1 / steps
            row["bytes"] += call.bytes / steps
    return {
        "ranks_traced": sorted(trace.ranks), "world": trace.world, "backend": trace.backend,
        "mirrored": trace.mirrored, "steps": steps,
        "process_groups": {name: list(ranks) for name, ranks in trace.groups.items()},
        "calls_per_step": [{"process_group": g, "collective": k, **v} for (g, k), v in sorted(per.items())],
        "not_understood": dict(sorted(trace.unknown.items())),
    }
