"""``--hours H`` with ``--link-event``: the given schedule over the hours counts beside the MTTF's
failures, by the step's rules: a flap of period P down past the retry budget is H h / P interruptions,
one down less than it only stalls (to the first retry after the path is back); a down longer than a
give-up and a restart fails again after the restart; a cable outside the job's reach costs nothing;
events outside the hours are one line, exit 2; without events the figures are as they were."""
import json
import math

import pytest

from lossysim.cli import main
from lossysim.estimate import hours_events
from lossysim.fabric.events import REROUTE_S
from lossysim.fabric.presets import parse_fabric
from lossysim.timing.retransmission import NIC_PRESETS, ib_timeout_s, outage_waits

FABRIC = "leaf-spine:nodes=4,leaves=2,spines=2"
NIC_CABLE, SWITCH_CABLE = "node0.nic0-leaf0", "leaf0-spine0"
TAU = ib_timeout_s(20)
WAITS = outage_waits(NIC_PRESETS["roce-gbn-timeout"], 20)
GIVE_UP = sum(WAITS)
RESTART, CHECKPOINT = 300.0, 1800.0
BASE = ["estimate", "tiny", "--tp-size", "1", "--dp-size", "2", "--ranks-per-node", "1", "--seq", "8",
        "--steps", "1", "--no-progress", "--fabric", FABRIC]


def _cost(events: str, hours: float = 1.0, reroute: str = "ecmp", nodes: int = 2):
    schedule = hours_events.schedule(events, parse_fabric(FABRIC), hours)
    return hours_events.cost(schedule, nodes, REROUTE_S[reroute], WAITS, RESTART, CHECKPOINT)


def test_the_waits_are_the_ack_timeout_eight_times():
    # (the closed forms below count retries of TAU each: 7 retries, then one more wait before giving up)
    assert WAITS == pytest.approx([TAU] * 8) and round(GIVE_UP, 1) == 34.4


@pytest.mark.parametrize("hours, period", [(1, 600), (2, 450), (0.5, 300)])
def test_a_flap_down_past_the_budget_is_an_interruption_a_period(hours, period):
    out = _cost(f"{NIC_CABLE}:flap:at=0,period={period},down=60", hours)
    n = hours * 3600 / period
    assert out.outages == out.interruptions == n and out.stalls == 0 and out.stalled_s == 0
    assert out.lost_s == pytest.approx(n * (GIVE_UP + RESTART + CHECKPOINT / 2))


def test_a_flap_down_less_than_the_budget_only_stalls():
    out = _cost(f"{NIC_CABLE}:flap:at=0,period=600,down=10")
    # back at 10 s: the first retry at or after it is the third, 3 TAU after the outage began
    assert math.ceil(10 / TAU) == 3
    assert out.interruptions == 0 and out.outages == out.stalls == 6
    assert out.stalled_s == pytest.approx(6 * 3 * TAU) and out.lost_s == pytest.approx(out.stalled_s)


def test_a_switch_cable_is_routed_around_unless_routes_do_not_move():
    down = f"{SWITCH_CABLE}:flap:at=0,period=600,down=60"
    around = _cost(down)      # ECMP's 1 s: the first retry after it, TAU in
    assert around.interruptions == 0 and around.stalled_s == pytest.approx(6 * TAU)
    assert _cost(down, reroute="none").interruptions == 6


def test_a_long_down_fails_again_after_each_restart():
    out = _cost(f"{SWITCH_CABLE}:down:at=100,for=1000", reroute="none")
    # fails at 134.4, back from its restart at 434.4 (still down), fails again ... until a restart ends past 1100
    n = math.ceil(1000 / (GIVE_UP + RESTART))
    assert n == 3 and out.outages == 1 and out.interruptions == n
    assert out.lost_s == pytest.approx(n * (GIVE_UP + RESTART) + CHECKPOINT / 2)


def test_a_cable_outside_the_jobs_reach_costs_nothing():
    out = _cost("node3.nic0-leaf1:flap:at=0,period=600,down=60")
    assert out.outages == out.interruptions == 0 and out.lost_s == 0


def test_the_command_counts_them_in_the_hours_line_and_json(tmp_path, capsys):
    assert main([*BASE, "--hours", "10", "--out", str(tmp_path / "none")]) == 0
    plain = capsys.readouterr().out
    assert "link events'" not in plain
    flap = f"{NIC_CABLE}:flap:at=0,period=3600,down=60"     # an hour's interruption every hour
    assert main([*BASE, "--hours", "10", "--link-event", flap, "--link-event", f"{SWITCH_CABLE}:down:at=100,for=1000",
                 "--out", str(tmp_path / "events")]) == 0
    out = capsys.readouterr().out
    assert "(the link events' 11 outages: 10 interruptions, 1 stalls of" in out
    before = json.loads((tmp_path / "none" / "hours.json").read_text())
    after = json.loads((tmp_path / "events" / "hours.json").read_text())
    assert after["event_interruptions"] == 10 and after["event_stalls"] == 1
    assert after["event_stalled_s"] == pytest.approx(TAU)      # the switch cable's down, routed around after 1 s
    assert after["interruptions"] == pytest.approx(before["interruptions"] + 10)
    lost_s = 10 * (GIVE_UP + RESTART + CHECKPOINT / 2) + TAU
    assert after["gpu_hours_lost"] == pytest.approx(before["gpu_hours_lost"] + after["gpus"] * lost_s / 3600)
    assert after["effective"] == pytest.approx(before["effective"] - lost_s / 36000)
    assert 0 < after["effective"] < before["effective"]
    assert {k: v for k, v in after.items() if k in before and k not in ("interruptions", "gpu_hours_lost",
                                                                         "effective")} == \
        {k: v for k, v in before.items() if k not in ("interruptions", "gpu_hours_lost", "effective")}


@pytest.mark.parametrize("event, message", [(f"{NIC_CABLE}:down:at=4000,for=10", "outside --hours 1 (3600 s)"),
                                            (f"{NIC_CABLE}:down:at=3000,for=1000", "outside --hours 1 (3600 s)"),
                                            ("leaf9-spine0:down:at=0,for=1", "leaf9-spine0")])
def test_events_outside_the_hours_are_one_line(event, message, capsys):
    assert main([*BASE, "--hours", "1", "--link-event", event]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
