"""Loss specs: the text users write (``bernoulli:1%``, ``ge:rate=..,burst=..``, netem's words,
``trace:PATH``) and the one label scheme results use for a model's family."""
from __future__ import annotations

from typing import Union

from .four_state import FourState
from .gilbert_elliott import GilbertElliott
from .models import Bernoulli, LossModel, NoLoss, _check_probability
from .traces import Trace


def _parse_number(field: str, text: str) -> float:
    text = text.strip()
    try:
        return float(text[:-1]) / 100.0 if text.endswith("%") else float(text)
    except ValueError:
        raise ValueError(f"{field}={text!r} is not a number") from None


_SPEC_HELP = ("expected none, bernoulli:P, ge:rate=L,burst=B, ge:p_gb=P,p_bg=R[,loss_bad=X,loss_good=Y], "
              "netem:loss random P | gemodel P [R [1-H [1-K]]] | state P13 [P31 [P32 [P23 [P14]]]], "
              "or trace:PATH")
_NETEM_FIELDS = {"random": ("p",), "gemodel": ("p", "r", "1-h", "1-k"),
                 "state": ("p13", "p31", "p32", "p23", "p14")}


def _parse_netem(args: str) -> LossModel:
    """The ``loss ...`` part of a ``tc qdisc ... netem`` line; percents or fractions."""
    words = args.split()
    if words and words[0].lower() == "loss":
        words = words[1:]
    if words and words[0][:1].isdigit():   # netem's old syntax: loss P = loss random P
        words = ["random"] + words
    if not words or words[0].lower() not in _NETEM_FIELDS:
        raise ValueError(f"expected 'loss random', 'loss gemodel' or 'loss state', got {args.strip()!r}")
    kind, values = words[0].lower(), words[1:]
    if "ecn" in (v.lower() for v in values):
        raise ValueError("ecn marks packets instead of dropping them; lossysim models drops only")
    fields = _NETEM_FIELDS[kind]
    if not values:
        raise ValueError(f"{fields[0]} is missing (loss {kind} {' '.join(f.upper() for f in fields)})")
    if kind == "random" and len(values) > 1:
        raise ValueError(f"correlation={values[1]} is not supported: netem deprecated it (it distorts "
                         "the loss rate); use loss gemodel")
    if len(values) > len(fields):
        raise ValueError(f"loss {kind} takes at most {len(fields)} values, got {' '.join(values)!r}")
    numbers = [_parse_number(field, value) for field, value in zip(fields, values)]
    if kind == "random":
        return NoLoss() if numbers[0] == 0.0 else Bernoulli(numbers[0])
    if kind == "gemodel":
        keywords = dict(zip(("p", "r", "one_minus_h", "one_minus_k"), numbers))
        for name, field in zip(("p", "r", "one_minus_h", "one_minus_k"), fields):
            if name in keywords:
                _check_probability(field, keywords[name])
        return GilbertElliott.from_netem(**keywords)
    return FourState(*numbers)


def parse_loss_model(spec: Union[str, LossModel, None]) -> LossModel:
    """Build a loss model from a CLI/config spec.

    ``none``, ``bernoulli:0.01`` (or ``bernoulli:1%``), ``ge:rate=0.01,burst=4``,
    ``ge:p_gb=0.001,p_bg=0.2,loss_bad=0.9,loss_good=0``, netem's own words
    (``netem:loss random 1%``, ``netem:loss gemodel 1% 10% 70% 0.1%``,
    ``netem:loss state 1% 30% 2% 80% 0.5%``, netem's defaults for omitted
    values) and ``trace:PATH`` (see ``load_trace``). Raises ValueError naming
    the bad field and value (FileNotFoundError for a missing trace).
    """
    if isinstance(spec, LossModel):
        return spec
    text = "none" if spec is None else str(spec).strip()
    kind, _, args = text.partition(":")
    kind = kind.strip().lower()
    try:
        if kind in ("none", "", "off"):
            if args.strip():
                raise ValueError(f"'none' takes no parameters, got {args!r}")
            return NoLoss()
        if kind in ("bernoulli", "random"):
            value = args.split("=", 1)[1] if args.strip().startswith("p=") else args
            if not value.strip():
                raise ValueError("p is missing (bernoulli:P)")
            p = _parse_number("p", value)
            return NoLoss() if p == 0.0 else Bernoulli(p)
        if kind in ("ge", "gilbert", "gilbert-elliott"):
            fields = {}
            for item in filter(None, (a.strip() for a in args.split(","))):
                key, eq, value = item.partition("=")
                key = key.strip()
                if not eq:
                    raise ValueError(f"{item!r} is not key=value")
                if key not in ("rate", "burst", "p_gb", "p_bg", "loss_bad", "loss_good"):
                    raise ValueError(f"unknown key {key}={value}")
                fields[key] = _parse_number(key, value)
            if "rate" in fields or "burst" in fields:
                extra = set(fields) - {"rate", "burst"}
                if extra:
                    raise ValueError(f"{sorted(extra)[0]}={fields[sorted(extra)[0]]:g} cannot be "
                                     "combined with rate/burst")
                for key in ("rate", "burst"):
                    if key not in fields:
                        raise ValueError(f"{key} is missing (ge:rate=L,burst=B)")
                return GilbertElliott.from_rate(fields["rate"], fields["burst"])
            for key in ("p_gb", "p_bg"):
                if key not in fields:
                    raise ValueError(f"{key} is missing (ge:p_gb=P,p_bg=R)")
            return GilbertElliott(**fields)
        if kind == "netem":
            return _parse_netem(args)
        if kind == "trace":
            if not args.strip():
                raise ValueError("PATH is missing (trace:PATH)")
            return Trace(args.strip())
        raise ValueError(f"unknown loss model {kind!r}; {_SPEC_HELP}")
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"bad loss spec {text!r}: {err}") from None


# -- labels: one scheme for run directories, summary.csv and reports ----------------------------
# A family's short name (summary.csv's ``loss_model``, run directory prefixes) and how a report
# writes it. Bernoulli's burst follows from its rate; the others carry their mean burst.
FAMILIES = {"none": "no loss", "bernoulli": "Bernoulli", "ge": "Gilbert-Elliott", "4state": "4-state",
            "trace": "trace"}


def family(model: Union[str, LossModel]) -> str:
    """``none``, ``bernoulli``, ``ge``, ``4state`` or ``trace``."""
    model = parse_loss_model(model)
    if model.lossless:
        return "none"
    for cls, name in ((Bernoulli, "bernoulli"), (GilbertElliott, "ge"), (FourState, "4state"), (Trace, "trace")):
        if isinstance(model, cls):
            return name
    return type(model).__name__.lower()


def label(model: Union[str, LossModel]) -> str:
    """A short, file-name-safe label: ``none``, ``bernoulli-0.01``, ``ge-0.05-b8``, ``4state-0.0123-b2.5``."""
    model = parse_loss_model(model)
    name = family(model)
    if name == "none":
        return name
    if name == "bernoulli":
        return f"bernoulli-{model.p:g}"
    return f"{name}-{model.loss_rate:.3g}-b{model.mean_burst:.3g}"


def display_name(name: str, mean_burst: float = float("nan")) -> str:
    """How a report names a family: ``Bernoulli``, ``Gilbert-Elliott (burst 8)``."""
    shown = FAMILIES.get(name, name)
    return shown if name in ("none", "bernoulli") or mean_burst != mean_burst else f"{shown} (burst {mean_burst:.3g})"
