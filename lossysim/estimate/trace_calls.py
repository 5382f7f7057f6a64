"""A rank's communication calls read off its profiler events (``estimate.trace``): NCCL's
``record_param_comms`` events timed by their kernels, gloo's ``c10d::`` ops timed by their ``gloo:`` runs;
what was not understood, counted; a size no call can move, refused."""
from __future__ import annotations

import bisect
import json
from collections import Counter
from dataclasses import dataclass
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


def nccl_calls(file: Path, rank: int, groups: dict, events: list, unknown: Counter) -> list:
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


def gloo_calls(file: Path, rank: int, groups: dict, events: list, main, unknown: Counter) -> list:
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
