"""Both notebooks execute headless (nbclient) on a tiny real sweep; the report works on it too."""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from lossysim import cli
from lossysim.results import report, sections
from test_sweep import tiny_spec

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    """A real sweep with the trainer: baseline, Bernoulli and Gilbert-Elliott, a few steps each."""
    tmp = tmp_path_factory.mktemp("nb")
    spec = tiny_spec(tmp / "tiny.yaml", ["none", "bernoulli:0.1", "ge:rate=0.1,burst=4"])
    out = tmp / "results"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--no-progress"]) == 0
    return out


def execute(name: str, **parameters) -> nbformat.NotebookNode:
    """Run a notebook as Jupyter would (from notebooks/), with its parameter cell rewritten."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    (cell,) = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    lines = cell.source.splitlines()
    for key, value in parameters.items():
        hits = [i for i, line in enumerate(lines) if line.split("=")[0].strip() == key]
        assert hits, f"{name}: no parameter {key}"
        lines[hits[0]] = f"{key} = {value!r}"
    cell.source = "\n".join(lines)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return notebook


def outputs(notebook, kind: str) -> list:
    found = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if kind == "error" and output.output_type == "error":
                found.append(output)
            elif kind == "text" and output.output_type == "stream":
                found.append(output.text)
            elif kind in output.get("data", {}):
                found.append(output["data"][kind])
    return found


@pytest.mark.parametrize("name", ["analysis.ipynb", "loss_models.ipynb"])
def test_notebooks_are_committed_without_outputs(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    assert "parameters" in code[0].metadata.get("tags", []), "the parameter cell comes first"


def test_analysis_notebook_runs_on_a_tiny_sweep(tiny_results):
    notebook = execute("analysis.ipynb", RESULTS=str(tiny_results))
    assert not outputs(notebook, "error")
    text = "".join(outputs(notebook, "text"))
    assert f"3 runs in {tiny_results}" in text and "synthetic" in text
    # accuracy against time, against loss, observed loss, accuracy over steps, disagreement (lossy is not
    # varied: no fwd/bwd plot)
    assert len(outputs(notebook, "image/png")) == 5
    assert "did not vary `lossy`" in text and "target: " in text
    tables = "".join(outputs(notebook, "text/html"))
    assert "Gilbert-Elliott (burst 4)" in tables and "Bernoulli" in tables
    assert "vs no loss, paired (pp)" in tables and "paired_p" in tables


def test_report_on_a_tiny_real_sweep(tiny_results, tmp_path):
    written = report.write_report(tiny_results, tmp_path)
    pngs = [p for p in written["files"] if p.suffix == ".png"]
    assert {p.name for p in pngs} == set(sections.PLOTS) - {"fwd_vs_bwd.png"}
    assert all(p.stat().st_size > 10_000 for p in pngs)
    md = (tmp_path / "report.md").read_text()
    assert "synthetic" in md and "| 10 " in md and "| 0 (no loss)" in md
    assert set(written["runs"]["status"]) == {"completed"} and len(written["table"]) == 3


def test_loss_models_notebook_matches_theory():
    # Fewer packets than the default keeps the test quick; the notebook's own asserts compare
    # the simulation with the closed forms, so an execution error is a disagreement.
    notebook = execute("loss_models.ipynb", PACKETS=400_000)
    assert not outputs(notebook, "error")
    assert "agree with the closed forms" in "".join(outputs(notebook, "text"))
    assert len(outputs(notebook, "image/png")) == 2
