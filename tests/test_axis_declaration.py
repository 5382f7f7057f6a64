"""A parallelism is declared once: an axis declared here, inside the test (one traffic class, one setting,
one counter), is found in the config, the commands' --help, a run's metrics and summary.json, summary.csv,
the report and the estimate's columns, with no other file edited; and it is gone once taken back. The
built-in axes' declarations import no torch (config reads them first)."""
from __future__ import annotations

import ast
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lossysim import axes, traffic
from lossysim.axes import Axis, Column, Counter, EstimateFlag, Section, Setting
from lossysim.traffic import Direction, TrafficClass
from tiny_runs import tiny_run

ROOT = Path(__file__).resolve().parents[1]

# Rides on the data-parallel axis's groups (no mesh axis of its own), sends nothing: every figure of it
# is its declared default, 0.
ZZ = Axis(
    "zz", "ZZ", size="zz_size",
    settings=(Setting("zz_size", int, 1, "zz ranks of a throwaway axis", flag="--zz-size", minimum=1,
                      estimate=EstimateFlag("zz ranks of a throwaway axis (default 1)", default=1)),),
    traffic=(TrafficClass("zz", "dp", "ZZ", (Direction("fwd", "zz_forward", "ZZ messages"),)),),
    counters=(Counter("zz_s", 0.0, "what its messages add", per_step="zz_s_per_step"),),
    summary="zz_parallel",
    columns=(Column("zz_s_per_step", "zz_s_per_step"),),
    section=Section("ZZ parallelism", "Every setting, the runs with zz ranks (`zz`) beside the others. ",
                    "`ZZ per step`: what its messages add to a step."))


def _help(*argv: str) -> str:
    from lossysim.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*argv, "--help"])
    return out.getvalue()


def test_the_built_in_declarations_import_nothing_heavy():
    for path in [ROOT / "lossysim" / "axes.py", *sorted((ROOT / "lossysim").glob("*/axis.py"))]:
        tree = ast.parse(path.read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                  and not n.level}
        assert not names & {"torch", "numpy", "pandas", "transformers"}, path
    # and reading every axis imports no torch (nor its package's modules): a fresh interpreter
    code = ("import sys, lossysim.axes as a; names = [x.name for x in a.AXES]; "
            "print('torch' in sys.modules or 'lossysim.cp.context' in sys.modules)")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert found.stdout.strip() == "False"


def test_a_declared_axis_is_everywhere_and_gone_once_taken_back(tmp_path):
    from lossysim.config import ExperimentConfig, from_dict
    from lossysim.estimate.simulate import estimate
    from lossysim.estimate.workload import Workload, job_config
    from lossysim.results.report import write_report
    from lossysim.results.table import write_summary_csv
    from lossysim.run.experiment import run_experiment
    assert "zz_size" not in ExperimentConfig().to_dict()
    with axes.declared(ZZ):
        # the config: a field with its default, its check, its class's lossy_traffic key
        assert ExperimentConfig().zz_size == 1 and from_dict({"zz_size": 3}).zz_size == 3
        with pytest.raises(ValueError, match=r"^zz_size=0 must be >= 1$"):
            from_dict({"zz_size": 0})
        assert from_dict({"lossy_traffic": "zz_forward,tp_forward"}).lossy_directions("zz") == ("fwd",)
        # both commands' flags
        assert "--zz-size" in _help("train") and "zz ranks of a throwaway axis" in _help("train")
        assert "--zz-size" in _help("estimate")
        # a run: its counter in the metrics rows and its section in summary.json
        results = tmp_path / "results"
        config = tiny_run(results / "zz", zz_size=2, steps=2, log_every=1, eval_every=2, max_train_samples=32,
                          max_eval_samples=32)
        summary = run_experiment(config, config.out, progress=False)
        assert summary["status"] == "completed"
        assert summary["config"]["zz_size"] == 2
        assert summary["zz_parallel"] == {"zz_size": 2, "zz_s_per_step": 0.0}
        rows = [json.loads(line) for line in (results / "zz" / "metrics.jsonl").read_text().splitlines()]
        assert [r["zz_s_per_step"] for r in rows if r["split"] == "train"] == [0.0, 0.0]
        # summary.csv's column and the report's section
        frame = write_summary_csv(results)
        assert frame["zz_s_per_step"].tolist() == [0.0]
        write_report(results, tmp_path / "report")
        report = (tmp_path / "report" / "report.md").read_text()
        assert "## ZZ parallelism" in report and "ZZ per step (ms)" in report
        # the estimate's columns: its class's, zero where nothing sends it
        row = estimate("tiny", job_config("tiny", micro_batch=2), Workload(seq=8), steps=1)
        assert {row[f"zz_{name}"] for name in ("loss_free_s", "repair_s", "packets_sent", "elements_lost")} == {0.0}
        assert row["stack_zz_s"] == 0.0
    assert "zz_size" not in ExperimentConfig().to_dict() and "zz" not in traffic.BY_NAME
    assert "zz_forward" not in traffic.KINDS and "--zz-size" not in _help("train")
    with pytest.raises(ValueError, match="unknown config key 'zz_size'"):
        from_dict({"zz_size": 2})


