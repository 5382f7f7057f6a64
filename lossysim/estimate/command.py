"""``lossysim estimate``: its flags (``grid.add_arguments``), then a named shape's grid (``grid.run``) or, with
``--trace``, the user's own job (``traced.run``). The one place that knows both, so neither imports the other's
caller."""
from __future__ import annotations

from . import events, hours
from .grid import add_arguments as grid_arguments


def add_arguments(parser) -> None:
    """The command's flags (lossysim.cli calls it here): the grid's, then ``--hours``'s."""
    grid_arguments(parser)
    hours.add_arguments(parser)


def run(args) -> int:
    hours.check(args)
    if args.trace:
        from .traced import run as run_trace
        return run_trace(args)
    from .grid import run as run_named
    # with --hours, the link events are the hours' schedule: the step's run is not their whole span
    span = args.hours * 3600 if getattr(args, "hours", None) is not None and hours.given(args).strip() else None
    with events.checked_over(span):
        code = run_named(args)
    if code == 0 and getattr(args, "hours", None) is not None:
        hours.report(args)
    return code
