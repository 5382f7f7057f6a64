"""How a report names settings, and which settings it compares with which.

A sweep varies config keys; a reader asks questions: which algorithm, which transport, which
topology, how bursty the loss. A ``Dimension`` is one such question: the summary.csv columns that
answer it together (``transport``, ``retransmit``, ``deadline`` and ``rto_s`` make one transport)
and how to write a value readably ("deadline 3x", "2 nodes x 2 ranks, loss between nodes",
"Gilbert-Elliott (burst 8)").

Labels (``describe``) name only the dimensions that vary among the settings compared in one
plot panel or one table, so what is equal across them does not repeat on every line. A
comparison (``comparisons``) varies one dimension and holds the others at their reference value:
the most common one among the lossy settings, the config default on a tie.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

import pandas as pd

from .. import axes
from ..config import NON_SEMANTIC, ExperimentConfig
from ..loss.spec import display_name
from ..mesh import CARVED, Mesh
from ..traffic import KIND_LABELS, PAIRS

CONFIG_DEFAULTS = {name: f.default for name, f in ExperimentConfig.__dataclass_fields__.items()}
NO_LOSS = "no loss"
NOT_APPLICABLE = "–"      # a loss-free run's transport, direction, recovery: there is nothing to recover
_MISSING = object()
# Units for simulated seconds: each used while the typical time shown is below its limit (hours above).
TIME_UNITS = ((1.0, 1e3, "ms"), (120.0, 1.0, "s"), (7200.0, 1 / 60, "min"))


def _get(row: Mapping, key: str, missing=None):
    """``row[key]``; ``missing`` when the column is absent (summary.csv keeps a config key only
    when it varies), None when the value is (None and NaN alike)."""
    if key not in row:
        return missing
    value = row[key]
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value


def _lossless(row: Mapping) -> bool:
    return _get(row, "loss_model") == "none"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


# -- how each question's answer is written --------------------------------------------------------
def _loss_model(row: Mapping) -> str:
    burst = _get(row, "mean_burst")
    return display_name(str(_get(row, "loss_model")), math.nan if burst is None else float(burst))


def _loss_rate(row: Mapping) -> str:
    rate = _get(row, "loss_rate")
    return "?%" if rate is None else f"{100 * float(rate):g}%"


def _transport(row: Mapping) -> str:
    kind = str(_get(row, "transport") or "drop")
    if kind == "drop":
        return kind
    deadline = _get(row, "deadline")
    text = f"deadline {float(deadline):g}x" if kind == "deadline" and deadline is not None else kind
    nic = _get(row, "nic")
    if nic is not None:
        text += f" ({nic})"
    if _get(row, "retransmit") == "go_back_n":
        text += " (go-back-N)"
    rto = _get(row, "rto_s")
    return text + (f", RTO {1e6 * float(rto):g} us" if rto is not None else "")


def _topology(row: Mapping) -> str:
    tp = _get(row, "tp_size")
    per_node = _get(row, "ranks_per_node", _MISSING)
    if tp is None:
        return "?"
    tp = int(tp)
    # data-parallel replicas (summary.csv has replicas for dp runs only, dp_size where it varies)
    dp = int(_get(row, "replicas") or _get(row, "dp_size") or 1)
    # every other axis's ranks count too (pp's: the pipeline dimension names them; cp's: its size's); experts
    # are carved out of the data-parallel ranks
    sizes = {a.mesh: int(_get(row, a.size) or 1) for a in axes.AXES if a.mesh and a.mesh not in ("tp", "dp", *CARVED)}
    pp = sizes.get("pp", 1)
    world = Mesh(tp, dp, **sizes).world
    if per_node is _MISSING:      # constant over the sweep, value unknown: say only what is known
        text = _plural(world, "rank")
    else:
        per_node = tp if per_node is None else int(per_node)   # None: a TP group's ranks on one node
        text = f"{_plural(max(world // per_node, 1), 'node')} x {_plural(per_node, 'rank')}"
    if dp > 1:   # (with one replica, the pipeline dimension names the stages)
        text += ", " + " x ".join([f"tp {tp}", *([f"pp {pp}"] if pp > 1 else []), f"dp {dp}"])
    # A loss-free run loses nothing anywhere: where loss could happen says nothing about it.
    if _get(row, "lossy_links") == "inter_node" and not _lossless(row):
        text += ", loss between nodes"
    return text


def _pipeline(row: Mapping) -> str:
    """``pp 2 (1f1b, m=2)``: stages, schedule and micro-batches (``pp_size`` by default); ``pp 1`` without
    stages."""
    pp = int(_get(row, "pp_size") or 1)
    schedule, micro = _get(row, "pp_schedule", _MISSING), _get(row, "microbatches", _MISSING)
    parts = [] if pp == 1 or schedule is _MISSING else [str(schedule or CONFIG_DEFAULTS["pp_schedule"])]
    if micro is not _MISSING:   # absent: summary.csv from before pipelines, say only what is known
        micro = pp if micro is None else int(micro)
        parts += [f"m={micro}"] if pp > 1 or micro != 1 else []
    return f"pp {pp}" + (f" ({', '.join(parts)})" if parts else "")



def _traffic(row: Mapping) -> str:
    value = str(_get(row, "lossy_traffic") or "all")
    if value == "all":
        return "all traffic"
    # ``lossy_traffic``'s kinds, readably (``lossysim.traffic``); a run's value lists them separated by commas
    names = [KIND_LABELS.get(kind.strip(), kind.strip()) for kind in value.split(",")]
    for pair, both in PAIRS.items():   # a class's two directions are one name
        if set(pair) <= set(names):
            names = [both if n == pair[0] else n for n in names if n != pair[1]]
    return " and ".join(names)


# Which traffic loses packets: activations (fwd), gradients (bwd) or both.
DIRECTIONS = {"fwd": "fwd only", "bwd": "bwd only", "both": "fwd and bwd"}
_RECOVERIES = {"zero": "zero-fill", "rescale": "rescale"}


def _recovery(row: Mapping) -> str:
    """The policy's name; "–" under retransmission, where every packet arrives and no policy acts."""
    if str(_get(row, "transport")) == "retransmit":
        return NOT_APPLICABLE
    return _named("recovery", _RECOVERIES)(row)


