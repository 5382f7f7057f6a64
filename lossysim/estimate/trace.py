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

import bisect
import gzip
import json
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

# c10d's collective names (record_param_comms' "Collective name", c10d::<op> without its trailing _) ->
# the collective a call is; None: a collective the network has no model of (counted, not sent).
KINDS = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "allgather": "all_gather", "_allgather_base": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor": "all_gather", "allgather_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "send": "send", "recv": "recv", "recv_any_source": "recv",
    "broadcast": "broadcast", "all_to_all": "all_to_all", "alltoall": "all_to_all", "all_to_allv": "all_to_all",
    "alltoall_base": "all_to_all", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
    "barrier": "barrier", "monitored_barrier": "barrier",
}
# the gloo annotation each c10d op runs as (a reduce-scatter on gloo is an all-reduce of the whole input)
GLOO_RUNS = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "all_reduce",
             "send": "send", "recv": "recv", "broadcast": "broadcast", "all_to_all": "all_to_all",
             "reduce": "reduce", "gather": "gather", "scatter": "scatter", "barrier": "barrier"}
# dtype names as record_param_comms ("Float", c10::toString) and gloo's annotations (caffe2's type names)
# write them -> torch's name and bytes per element
DTYPES = {"float": ("float32", 4), "float32": ("float32", 4), "double": ("float64", 8), "float64": ("float64", 8),
          "bfloat16": ("bfloat16", 2), "c10::bfloat16": ("bfloat16", 2), "half": ("float16", 2),
          "c10::half": ("float16", 2), "float16": ("float16", 2), "int": ("int32", 4), "int32": ("int32", 4),
          "long": ("int64", 8), "long int": ("int64", 8), "int64": ("int64", 8), "byte": ("uint8", 1),
          "unsigned char": ("uint8", 1), "uint8": ("uint8", 1), "char": ("int8", 1), "signed char": ("int8", 1),
          "bool": ("bool", 1), "float8_e4m3fn": ("float8_e4m3fn", 1), "c10::float8_e4m3fn": ("float8_e4m3fn", 1),
          "float8_e5m2": ("float8_e5m2", 1), "c10::float8_e5m2": ("float8_e5m2", 1)}
_COMM_WORDS = ("c10d::", "gloo:", "nccl", "record_param_comms")
# One call's message lives in one device's memory: at most the largest GPU's, 288 GB (AMD MI355X's and NVIDIA
# B300's HBM3e). A size beyond it is a corrupt event, and it would be simulated packet by packet (exhausting
# the host's memory) before any figure came out.
MAX_CALL_BYTES = 288 * 10**9


@dataclass(frozen=True)
class Call:
    """One communication call as one rank made it. ``numel``: one rank's message as
    ``LossyNetwork.simulate`` counts it (an all-reduce's input, an all-gather's shard, a reduce-scatter's
    whole input, a send's message); times in microseconds on the rank's own clock: ``issue`` when its
    stream asked for it, ``start``/``end`` its traced execution (waiting for peers included)."""
    rank: int
    kind: str
    name: str
    numel: int
    dtype: str
    itemsize: int
    group: str
    peer: Optional[int]          # a send's destination, a receive's source (global rank)
    issue: float
    start: float
    end: float
    backward: bool               # issued inside the autograd engine

    @property
    def bytes(self) -> int:
        return self.numel * self.itemsize


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
        rank = _rank_trace(file, _load(file))
        if rank.rank in ranks:
            raise ValueError(f"{file}: rank {rank.rank} again (also {ranks[rank.rank].path}): one trace per rank")
        ranks[rank.rank] = rank
    first = next(iter(ranks.values()))
    empty = [r.path for r in ranks.values() if not r.steps]
    if empty:
        raise ValueError(f"{empty[0]}: the trace holds no events: profile at least one step")
    for r in ranks.values():
        _same_job(first, r)
    mirrored = len(ranks) == 1 and first.world > 1
    if not mirrored and len(ranks) != first.world:
        missing = sorted(set(range(first.world)) - set(ranks))
        raise ValueError(f"--trace {path}: ranks {_span(missing)} of {first.world} have no trace: give every "
                         "rank's, or one file whose peers mirror it")
    if not any(step for r in ranks.values() for step in r.calls):
        unknown = sum((r.unknown for r in ranks.values()), Counter())
        raise ValueError(f"--trace {path}: not one communication call understood, nothing to estimate (not "
                         f"understood: {_counted(unknown) or 'none, the trace holds no communication events'})")
    _same_calls(ranks, first.groups)
    if mirrored and any(c.kind in ("send", "recv") for step in first.calls for c in step):
        raise ValueError(f"{first.path}: one rank's trace with sends and receives: a pipeline's ranks differ, "
                         "give every rank's trace (a folder)")
    return Trace(ranks, first.world, first.backend, first.groups, mirrored)


