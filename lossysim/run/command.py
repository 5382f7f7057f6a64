"""``lossysim train``: one experiment from a config file, ``--set key=value`` and flags (``run_experiment``
in ``run/experiment.py`` trains it).

Its flags are built from the tuples that define their values, none of which loads transformers or the
training path: a mistyped flag is refused at once, and only a run that starts loads them."""
from __future__ import annotations

import sys

from .. import axes
from ..config import BACKENDS, DEFAULT_THREADS, coerce, load_config, parse_overrides
from ..config.fabric import add_fabric_arguments, fabric_overrides
from ..data.examples import MNLI, SYNTHETIC
from ..data.pydoc_text import PYDOC
from ..models.pretrained import PACKAGED
from ..models.shapes import NAMED_SHAPES
from ..net.algorithms import ALGORITHMS
from ..net.recovery import RECOVERY_POLICIES
from ..net.spec import LOSSY
from ..net.transport import TRANSPORTS
from ..timing import NIC_PRESETS
from ..util import one_of

# CLI flags for the common settings; everything else goes through --set key=value. Every list of
# values is written from the tuple that defines it (tests/test_cli_help.py holds them to it). Each axis's
# flags come from its declaration (``lossysim.axes``), after --loss.
_FLAGS = {
    "--backend": ("backend", f"{one_of(BACKENDS)} (sim: all ranks in one process; dist: torchrun)"),
    "--lossy": ("lossy", f"which traffic is lossy: {one_of(LOSSY)}"),
    "--recovery": ("recovery", f"what a receiver makes of a lost packet: {one_of(RECOVERY_POLICIES)}"),
    "--algorithm": ("algorithm", f"collective algorithm: {one_of(ALGORITHMS)}"),
    "--transport": ("transport", f"whether and how a lost packet is repaired: {one_of(TRANSPORTS)}"),
    "--nic": ("nic", f"how lost packets are detected and repaired: {one_of(NIC_PRESETS)}"),
    "--model": ("model", f"a named model, {one_of((*NAMED_SHAPES, *PACKAGED))} (random weights but "
                         f"{', '.join(PACKAGED)}: pretrained, the real extra); or a HF name or a local directory"),
    "--dataset": ("dataset", f"{one_of((SYNTHETIC, MNLI, PYDOC))} (task lm only); or a local directory or file"),
    "--max-train-samples": ("max_train_samples", "cap on training examples"),
    "--max-eval-samples": ("max_eval_samples", "cap on examples per eval split"),
    "--steps": ("steps", "optimizer steps"),
    "--seed": ("seed", "seed of data order, init, masks and dropout"),
    "--out": ("out", "run directory"),
    "--threads": ("threads", f"torch's intra-op threads (default {DEFAULT_THREADS}); speed, never results"),
}


def flags() -> dict:
    """Every ``lossysim train`` flag: flag -> (config key, help)."""
    declared = {s.flag: (s.field, s.help) for s in axes.settings() if s.flag}
    return {"--loss": ("loss", "loss model spec, e.g. bernoulli:0.01 or ge:rate=0.01,burst=8"), **declared, **_FLAGS}


def add_arguments(parser) -> None:
    parser.add_argument("--config", help="experiment YAML (see experiments/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key (repeatable)")
    for flag, (key, help_text) in flags().items():
        parser.add_argument(flag, dest=key, help=help_text)
    add_fabric_arguments(parser)
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in --out (see checkpoint_every)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    overrides = {}
    for pair in args.set:   # each checked: a bad value is refused even where a later --set or a flag replaces it
        overrides.update(coerce(parse_overrides([pair])))
    overrides.update({key: getattr(args, key) for _, (key, _) in flags().items()
                      if getattr(args, key, None) is not None})
    overrides.update(coerce(fabric_overrides(args)))
    config = load_config(args.config, overrides)
    from .experiment import run_experiment   # the training path loads here
    summary = run_experiment(config, config.out, progress=not args.no_progress, resume=args.resume)
    if summary["status"] != "completed":
        print(f"lossysim train: {summary['status']}: {summary.get('error') or ''}".rstrip(": "), file=sys.stderr)
        return 1
    return 0