def _eval_lossy(row: Mapping) -> str:
    lossy = str(_get(row, "eval_lossy")).lower() in ("true", "1", "1.0")
    return "lossy eval" if lossy else "reliable eval"


def _plain(key: str, template: str = "{}") -> Callable[[Mapping], str]:
    return lambda row: template.format(_get(row, key))


def _named(key: str, names: Mapping[str, str]) -> Callable[[Mapping], str]:
    """A value's readable name, the value itself when it has none."""
    return lambda row: names.get(str(_get(row, key)), str(_get(row, key)))


@dataclass(frozen=True)
class Dimension:
    """One question a sweep can ask, answered by one or more columns."""
    name: str                         # a table column's header
    keys: tuple[str, ...]             # the summary.csv columns it reads
    write: Callable[[Mapping], str]   # a row's answer, readably
    question: str = ""                # a plot panel's title
    without_loss: bool = True         # whether a loss-free run's value means anything (its time)

    def value(self, row: Mapping) -> str:
        return NOT_APPLICABLE if _lossless(row) and not self.without_loss else self.write(row)

    @property
    def title(self) -> str:
        return self.question or self.name


# A loss-free setting is labelled "no loss" by ``describe``, not by these.
LOSS_MODEL = Dimension("loss model", ("loss_model", "mean_burst"), _loss_model,
                       "Burstiness at equal average loss rate", without_loss=False)
