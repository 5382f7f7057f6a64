"""Profiler traces of NCCL jobs, written here: no GPU records one on these machines, so the tests and the
trace benchmark write them from the fields PyTorch's c10d records (``record_param_comms``: "Collective
name", "In msg nelems", "Out msg nelems", "Group size", "dtype", "Process Group Name", "Process Group
Ranks", "Rank", "Dst Rank" / "Src Rank"; ParamCommsUtils and the profiler's saveNcclMeta), its NCCL kernel
carrying the same fields with the CPU event's correlation id, as ``export_chrome_trace`` writes them."""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass
class NcclCall:
    collective: str          # record_param_comms' name: allreduce, _allgather_base, send, ...
    in_nelems: int
    out_nelems: int
    group: str
    start_us: float          # the NCCL kernel's start on the GPU (and, a few us before, its CPU event)
    dur_us: float
    dtype: str = "BFloat16"
    peer: Optional[int] = None   # a send's destination, a receive's source (global rank)


def write_trace(path: Path, rank: int, groups: dict, steps: list, compute: list, truncate_ranks: bool = False) -> Path:
    """One rank's trace: ``steps`` [(start_us, end_us, [NcclCall])], ``compute`` [(start_us, end_us)] of the
    GPU's compute kernels; ``groups``: pg name -> global ranks (distributedInfo's pg_config)."""
    world = 1 + max(r for ranks in groups.values() for r in ranks)
    events, corr = [], 100
    for i, (start, end, calls) in enumerate(steps):
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i + 3}", "pid": 1, "tid": 1,
                       "ts": start, "dur": end - start, "args": {}})
        for call in calls:
            corr += 1
            ranks = groups[call.group]
            text = "[" + ", ".join(map(str, ranks)) + "]"
            if truncate_ranks:      # record_param_comms truncates long lists past 30 ranks
                text = "[" + ", ".join(map(str, ranks[:2])) + ", ..., " + str(ranks[-1]) + "]"
            fields = {"Collective name": call.collective, "dtype": call.dtype, "In msg nelems": call.in_nelems,
                      "Out msg nelems": call.out_nelems, "Group size": len(ranks), "In split size": "[]",
                      "Out split size": "[]", "Process Group Name": call.group,
                      "Process Group Description": "undefined", "Process Group Ranks": text, "Rank": rank}
            if call.peer is not None:
                fields["Rank"] = ranks.index(call.peer)
                fields["Dst Rank" if call.collective == "send" else "Src Rank"] = call.peer
            events.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": 1,
                           "ts": call.start_us - 5, "dur": 4, "args": {"External id": corr, **fields}})
            kind = call.collective.strip("_").split("_")[0].capitalize()
            events.append({"ph": "X", "cat": "kernel", "name": f"ncclDevKernel_{kind}_Sum_bf16_RING_LL", "pid": 0,
                           "tid": 20, "ts": call.start_us, "dur": call.dur_us,
                           "args": {"External id": corr, "device": 0, "stream": 20, **fields}})
    for s, e in compute:
        events.append({"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16", "pid": 0, "tid": 7, "ts": s,
                       "dur": e - s, "args": {"device": 0, "stream": 7}})
    info = {"backend": "nccl", "rank": rank, "world_size": world, "pg_count": len(groups),
            "pg_config": [{"pg_name": name, "pg_desc": "undefined", "backend_config": "cuda:nccl",
                           "pg_size": len(ranks), "ranks": list(ranks)} for name, ranks in groups.items()]}
    data = {"schemaVersion": 1, "distributedInfo": info, "traceEvents": events, "traceName": str(path)}
    path = Path(path)
    raw = json.dumps(data).encode()
    path.write_bytes(gzip.compress(raw) if path.name.endswith(".gz") else raw)
    return path
