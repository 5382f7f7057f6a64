"""The ``lossysim`` command: one subcommand per module, each imported only when used.

A subcommand's module provides ``add_arguments(parser)`` and ``run(args) -> int``.
Bad input (a command-line mistake, ValueError, FileNotFoundError, OSError) ends with a one-line error and exit 2; any
other exception with a one-line error naming its type and exit 1 (``-v`` prints the traceback); Ctrl-C with one
line and exit 130.
Training failures never get here: the runner records them in the run's summary.json.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys

SUBCOMMANDS = {
    "demo": ("lossysim.loss.demo", "sample each loss model: configured vs observed statistics"),
    "train": ("lossysim.run.command", "train one tensor-parallel model under packet loss"),
    "sweep": ("lossysim.run.sweep", "run a grid of experiments (resumable, shardable)"),
    "report": ("lossysim.results.report", "plots and a markdown table from a results folder"),
    "fit": ("lossysim.loss.fit", "fit loss models to a measured loss trace and recommend one"),
    "estimate": ("lossysim.estimate.command", "what packet loss costs a real model's training step, in seconds"),
    "budget": ("lossysim.budget.command", "per traffic family, the loss rate a pretrained model's training tolerates"),
}


class _Parser(argparse.ArgumentParser):
    """A command-line mistake is one line and exit 2, as every other bad input (``--help`` has the usage)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv=None) -> int:
    parser = _Parser(prog="lossysim", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module_name)
        # Only the chosen subcommand's module is imported (torch, transformers are slow to load).
        if name == _chosen(argv):
            importlib.import_module(module_name).add_arguments(sub_parser)
            if not any(action.dest == "threads" for action in sub_parser._actions):
                from .config.execution import DEFAULT_THREADS
                sub_parser.add_argument("--threads", type=int, metavar="N",
                                        help=f"torch's intra-op threads (default {DEFAULT_THREADS})")
    args, unknown = parser.parse_known_args(argv)
    if unknown:   # said by the subcommand, with the nearest of its flags (argparse says "lossysim: error")
        chosen = sub.choices[args.command]
        chosen.error(f"unrecognized arguments: {' '.join(unknown)}{_nearest(unknown, chosen)}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from .hub import quiet_retries
    quiet_retries()   # hub retry warnings at most once (all of them with -v)
    try:
        # Every command's, and the processes it starts'; train's flag is a config key, and train and sweep set
        # each run's own from its config.
        from .config.execution import DEFAULT_THREADS, use_threads
        threads = getattr(args, "threads", None)
        use_threads(threads if isinstance(threads, int) else DEFAULT_THREADS)
        return int(importlib.import_module(args._module).run(args) or 0)
    except (ValueError, OSError) as err:
        print(f"lossysim {args.command}: error: {_one_line(err)}", file=sys.stderr)
        _tell_launcher(_one_line(err))
        return 2
    except KeyboardInterrupt:   # Ctrl-C: what each command keeps is its own (a run's checkpoints, an estimate's rows)
        print(f"lossysim {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # a bug or an input nobody foresaw: still no traceback unless asked
        logging.getLogger("lossysim").debug("unexpected error", exc_info=True)
        print(f"lossysim {args.command}: error: {type(err).__name__}: {_one_line(err)}"
              + ("" if args.verbose else " (run with -v for the traceback)"), file=sys.stderr)
        return 1


def _tell_launcher(line: str) -> None:
    """A sweep launching torchrun reads why its ranks refused a run here (stderr goes to the terminal)."""
    path = os.environ.get("LOSSYSIM_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError), open(path, "a") as f:
            f.write(line + "\n")


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _nearest(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """`` (did you mean --steps?)`` for the first mistyped flag that is close to one of ``parser``'s, or how to
    give a positional argument spelled as a flag."""
    from .util import nearest
    names = [flag[2:] for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    positional = {action.dest.replace("_", "-") for action in parser._actions if not action.option_strings}
    for word in unknown:
        if word.startswith("--"):   # compared without the dashes, which every flag shares
            name = word[2:].split("=")[0]
            if name in positional:   # `estimate --model X`, as `train --model X` is spelled
                return f" ({name} takes no flag: {parser.prog} {name.upper()} ...)"
            close = nearest(name, names)
            if close:
                return f" (did you mean --{close}?)"
    return ""


def _chosen(argv) -> str:
    argv = sys.argv[1:] if argv is None else list(argv)
    return next((a for a in argv if a in SUBCOMMANDS), "")


if __name__ == "__main__":
    sys.exit(main())