def test_a_name_already_declared_is_refused():
    clash = Axis("zz", "ZZ", settings=(Setting("cp_size", int, 1, "taken"),))
    with pytest.raises(ValueError, match="setting 'cp_size' is declared already"):
        with axes.declared(clash):
            pass
    with pytest.raises(ValueError, match="axis 'cp' is declared already"):
        with axes.declared(Axis("cp", "CP")):
            pass
    assert [a.name for a in axes.AXES] == list(axes.BUILT_IN)


def test_summary_collectives_name_the_expert_networks(tmp_path):
    """summary.json's ``collectives`` lists every training network's NCCL choices, the experts' all-to-alls
    too (each TP position's group of replica 0), tagged with their class as the collectives table reads it."""
    from lossysim.run.experiment import run_experiment
    config = tiny_run(tmp_path / "moe", model="tiny-moe", tp_size=2, dp_size=2, ep_size=2, steps=1, log_every=1,
                      eval_every=1, max_train_samples=16, max_eval_samples=16)
    summary = run_experiment(config, config.out, progress=False)
    assert summary["status"] == "completed"
    networks = {r["network"] for r in summary["collectives"]}
    assert {"ep_dispatch.tp0", "ep_dispatch.tp1", "ep_combine.tp0", "ep_combine.tp1"} <= networks
    assert {r["collective"] for r in summary["collectives"] if r["network"].startswith("ep_")} == {"all_to_all"}
    assert {traffic.of_network(n).axis for n in networks} == {"tp", "dp", "ep"}


def test_link_events_are_refused_over_the_axes_that_declare_so():
    """Training's refusal of link events reads each axis's ``link_events``: a throwaway axis above 1 is
    refused only while it is declared so, the built-in cp as it declares."""
    import dataclasses
    from types import SimpleNamespace
    from lossysim.config.fabric import training_refusal
    config = dict(link_event="leaf0-spine0:down:at=0", transport="drop", pp_size=1, dp_size=2, checkpoint_every=0,
                  tp_size=1, cp_size=1, ep_size=1, zz_size=2)
    assert training_refusal(SimpleNamespace(**config)) is None
    with axes.declared(dataclasses.replace(ZZ, link_events=False)):
        assert "sizes above 1" in training_refusal(SimpleNamespace(**config))
    with axes.declared(ZZ):
        assert training_refusal(SimpleNamespace(**config)) is None
    assert "sizes above 1" in training_refusal(SimpleNamespace(**{**config, "cp_size": 2}))


def test_the_estimates_workload_holds_and_checks_the_axes_estimate_only_settings():
    """``Workload``'s fields after its own are every axis's ``workload`` flags, each checked as declared."""
    import dataclasses
    from lossysim.estimate.workload import Workload
    names = [f.name for f in dataclasses.fields(Workload)]
    assert names == ["seq", "grad_dtype", "sampled_groups", *(flag.field for flag in axes.workload_flags())]
    flag = next(flag for flag in axes.workload_flags() if flag.check is not None)
    assert getattr(Workload(), flag.field) == flag.default
    with pytest.raises(ValueError, match=rf"^{flag.field}=-1 must be"):
        Workload(**{flag.field: -1})