def _same_job(first: RankTrace, r: RankTrace) -> None:
    """Refuse two ranks' traces whose distributedInfo is not one job's: its world, backend, process groups."""
    names = sorted(set(first.groups) | set(r.groups))
    group = next((n for n in names if first.groups.get(n) != r.groups.get(n)), None)
    for what, mine, theirs in (("world_size", r.world, first.world), ("backend", r.backend, first.backend),
                               (f"process group {group}'s ranks", r.groups.get(group), first.groups.get(group))):
        if mine != theirs:
            raise ValueError(f"{r.path} and {first.path} are not one job's traces: {what} {mine} against "
                             f"{theirs}: give the traces of one job")


def _same_calls(ranks: dict, groups: dict) -> None:
    """Refuse ranks whose calls are not one job's: the members of a group make the same collectives on it,
    and a send's peer receives from its sender (and a receive's peer sends). The kinds of call, not their
    counts: a call the profiler's window cut off at one rank is no disagreement. Traces of two jobs on the
    same world and groups (one's all-reduces, the other's sends) differ here."""
    kinds, p2p = Counter(), Counter()
    for r in ranks.values():
        for call in (c for step in r.calls for c in step):
            if call.kind in ("send", "recv"):
                p2p[r.rank, call.kind, call.peer] += 1
            else:
                kinds[r.rank, call.group, call.kind] += 1
    for name, members in groups.items():
        traced = [m for m in members if m in ranks]
        mine = {m: sorted(k for (r, g, k) in kinds if (r, g) == (m, name)) for m in traced}
        for m in traced[1:]:
            if mine[m] != mine[traced[0]]:
                raise ValueError(f"{ranks[m].path} and {ranks[traced[0]].path} are not one job's traces: on "
                                 f"process group {name} rank {m} makes {', '.join(mine[m]) or 'no collective'}, rank "
                                 f"{traced[0]} {', '.join(mine[traced[0]]) or 'none'}: give the traces of one job")
    for rank, kind, peer in sorted(p2p):
        mirror = "recv" if kind == "send" else "send"
        if peer in ranks and (peer, mirror, rank) not in p2p:
            does, never = ("sends to", "receives from") if kind == "send" else ("receives from", "sends to")
            raise ValueError(f"{ranks[rank].path} and {ranks[peer].path} are not one job's traces: rank {rank} "
                             f"{does} rank {peer}, which never {never} it: give the traces of one job")


def _counted(unknown: Counter) -> str:
    return "; ".join(f"{name} x{n}" for name, n in unknown.most_common(3)) + ("; ..." if len(unknown) > 3 else "")


def _span(ranks: list) -> str:
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")


def _load(file: Path) -> dict:
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


def _rank_trace(file: Path, data: dict) -> RankTrace:
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
        calls = _nccl_calls(file, rank, groups, events, unknown)
    else:
        calls = _gloo_calls(file, rank, groups, events, main, unknown)
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


class _Backward:
    """Whether a time on a thread lies inside an autograd engine's evaluation (a backward op)."""

    def __init__(self, events: list):
        self.spans: dict = {}
        for e in events:
            if e["name"].startswith("autograd::engine::evaluate_function"):
                self.spans.setdefault(e.get("tid"), []).append((e["ts"], e["ts"] + e["dur"]))
        for spans in self.spans.values():
            spans.sort()
        self.starts = {tid: [s for s, _ in spans] for tid, spans in self.spans.items()}

    def __call__(self, tid, ts: float) -> bool:
        spans = self.spans.get(tid)
        if not spans:
            return False
        i = bisect.bisect_right(self.starts[tid], ts) - 1
        # evaluate_function events nest at most a few deep: look back over the recent ones
        return any(spans[j][0] <= ts <= spans[j][1] for j in range(max(0, i - 8), i + 1))


