"""``lossysim demo``: runs through the CLI and prints observed statistics that agree with the models."""
from __future__ import annotations

import math

import pytest

from lossysim.loss import demo
from lossysim.cli import main
from lossysim.loss import parse_loss_model


def test_demo_prints_a_row_per_model(capsys):
    assert main(["demo", "--packets", "20000"]) == 0
    out = capsys.readouterr().out
    assert "20,000 packets per model" in out
    for column in ("loss_rate", "observed_loss_rate", "mean_burst", "observed_mean_burst"):
        assert column in out
    for spec in demo.DEMO_SPECS:
        assert spec in out


def test_demo_table_agrees_with_closed_forms():
    df = demo.table(20000, seed=0)
    assert len(df) == len(demo.DEMO_SPECS)
    for row in df.itertuples():
        model = parse_loss_model(row.model)
        assert (row.loss_rate, row.mean_burst) == (model.loss_rate, model.mean_burst)
        if model.lossless:
            assert row.observed_loss_rate == 0 and math.isnan(row.rate_z)
        else:
            assert row.observed_loss_rate > 0 and abs(row.rate_z) < 5
    assert df.equals(demo.table(20000, seed=0))
    assert not df.observed_loss_rate.equals(demo.table(20000, seed=1).observed_loss_rate)


def test_demo_counts_runs_across_chunks(monkeypatch):
    """Chunked sampling (bounded memory) gives the same counts as one draw of the same chain."""
    model = parse_loss_model("ge:rate=0.2,burst=30")
    whole = demo.table(5000, seed=2, specs=["ge:rate=0.2,burst=30"])
    monkeypatch.setattr(demo, "_CHUNK", 5000)
    assert demo.table(5000, seed=2, specs=["ge:rate=0.2,burst=30"]).equals(whole)
    monkeypatch.setattr(demo, "_CHUNK", 7)  # a different split of a chain: same statistics, not bits
    split = demo.table(20_000, seed=2, specs=["ge:rate=0.2,burst=30"]).iloc[0]
    se = math.sqrt(model.variance_per_packet / 20_000)
    assert abs(split.observed_loss_rate - model.loss_rate) < 5 * se
    assert split.observed_mean_burst > 15  # runs were not cut at chunk edges (7 packets)


@pytest.mark.parametrize("packets", ["0", "1.5", "many"])
def test_demo_rejects_bad_packet_counts(packets, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--packets", packets])
    assert exit_.value.code == 2
    assert "--packets" in capsys.readouterr().err
