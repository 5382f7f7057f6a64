"""One rank's trace file read (``estimate.trace``): its JSON (gzip or plain), its distributedInfo and
process groups, its steps, its calls per step and when its compute stream was busy."""
from __future__ import annotations

import bisect
import gzip
import json
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .trace_calls import gloo_calls, nccl_calls


@dataclass
class RankTrace:
    """One rank's trace: its calls per step, when its compute stream was busy, what was not understood."""
    path: str
    rank: int
    world: int
    backend: str
    groups: dict                 # process group name -> its global ranks
    steps: list                  # [(start, end)] in microseconds
    calls: list                  # per step: [Call] in issue order
    busy: list                   # per step: [(start, end)] of the compute stream's top-level work
    unknown: Counter = field(default_factory=Counter)   # event name -> count: communication not understood



def load(file: Path) -> dict:
    """The JSON of a trace file (gzip or plain); a truncated or foreign file: one-line ValueError."""
    try:
        raw = file.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        data = json.loads(raw)
    except (EOFError, OSError, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as err:
        what = "truncated" if isinstance(err, EOFError) or "Expecting" in str(err) or "Unterminated" in str(err) \
            else "unreadable"
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{file}: not a profiler trace ({what}: {reason})") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{file}: not a PyTorch profiler trace (no traceEvents list): write one with "
                         "torch.profiler's export_chrome_trace")
    info = data.get("distributedInfo")
    if not isinstance(info, dict) or "rank" not in info or "world_size" not in info:
        raise ValueError(f"{file}: the trace has no distributedInfo (rank, world_size): profile a job started "
                         "with torch.distributed")
    return data


def _groups(file: Path, info: dict) -> dict:
    world = int(info["world_size"])
    groups = {}
    for pg in info.get("pg_config") or []:
        ranks = pg.get("ranks")
        if isinstance(ranks, dict):     # some versions write {global rank: group rank}
            ranks = sorted(ranks, key=lambda r: ranks[r])
        groups[str(pg.get("pg_name"))] = tuple(int(r) for r in (ranks or []))
    if not groups:
        groups["0"] = tuple(range(world))
    for name, ranks in groups.items():
        if not ranks or any(not 0 <= r < world for r in ranks):
            raise ValueError(f"{file}: process group {name} has ranks {list(ranks)} outside the world of {world}")
    return groups


def rank_trace(file: Path, data: dict) -> RankTrace:
    info = data["distributedInfo"]
    try:
        rank, world = int(info["rank"]), int(info["world_size"])
    except (TypeError, ValueError):
        raise ValueError(f"{file}: distributedInfo's rank {info.get('rank')!r} / world_size "
                         f"{info.get('world_size')!r} are not integers") from None
    if not 0 <= rank < world:
        raise ValueError(f"{file}: rank {rank} outside world_size {world}")
    backend = str(info.get("backend", ""))
    groups = _groups(file, info)
    events = [e for e in data["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"
              and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("name"), str)]
    for e in events:
        e.setdefault("dur", 0.0)
        if not isinstance(e.get("args"), dict):
            e["args"] = {}
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    main = steps[0]["tid"] if steps else _main_thread(events)
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in steps] or \
        [(min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events))] if events else []
    unknown: Counter = Counter()
    if any(e["name"] == "record_param_comms" for e in events):
        calls = nccl_calls(file, rank, groups, events, unknown)
    else:
        calls = gloo_calls(file, rank, groups, events, main, unknown)
    calls.sort(key=lambda c: c.issue)
    busy = _busy(events, main)
    per_step, busy_step = [[] for _ in spans], [[] for _ in spans]
    starts = [s for s, _ in spans]
    for call in calls:
        i = bisect.bisect_right(starts, call.issue) - 1
        if i < 0 or call.issue > spans[i][1]:
            unknown[f"{call.name} (outside the profiled steps)"] += 1
            continue
        per_step[i].append(call)
    for s, e in busy:
        i = bisect.bisect_right(starts, s) - 1
        if 0 <= i and s < spans[i][1]:
            busy_step[i].append((s, min(e, spans[i][1])))
    return RankTrace(str(file), rank, world, backend, groups, spans, per_step, busy_step, unknown)


def _main_thread(events: list) -> object:
    """The thread that issues the job's work: the one with the most CPU ops."""
    counts = Counter(e.get("tid") for e in events if e.get("cat") == "cpu_op")
    return counts.most_common(1)[0][0] if counts else None


def _busy(events: list, main) -> list:
    """When the compute stream worked: the GPU's compute kernels where the trace has GPU kernels, else the
    main thread's innermost operations (an annotation or an outer op can hold a wait inside it: only
    its leaves are work), merged into intervals."""
    kernels = [e for e in events if e.get("cat") == "kernel" and "Collective name" not in e["args"]
               and not e["name"].lower().startswith("nccl")]
    chosen = kernels or _leaves([e for e in events if e.get("tid") == main and e.get("cat") == "cpu_op"
                                 and not e["name"].startswith("c10d::")])
    out = []
    for e in sorted(chosen, key=lambda e: e["ts"]):
        s, t = e["ts"], e["ts"] + e["dur"]
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], t))
        else:
            out.append((s, t))
    return out


def _leaves(ops: list) -> list:
    """The operations that hold no other (one thread's events nest: a parent starts first and ends last)."""
    ops = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
    leaves = []
    for i, e in enumerate(ops):
        following = ops[i + 1] if i + 1 < len(ops) else None
        if following is None or following["ts"] >= e["ts"] + e["dur"]:
            leaves.append(e)
    return leaves
