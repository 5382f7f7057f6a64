"""``lossysim estimate``: its flags (``grid.add_arguments``), then a named shape's grid (``grid.run``) or, with
``--trace``, the user's own job (``traced.run``). The one place that knows both, so neither imports the other's
caller."""
from __future__ import annotations

from .grid import add_arguments  # noqa: F401  (the command's flags: lossysim.cli calls it here)


def run(args) -> int:
    if args.trace:
        from .traced import run as run_trace
        return run_trace(args)
    from .grid import run as run_named
    return run_named(args)