def _dtype(name) -> Optional[tuple[str, int]]:
    return DTYPES.get(str(name).strip().lower()) if name is not None else None


def _ranks_of(value) -> Optional[tuple]:
    """"Process Group Ranks" (a list, or its text, truncated with ... past 30 ranks) -> the ranks or None."""
    if isinstance(value, list):
        return tuple(int(r) for r in value)
    text = str(value or "").strip()
    if "..." in text or not text.startswith("["):
        return None
    try:
        return tuple(int(r) for r in json.loads(text))
    except (json.JSONDecodeError, TypeError, ValueError):
        return None


def _nccl_calls(file: Path, rank: int, groups: dict, events: list, unknown: Counter) -> list:
    """Calls from ``record_param_comms`` events, each timed by its NCCL kernel where the trace has it."""
    backward = _Backward(events)
    kernels = {}
    for e in events:
        if e.get("cat") == "kernel" and "Collective name" in e["args"] and "External id" in e["args"]:
            kernels.setdefault(e["args"]["External id"], e)
    calls = []
    for e in events:
        name = e["name"]
        if name != "record_param_comms":
            if e.get("cat") == "kernel" and "Collective name" in e["args"]:
                continue     # the execution of a record_param_comms call
            if name.lower().startswith(("nccldevkernel", "ncclkernel")) and e.get("cat") == "kernel":
                unknown[f"{name} (an NCCL kernel without its call's fields)"] += 1
            continue
        args = e["args"]
        collective = str(args.get("Collective name", "")).strip('"')
        kind = KINDS.get(collective)
        dtype = _dtype(args.get("dtype"))
        group = str(args.get("Process Group Name", "")).strip('"')
        if kind is None or dtype is None:
            unknown[f"record_param_comms {collective or '?'}" + ("" if kind else " (collective not known)")
                    + ("" if dtype else f" (dtype {args.get('dtype')!r})")] += 1
            continue
        if group not in groups:
            ranks = _ranks_of(args.get("Process Group Ranks"))
            match = [g for g, r in groups.items() if r == ranks]
            if not match:
                unknown[f"record_param_comms {collective} (process group {group!r} not in distributedInfo)"] += 1
                continue
            group = match[0]
        n_in, n_out = int(args.get("In msg nelems", 0) or 0), int(args.get("Out msg nelems", 0) or 0)
        numel = _sized(file, e, n_out if kind == "recv" and n_out else n_in, dtype)
        peer = None
        if kind in ("send", "recv"):
            peer = args.get("Dst Rank" if kind == "send" else "Src Rank")
            if peer is None and args.get("Rank") is not None:   # older versions: the group's own rank
                local = int(args["Rank"])
                peer = groups[group][local] if 0 <= local < len(groups[group]) else None
            if peer is None:
                unknown[f"record_param_comms {collective} (no peer rank)"] += 1
                continue
            peer = int(peer)
        kernel = kernels.get(args.get("External id"))
        start, end = (kernel["ts"], kernel["ts"] + kernel["dur"]) if kernel else (e["ts"], e["ts"] + e["dur"])
        # on the GPU a call is issued when its stream reaches it: its kernel's start
        calls.append(Call(rank, kind, collective, numel, *dtype, group, peer, start if kernel else e["ts"],
                          start, end, backward(e.get("tid"), e["ts"])))
    return calls


def _sized(file: Path, event: dict, numel: int, dtype: tuple) -> int:
    """``numel``, or (a negative size, or more bytes than ``MAX_CALL_BYTES``) a one-line ValueError naming
    the event: a corrupt trace is refused before any work."""
    if 0 <= numel * dtype[1] <= MAX_CALL_BYTES:
        return numel
    what = "a negative size" if numel < 0 else f"{numel * dtype[1]:.3g} bytes, more than one call can move " \
        f"({MAX_CALL_BYTES / 1e9:g} GB, the largest GPU's memory)"
    raise ValueError(f"{file}: event {event['name']} at ts {event['ts']} us moves {numel} {dtype[0]} elements, "
                     f"{what}: a corrupt trace")


