"""A sweep refuses runs train would refuse before training any, and keeps the record of every spec swept
into one folder (sweep.yaml: the newest, with its runs' names; earlier ones beside it)."""
from __future__ import annotations

import yaml

from lossysim import cli
from lossysim.io import expected_runs
from lossysim.run import sweep

from test_sweep import recorder, write_spec  # noqa: F401 (the fixture)


def test_runs_train_refuses_are_named_by_the_dry_run_and_stop_the_sweep_before_any_trains(tmp_path, recorder,
                                                                                          capsys):
    spec = write_spec(tmp_path / "s.yaml", {"tp_size": [2, 3], "seed": [0, 1]})   # tiny has 4 heads
    out = tmp_path / "out"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--dry-run"]) == 2
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    refused = [line for line in lines if " refused " in line]
    assert len(refused) == 2 and all("_tp3_" in line and "tp_size=3 does not divide n_head=4" in line
                                     for line in refused)
    assert sum(" todo " in line for line in lines) == 2
    assert "2 of the 4 runs have settings train refuses" in captured.err and len(captured.err.splitlines()) == 1
    assert cli.main(["sweep", str(spec), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "tp_size=3 does not divide n_head=4" in err and len(err.splitlines()) == 1
    assert recorder.calls == [] and not out.exists()
    # The runs that fit train as before.
    spec = write_spec(tmp_path / "s.yaml", {"tp_size": [2, 4], "seed": [0]})
    assert cli.main(["sweep", str(spec), "--out", str(out), "--no-progress"]) == 0
    assert len(recorder.calls) == 2


def test_refusals_are_trains_own_for_pipeline_stages_and_experts(tmp_path):
    spec = write_spec(tmp_path / "s.yaml", {"pp_size": [1, 2, 3]}, tp_size=1, batch_size=12)
    why = sweep.refused(sweep.expand(sweep.load_spec(spec), tmp_path / "out"))
    assert list(why.values()) == ["pp_size=3 does not divide the model's 2 layers: set pp_layout (blocks per stage, "
                                  "e.g. 1,3) for an uneven split"]
    spec = write_spec(tmp_path / "s.yaml", {"ep_size": [2, 3]}, model="tiny-moe", tp_size=1, dp_size=6, batch_size=12)
    why = sweep.refused(sweep.expand(sweep.load_spec(spec), tmp_path / "out"))
    assert list(why.values()) == ["ep_size=3 does not divide the 8 experts of tiny-moe"]


def test_sweep_yaml_lists_every_shards_runs(tmp_path, recorder):
    spec = write_spec(tmp_path / "s.yaml", {"loss": ["none", "bernoulli:0.01", "bernoulli:0.05"]})
    out = tmp_path / "out"
    assert cli.main(["sweep", str(spec), "--out", str(out), "--shard", "1/2", "--no-progress"]) == 0
    every = [r.dir_name for r in sweep.expand(sweep.load_spec(spec), out)]
    assert expected_runs(out) == every and len(recorder.calls) < len(every)


def test_a_second_spec_keeps_the_first_specs_record_and_resuming_changes_nothing(tmp_path, recorder, capsys):
    out = tmp_path / "out"
    first = write_spec(tmp_path / "a.yaml", {"seed": [0]})
    assert cli.main(["sweep", str(first), "--out", str(out), "--no-progress"]) == 0
    record = (out / "sweep.yaml").read_text()
    stamp = (out / "sweep.yaml").stat().st_mtime_ns
    assert cli.main(["sweep", str(first), "--out", str(out), "--no-progress"]) == 0   # resumed: silent
    assert "sweep.yaml" not in capsys.readouterr().err
    assert (out / "sweep.yaml").read_text() == record and (out / "sweep.yaml").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in out.glob("sweep*.yaml")) == ["sweep.yaml"]

    second = write_spec(tmp_path / "b.yaml", {"seed": [1]}, name="u")
    assert cli.main(["sweep", str(second), "--out", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "held another spec (t): kept as" in err and "sweep.1.yaml" in err
    assert (out / "sweep.1.yaml").read_text() == record
    newest = yaml.safe_load((out / "sweep.yaml").read_text())
    assert newest["name"] == "u" and newest["grid"] == {"seed": [1]} and len(newest["runs"]) == 1
    # Back and forth: each spec's record is kept once.
    assert cli.main(["sweep", str(first), "--out", str(out), "--no-progress"]) == 0
    assert "sweep.2.yaml" in capsys.readouterr().err
    assert yaml.safe_load((out / "sweep.2.yaml").read_text())["name"] == "u"
    assert cli.main(["sweep", str(second), "--out", str(out), "--no-progress"]) == 0
    assert "kept as" in capsys.readouterr().err and (out / "sweep.1.yaml").read_text() == record
    assert sorted(p.name for p in out.glob("sweep*.yaml")) == ["sweep.1.yaml", "sweep.2.yaml", "sweep.yaml"]