LOSS_RATE = Dimension("loss rate", ("loss_rate",), _loss_rate, "Average loss rate", without_loss=False)
# In the order labels name them.
KNOWN = (
    LOSS_MODEL, LOSS_RATE,
    Dimension("algorithm", ("algorithm",), _plain("algorithm"), "Collective algorithm"),
    Dimension("transport", ("transport", "nic", "retransmit", "deadline", "rto_s"), _transport,
              "Transport: drop, retransmit or deadline", without_loss=False),
    Dimension("topology", ("tp_size", "ranks_per_node", "lossy_links", "replicas", "dp_size", "pp_size"), _topology,
              "Topology"),
    Dimension("pipeline", ("pp_size", "pp_schedule", "microbatches"), _pipeline,
              "Pipeline: stages, schedule, micro-batches"),
    Dimension("lossy traffic", ("lossy_traffic",), _traffic, "Which traffic loses packets", without_loss=False),
    Dimension("lossy direction", ("lossy",), _named("lossy", DIRECTIONS),
              "Lossy direction: activations (fwd), gradients (bwd)", without_loss=False),
    Dimension("recovery", ("recovery",), _recovery, "Recovery of lost packets",
              without_loss=False),
    Dimension("evaluation", ("eval_lossy",), _eval_lossy, "Lossy or reliable evaluation", without_loss=False),
    Dimension("inter-node link", ("link_inter",), _plain("link_inter", "{} between nodes"), "Inter-node link"),
    Dimension("intra-node link", ("link_intra",), _plain("link_intra", "{} inside a node"), "Intra-node link"),
    *(Dimension(key, (key,), _plain(key), key) for key in ("compute", "model", "dataset", "backend")),
)
# Never a dimension: what tells runs of one setting apart, and how a loss spec is spelled.
_NOT_SETTINGS = {"seed", "loss", *NON_SEMANTIC}


# -- which dimensions a set of settings has, and their reference values ----------------------------
def dimensions(frame: pd.DataFrame) -> list[Dimension]:
    """The dimensions ``frame``'s columns can answer: the known ones, then any other config key
    as ``key=value``."""
    known = [d for d in KNOWN if any(k in frame.columns for k in d.keys)]
    covered = {k for d in KNOWN for k in d.keys} | _NOT_SETTINGS
    other = [Dimension(k, (k,), _plain(k, f"{k}={{}}"), k) for k in frame.columns
             if k in CONFIG_DEFAULTS and k not in covered]
    return known + other


def values(frame: pd.DataFrame, dimension: Dimension) -> pd.Series:
    """Each row's value of ``dimension``, readably."""
    return frame.apply(lambda row: dimension.value(row), axis=1) if len(frame) else pd.Series(dtype=str)


def varying(frame: pd.DataFrame, dims: Optional[Iterable[Dimension]] = None) -> list[Dimension]:
    """The dimensions with more than one value among ``frame``'s rows (a loss-free row's "–" is no
    value: transport does not vary in a sweep of drop runs and their baseline)."""
    dims = dimensions(frame) if dims is None else dims
    return [d for d in dims if values(frame, d).loc[lambda v: v != NOT_APPLICABLE].nunique() > 1]


def reference(frame: pd.DataFrame, dims: Iterable[Dimension]) -> dict[str, str]:
    """Per dimension, the value most rows have; on a tie, the config default's value if it is among
    the tied ones (ring, drop: what a sweep that varies two things evenly starts from), else the
    first row's."""
    default = {k: v for k, v in CONFIG_DEFAULTS.items() if k in frame.columns}
    default["loss_model"] = "bernoulli"          # the reference of lossy settings: the plainest loss
    out = {}
    for dim in dims:
        column = values(frame, dim)
        counts = column.value_counts(sort=False)
        tied = [v for v in dict.fromkeys(column) if counts[v] == counts.max()]
        preferred = dim.value(default)
        out[dim.name] = preferred if preferred in tied else tied[0]
    return out


