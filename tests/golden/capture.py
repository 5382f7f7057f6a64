"""Write tests/golden/runs.json (every metrics row's numbers) and tests/golden/summaries.json (the
exact tables of each summary.json) for the short lossy runs in tests/golden_runs.py.

Run by hand, on the code whose numbers are to be kept (``python tests/golden/capture.py``), and
only when a change is meant to move a number (say which, and why, in the commit);
``tests/test_golden.py`` then checks that today's code reproduces them: exactly, but for the fp32
figures, which may move by ``FLOAT_RTOL`` from one CPU to another. runs.json was captured on an
AVX2 CPU; ``ATEN_CPU_CAPABILITY=avx2`` reproduces it bit for bit on an AVX-512 one.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from golden_runs import CASES, config_for, numbers  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    rows, summaries = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in CASES:
            got = numbers(config_for(name, Path(tmp) / name))
            rows[name], summaries[name] = got["rows"], got["summary"]
            print(name, len(got["rows"]), "rows")
    (HERE / "runs.json").write_text(json.dumps(rows, indent=1) + "\n")
    (HERE / "summaries.json").write_text(json.dumps(summaries, indent=1) + "\n")


if __name__ == "__main__":
    main()
