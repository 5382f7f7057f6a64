"""``lossysim estimate --hours H``: the job's expected cable failures after the step's table; without it,
the output is unchanged; bad values are one line and exit 2."""
import argparse
import json

import pytest

from lossysim.cli import main
from lossysim.estimate import hours
from lossysim.estimate.command import add_arguments
from lossysim.fabric import superpod
from lossysim.fabric.reliability import expected_cost, llama3_rates

BASE = ["estimate", "tiny", "--tp-size", "2", "--seq", "8", "--steps", "1", "--no-progress"]


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["tiny", *argv])


def test_the_figures_are_the_fabrics_expected_cost():
    args = _args("--tp-size", "8", "--pp-size", "16", "--dp-size", "128", "--hours", "720",
                 "--other-interruptions-per-day", "llama3")
    row = hours.figures(args)
    assert row["fabric"] == "superpod:64" and row["gpus"] == 16384 and row["nodes"] == 2048
    cost = expected_cost(superpod(64), 720, other_per_day=llama3_rates()["other_per_day"])
    assert row["interruptions"] == pytest.approx(cost.interruptions)
    assert row["effective"] == pytest.approx(cost.effective)
    small = hours.figures(_args("--tp-size", "8", "--dp-size", "64", "--hours", "720"))
    assert small["fabric"] == "superpod:2" and small["gpus"] == 512


def test_the_command_prints_and_writes_them(tmp_path, capsys):
    assert main([*BASE, "--hours", "24", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "24 h on superpod:2" in out and "effective training time" in out
    row = json.loads((tmp_path / "hours.json").read_text())
    assert row["hours"] == 24 and row["gpus"] == 2
    assert main(BASE) == 0
    assert "effective training time" not in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [(["--hours", "0"], "--hours"),
                                            (["--hours", "5", "--other-interruptions-per-day", "x"], "other"),
                                            (["--hours", "5", "--reroute", "bgp"], "invalid choice")])
def test_bad_values_are_one_line(extra, message, capsys):
    try:
        code = main([*BASE, *extra])
    except SystemExit as stop:          # a flag's own mistake: argparse's one line
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