def describe(row: Mapping, dims: Iterable[Dimension], ref: Optional[Mapping[str, str]] = None,
             always: Iterable[str] = ()) -> str:
    """A setting's label: its values of ``dims`` (those that vary among what it is compared with),
    leaving out values equal to the reference ``ref`` unless the dimension is in ``always`` (the
    question a panel asks). A loss-free setting is "no loss" and what still matters without loss
    (its algorithm, topology, links)."""
    always = list(always)
    dims = sorted(dims, key=lambda d: d.name not in always)     # the question's answer first
    parts = [NO_LOSS] if _lossless(row) else []
    for dim in dims:
        if _lossless(row) and not dim.without_loss:
            continue
        value = dim.value(row)
        if dim.name in always or ref is None or value != ref.get(dim.name):
            parts.append(value)
    return ", ".join(parts) if parts else LOSS_MODEL.value(row)


# -- comparisons: a panel per question ---------------------------------------------------------------
@dataclass
class Comparison:
    """The lossy settings that answer one question, the other dimensions held."""
    question: Optional[Dimension]     # None: one panel for a sweep that varies nothing but the rate
    settings: pd.DataFrame            # rows of the settings given to ``comparisons``
    held: list[str]                   # the held values of dimensions that vary elsewhere, readably
    reference: str = ""               # the question's reference answer ("ring", "drop")

    @property
    def title(self) -> str:
        return self.question.title if self.question else "Every setting"


def _joint(dims: list[Dimension], frame: pd.DataFrame) -> list[Dimension]:
    """Dimensions that change together in this sweep (one always determines the other) become one:
    held apart, neither would have a second value to compare."""
    merged: list[Dimension] = []
    for dim in dims:
        codes = values(frame, dim)
        twin = next((i for i, m in enumerate(merged)
                     if codes.groupby(values(frame, m)).nunique().max() == 1
                     and values(frame, m).groupby(codes).nunique().max() == 1), None)
        if twin is None:
            merged.append(dim)
        else:
            first = merged[twin]
            merged[twin] = Dimension(f"{first.name}, {dim.name}", first.keys + dim.keys,
                                     lambda r, a=first, b=dim: f"{a.write(r)}, {b.write(r)}",
                                     f"{first.title}, {dim.title}", first.without_loss or dim.without_loss)
    return merged


def comparisons(lossy: pd.DataFrame) -> list[Comparison]:
    """A comparison per dimension that varies among the lossy settings (one row each): the
    settings whose other dimensions are at their reference, at the loss rates where at least two
    of its values were run (a value alone at a rate compares with nothing). One comparison of
    everything when no dimension but the rate varies."""
    dims = _joint([d for d in varying(lossy) if d is not LOSS_RATE], lossy)
    ref = reference(lossy, dims)
    answers = {d.name: values(lossy, d) for d in dims}
    rates = values(lossy, LOSS_RATE)
    found = []
    # How the loss behaves is the setting's environment, the rest are choices: those first.
    for dim in sorted(dims, key=lambda d: d is LOSS_MODEL):
        others = [d for d in dims if d is not dim]
        held = pd.Series(True, index=lossy.index)
        for other in others:
            held &= answers[other.name] == ref[other.name]
        answer = answers[dim.name][held]
        compared = answer.groupby(rates[held]).nunique()
        rows = held & rates.isin(compared[compared > 1].index)
        if answers[dim.name][rows].nunique() > 1:
            shown = [ref[o.name] for o in others]
            if rates[rows].nunique() == 1:
                shown.append(f"{rates[rows].iloc[0]} loss")
            found.append(Comparison(dim, lossy[rows], shown, ref[dim.name]))
    return found or [Comparison(None, lossy, [])]


def time_unit(seconds: Iterable[float]) -> tuple[float, str]:
    """The unit to show simulated ``seconds`` in (its factor from seconds, its name): the one that
    keeps their median readable, so one run that paid a 300 s restart does not write the others'
    milliseconds as "0.0005 min"; seconds when there is nothing to show."""
    shown = [abs(float(s)) for s in seconds if s is not None and math.isfinite(float(s))]
    if not shown:
        return 1.0, "s"
    typical = statistics.median(shown)
    return next(((scale, name) for limit, scale, name in TIME_UNITS if typical < limit), (1 / 3600, "h"))
