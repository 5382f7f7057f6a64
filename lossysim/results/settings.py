"""Settings of a sweep: which runs share one (every varying config key but the seed), what names it,
and which loss-free runs it is compared with. Shared by the report and the perplexity table.
"""
from __future__ import annotations

import math

import pandas as pd

from ..config import NON_SEMANTIC, ExperimentConfig
from .labels import LOSS_MODEL, LOSS_RATE, describe, reference, varying

# A loss spec is compared by what it means, not how it is spelled.
LOSS_KEYS = ("loss_model", "loss_rate", "mean_burst")

# The sweep runs a lossless setting once whatever these say, so its baseline ignores them.
LOSSLESS_FREE = ("loss", *LOSS_KEYS, "lossy", "recovery", "eval_lossy", "lossy_links", "lossy_traffic", "transport",
                 "retransmit", "deadline", "rto_s", "nic", "channels", "algorithm", "ranks_per_node", "link_intra",
                 "link_inter", "compute")

CONFIG_KEYS = tuple(f for f in ExperimentConfig.__dataclass_fields__)



def one_per_setting(runs: pd.DataFrame) -> pd.DataFrame:
    return runs.drop_duplicates(setting_keys(runs)) if len(runs) else runs


def series_reference(runs: pd.DataFrame) -> tuple[list, dict[str, str]]:
    """What names a line drawn against the loss rate: the dimensions that vary among the settings
    but the rate, and their reference values (the most common among lossy settings), which a
    line's label leaves out: "Bernoulli, direct" is Bernoulli loss with everything else as usual."""
    each = one_per_setting(runs)
    dims = [d for d in varying(each) if d is not LOSS_RATE]
    lossy = each[each["loss_model"] != "none"]
    return dims, reference(lossy if len(lossy) else each, dims)


def add_series(runs: pd.DataFrame) -> pd.DataFrame:
    """Add ``series``, a line's label: the loss model and whatever else differs from the reference
    setting ("Bernoulli, retransmit"); a loss-free run is "no loss" and what sets its time."""
    runs = runs.copy()
    dims, ref = series_reference(runs)
    runs["series"] = (runs.apply(lambda row: describe(row, dims, ref, always=[LOSS_MODEL.name]), axis=1)
                      if len(runs) else pd.Series(dtype=str))
    return runs


def setting_keys(runs: pd.DataFrame) -> list[str]:
    """What tells settings apart: every config column that varies except the seed, the loss spec
    by its meaning (model, rate, burst)."""
    skip = {"seed", "loss", *NON_SEMANTIC}
    varying = [c for c in runs.columns if c in CONFIG_KEYS and c not in skip
               and runs[c].astype(str).nunique(dropna=False) > 1]
    return [k for k in LOSS_KEYS if k in runs.columns] + varying


def setting_groups(runs: pd.DataFrame):
    """(setting, its runs), loss-free settings first, then by loss model, rate and burst."""
    if "series" not in runs.columns:
        runs = add_series(runs)
    keys = setting_keys(runs)
    groups = [(dict(zip(keys, key if isinstance(key, tuple) else (key,))), group)
              for key, group in runs.groupby(keys, dropna=False, sort=True)]
    return sorted(groups, key=lambda item: item[0]["loss_model"] != "none")   # stable: keeps the rest


def loss_free_runs(runs: pd.DataFrame, setting: dict, value: str) -> pd.DataFrame:
    """The completed loss-free runs with a ``value`` that ``setting`` is compared with: those with
    the same other settings, but for the keys a lossless run ignores (``LOSSLESS_FREE``)."""
    match = runs[(runs["status"] == "completed") & runs[value].notna() & (runs["loss_model"] == "none")]
    for k in setting_keys(runs):
        if k not in LOSSLESS_FREE:
            match = match[same(match[k], setting[k])]
    return match


def same(column: pd.Series, value) -> pd.Series:
    """Which of ``column``'s values equal ``value``, compared as text; a missing value (None or NaN: a key left
    at its default, such as microbatches) matches only a missing one (pandas' string columns keep NaN as NaN,
    so text alone never matches it)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return column.isna()
    return column.map(str) == str(value)


def p_cell(p: float, significant: bool) -> str:
    if not math.isfinite(p):
        return "–"
    return (f"{p:.3f}" if p >= 0.001 else "<0.001") + (" *" if significant else "")


def setting_columns(runs: pd.DataFrame) -> list:
    """The dimensions a table of every setting needs besides the loss model, rate and burst: those
    that vary among its settings, one column each."""
    return [d for d in varying(one_per_setting(runs)) if d not in (LOSS_MODEL, LOSS_RATE)]


def to_markdown(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "_no completed runs_\n"
    cells = [[str(c) for c in frame.columns]] + [[str(v) for v in row] for row in frame.itertuples(index=False)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    line = lambda r: "| " + " | ".join(v.ljust(w) for v, w in zip(r, widths)) + " |"   # noqa: E731
    rule = "| " + " | ".join("-" * w for w in widths) + " |"
    return "\n".join([line(cells[0]), rule, *map(line, cells[1:])]) + "\n"
