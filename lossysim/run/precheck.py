"""What a sweep checks before it trains any run: settings ``train`` would refuse against the model's
shape (``refuse``), and models, tokenizers and data sets this machine cannot load (``check_inputs``).

Settings are checked from the config and the shape alone (no weights, no data).

The checks are the ones training makes: ``tp_size`` against the heads and widths (``Shape.check_tp``, built
on ``parallelize``'s own ``head_counts``), each size an axis's declaration checks against the shape
(``Axis.fits``: the experts'), ``pp_size`` / ``pp_layout`` against the depth (``stage_layout``). Shapes the
estimate knows (the runner's tiny shapes, published models, a local config) are built once each on the meta
device; any other model is left to training.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Optional

from .. import axes
from ..config import ExperimentConfig
from ..results.table import FINISHED, run_status


@lru_cache(maxsize=None)
def _shape(model: str):
    from ..estimate import shapes   # transformers loads only when a sweep checks its runs
    if model not in shapes.NAMES and not Path(model).exists():
        return None
    try:
        return shapes.load(model)
    except ValueError:   # not a config the estimate reads: training (or check_inputs) says why
        return None


@lru_cache(maxsize=None)
def _refusal(model: str, tp: int, sizes: tuple, pp: int, pp_layout: Optional[str]) -> Optional[str]:
    shape = _shape(model)
    if shape is None:
        return None
    from ..pp.stages import stage_layout
    try:
        shape.check_tp(tp)
        for name, size in sizes:   # (axis, size) of every axis that checks its size against the shape
            axes.get(name).fits(shape, size)
        stage_layout(pp_layout, pp, shape.layers)
    except ValueError as err:
        return str(err).strip().splitlines()[0]
    return None


def refusal(config: ExperimentConfig) -> Optional[str]:
    """The one line ``train`` would refuse ``config`` with for its model's shape; None when the shape fits
    (or is not known without loading the model)."""
    from ..config.fabric import training_refusal
    if training_refusal(config):
        return training_refusal(config)
    sizes = tuple((axis.name, getattr(config, axis.size)) for axis in axes.AXES if axis.fits is not None)
    return _refusal(config.model, config.tp_size, sizes, config.pp_size, config.pp_layout)


def refused(runs: list) -> dict[str, str]:
    """dir_name -> why train would refuse it, for each of ``runs`` whose settings do not
    fit its model."""
    found = {run.dir_name: refusal(run.config) for run in runs}
    return {name: why for name, why in found.items() if why is not None}


def refuse(runs: list) -> None:
    """Raise one line when train would refuse some runs' settings (``refused``), before any run trains."""
    why = refused(runs)
    if why:
        name, first = next(iter(why.items()))
        raise ValueError(f"{len(why)} of the {len(runs)} runs have settings train refuses, so no run was started "
                         f"(--dry-run lists them): {name}: {first}")


# -- what the runs need -----------------------------------------------------------------------------
# Words of the one-line reasons that say a failure comes from this machine, not from the run's
# settings: the same for every run that needs the same model, tokenizer and data.
ENVIRONMENTAL = ("could not be reached", "offline mode is on", "not in the local cache", "file not found",
                 "No such file", "not enough free space", "is not writable")


def needs(config: ExperimentConfig) -> tuple[tuple[str, str], ...]:
    """(kind, name) of the model, tokenizer and data set a run loads."""
    tokenizer = config.tokenizer
    if tokenizer == "auto":   # as data.tokenizers.tokenizer_spec
        tokenizer = "bpe" if config.model in _named_shapes() else config.model
    return (("model", config.model), ("tokenizer", tokenizer), ("dataset", config.dataset))


def _named_shapes() -> tuple[str, ...]:
    from ..models.shapes import NAMED_SHAPES
    return tuple(NAMED_SHAPES)


def _check(kind: str, name: str) -> None:
    """Raise the run's own one-line reason when ``name`` cannot be loaded on this machine."""
    if kind == "model":
        if name not in _named_shapes():
            from ..models.build import check_model
            check_model(name)
    elif kind == "tokenizer":
        if name not in ("bpe", "bytes"):
            from ..data.tokenizers import load_pretrained_tokenizer
            load_pretrained_tokenizer(name)
    elif name != "synthetic":
        from ..data.sources import MNLI, _hub_sources, dataset_identity
        dataset_identity(name)   # a local path: its files exist
        if name == MNLI:
            _hub_sources()


def check_inputs(runs: list) -> None:
    """Load each distinct model, tokenizer and data set the unfinished runs need, once; raise one
    line naming the first that cannot be loaded and how many runs need it."""
    todo = [r for r in runs if run_status(r.run_dir) not in FINISHED]
    counts: dict[tuple[str, str], int] = {}
    for r in todo:
        for need in needs(r.config):
            counts[need] = counts.get(need, 0) + 1
    for (kind, name), count in counts.items():
        try:
            _check(kind, name)
        except (ValueError, OSError) as err:
            text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"{kind} {name!r} cannot be loaded here, so {count} of the {len(todo)} runs "
                             f"to do would fail; no run was started: {text}") from None


def environmental(error: Optional[str]) -> bool:
    return bool(error) and any(word in error for word in ENVIRONMENTAL)
