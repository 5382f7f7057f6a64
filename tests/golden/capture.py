"""Write tests/golden/runs.json: short lossy runs, every number they report.

Run by hand, on the code whose numbers are to be kept (``python tests/golden/capture.py``), and
only when a change is meant to move a number (say which, and why, in the commit);
``tests/test_golden.py`` then checks that today's code reproduces every number in it exactly.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from golden_runs import CASES, KEYS, config_for  # noqa: E402


def main() -> None:
    from lossysim.io import read_jsonl
    from lossysim.run.experiment import run_experiment
    torch.set_num_threads(1)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in CASES:
            config = config_for(name, Path(tmp) / name)
            summary = run_experiment(config, config.out, progress=False)
            assert summary["status"] == "completed", summary.get("error")
            rows = read_jsonl(Path(config.out) / "metrics.jsonl")
            out[name] = [{k: row[k] for k in ("step", "split", *KEYS) if k in row} for row in rows]
            print(name, len(rows), "rows")
    (HERE / "runs.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
