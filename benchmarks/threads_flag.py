"""The benchmarks' ``--threads``: one torch thread unless told (as every lossysim process), set before
anything is timed and printed beside the figures."""
from __future__ import annotations

import argparse

from lossysim.config.execution import use_threads


def parse_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``parser``'s arguments with ``--threads`` among them, the threads already set and printed."""
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's intra-op threads (default 1, as every lossysim process)")
    args = parser.parse_args()
    use_threads(args.threads)
    print(f"threads: {args.threads} (torch intra-op, OMP_NUM_THREADS)")
    return args
