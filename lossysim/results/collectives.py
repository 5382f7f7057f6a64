"""Which NCCL algorithm each collective ran: summary.json's ``collectives``, per group of runs timed alike.

A run records one choice per network, call site, direction, collective and message size
(docs/run_directory.md). Runs that share the settings the choice depends on (algorithm, topology,
pipeline, links, compute, model) ran the same choices whatever their loss, so the report names them
once per such group, with the call sites of one (traffic, collective, algorithm, protocol) folded into
patterns (``h.*.attn.reduce``).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import pandas as pd

from ..io import read_summary
from ..traffic import of_network
from .labels import dimensions, varying

# The labels' dimensions that decide NCCL's choice (a loss setting does not).
CHOSEN_BY = ("algorithm", "topology", "pipeline", "inter-node link", "intra-node link", "compute", "model")
COLUMNS = ["runs", "traffic", "collective", "algorithm", "channels", "call sites", "message", "loss-free per call"]


def site_pattern(site: str) -> str:
    """A call site with its layer, bucket or boundary numbers as ``*``: ``h.3.mlp.copy`` -> ``h.*.mlp.copy``."""
    return re.sub(r"\d+", "*", site)


def _span(low: float, high: float, unit: str, digits: int) -> str:
    low_s, high_s = f"{low:.{digits}f}", f"{high:.{digits}f}"
    return f"{low_s} {unit}" if low_s == high_s else f"{low_s}–{high_s} {unit}"


# A record's fields, by type (run.summary.collectives); protocol may be empty.
FIELDS = {"network": str, "collective": str, "algorithm": str, "channels": int, "site": str, "bytes": (int, float),
          "seconds": (int, float)}


def _records(summary: dict) -> tuple[list[dict], int]:
    """``summary``'s collectives records of the expected shape, and how many others it holds."""
    given = summary.get("collectives") or []
    if not isinstance(given, list):
        return [], 1
    good = [r for r in given if isinstance(r, dict) and isinstance(r.get("protocol") or "", str)
            and all(isinstance(r.get(k), kind) and not isinstance(r.get(k), bool) for k, kind in FIELDS.items())]
    return good, len(given) - len(good)


def collectives_table(results: Path, runs: pd.DataFrame, problems: Optional[dict] = None) -> pd.DataFrame:
    """One row per group of runs timed alike, traffic (TP, PP, DP), collective and (algorithm, protocol):
    its channels, its call sites as patterns with their count, the message sizes and one call's loss-free
    time (ranges over the group's records). Runs whose summary has no ``collectives`` (written before
    0.4) are left out; empty when none has any. A record of another shape is left out, and its run named
    in ``problems``."""
    done = runs[runs["status"].isin(("completed", "diverged"))] if "status" in runs.columns else runs
    done = done.assign(loss_model="none")   # labelled as loss-free: where loss may fall does not split a group
    dims = varying(done, [d for d in dimensions(done) if d.name in CHOSEN_BY])
    records = []
    for _, run in done.iterrows():
        summary = read_summary(Path(results) / str(run["run_dir"])) or {}
        group = ", ".join(d.value(run) for d in dims) if dims else "every run"
        good, bad = _records(summary)
        if bad and problems is not None:
            problems[str(run["run_dir"])] = (f"summary.json's collectives hold {bad} malformed record(s), left out "
                                             "of the collectives table")
        for record in good:
            protocol = record.get("protocol") or ""
            traffic = of_network(record["network"])
            records.append({"runs": group, "traffic": traffic.label if traffic else record["network"],
                            "collective": record["collective"],
                            "algorithm": record["algorithm"] + (f"/{protocol}" if protocol else ""),
                            "channels": record["channels"], "site": record["site"], "bytes": record["bytes"],
                            "seconds": record["seconds"]})
    if not records:
        return pd.DataFrame(columns=COLUMNS)
    frame = pd.DataFrame(records)
    rows = []
    keys = ["runs", "traffic", "collective", "algorithm"]
    for key, part in frame.groupby(keys, sort=False):
        sites = sorted(set(part["site"]))
        patterns = sorted(set(map(site_pattern, sites)))
        rows.append({**dict(zip(keys, key)),
                     "channels": ", ".join(str(c) for c in sorted(set(part["channels"]))),
                     "call sites": f"{', '.join(patterns)} ({len(sites)})",
                     "message": _span(part["bytes"].min() / 1024, part["bytes"].max() / 1024, "KiB", 1),
                     "loss-free per call": _span(part["seconds"].min() * 1e6, part["seconds"].max() * 1e6, "µs", 1),
                     "_order": part["bytes"].min()})
    table = pd.DataFrame(rows)
    table["_group"] = table["runs"].map({g: i for i, g in enumerate(dict.fromkeys(frame["runs"]))})
    table = table.sort_values(["_group", "traffic", "collective", "_order"], kind="stable")
    return table[COLUMNS].reset_index(drop=True)