def _input_numels(args: dict) -> list:
    """Element counts of a c10d op's tensor arguments, in order ("Input Dims": a tensor's dims, or a
    tensor list's)."""
    out = []
    for dims, kind in zip(args.get("Input Dims") or [], args.get("Input type") or []):
        if kind == "TensorList" and isinstance(dims, list):
            out.append(sum(_numel(d) for d in dims))
        elif isinstance(dims, list) and dims and kind not in ("", "Scalar", "ScalarList"):
            out.append(_numel(dims))
    return out


def _numel(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _gloo_calls(file: Path, rank: int, groups: dict, events: list, main, unknown: Counter) -> list:
    """Calls from ``c10d::<op>`` CPU events, each timed by the ``gloo:<op>`` annotation of its execution."""
    backward = _Backward(events)
    ops, runs = [], {}
    for e in sorted(events, key=lambda e: e["ts"]):
        name = e["name"]
        if name.startswith("gloo:"):
            runs.setdefault(name[5:], []).append(e)
        elif name.startswith("c10d::"):
            ops.append(e)
        elif name.lower().startswith("nccl") and e.get("cat") == "kernel":
            unknown[name] += 1
    # groups of the same ranks are the same placement (a device mesh's group beside the default one)
    distinct = {ranks: name for name, ranks in reversed(list(groups.items())) if len(ranks) > 1}
    if ops and len(distinct) > 1:
        raise ValueError(f"{file}: a gloo trace names no call's process group and this job has {len(distinct)} "
                         f"({', '.join(distinct.values())}): profile it on NCCL, or with one process group")
    group = next(iter(distinct.values()), next(iter(groups)))
    used = set()
    calls = []
    for e in ops:
        collective = e["name"][6:].rstrip("_")
        kind = KINDS.get(collective)
        if kind is None:
            unknown[e["name"]] += 1
            continue
        numels = _input_numels(e["args"])
        run = _match(runs.get(GLOO_RUNS[kind], []), used, e["ts"], numels)
        if run is None:
            unknown[f"{e['name']} (no gloo:{GLOO_RUNS[kind]} ran it)"] += 1
            continue
        used.add(id(run))
        dtype = _dtype((run["args"].get("Input type") or [None])[0])
        (numel,) = _input_numels(run["args"])[:1] or (0,)
        if dtype is None:
            unknown[f"{e['name']} (dtype {(run['args'].get('Input type') or [None])[0]!r})"] += 1
            continue
        numel = _sized(file, e, numel, dtype)
        peer = None
        if kind in ("send", "recv"):
            concrete = e["args"].get("Concrete Inputs") or []
            try:
                local = int(concrete[2])
            except (IndexError, TypeError, ValueError):
                unknown[f"{e['name']} (no peer rank)"] += 1
                continue
            peer = groups[group][local] if 0 <= local < len(groups[group]) else None
            if peer is None:
                unknown[f"{e['name']} (peer {local} outside its group)"] += 1
                continue
        calls.append(Call(rank, kind, e["name"], numel, *dtype, group, peer, e["ts"], run["ts"],
                          run["ts"] + run["dur"], backward(e.get("tid"), e["ts"])))
    for name, pending in runs.items():
        left = sum(id(r) not in used for r in pending)
        if left:
            unknown[f"gloo:{name} (no c10d call issued it)"] += left
    return calls


def _match(runs: list, used: set, issued: float, numels: list) -> Optional[dict]:
    """The first gloo run not yet matched that starts after ``issued`` and moves one of ``numels``
    elements (gloo's worker threads run a group's calls in the order they were issued)."""
    for run in runs:
        if id(run) in used or run["ts"] + run["dur"] < issued:
            continue
        sizes = _input_numels(run["args"])
        if not numels or not sizes or sizes[0] in numels:
            return run
    return None


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
