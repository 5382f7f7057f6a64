"""Link events: parsing and refusals, a cable's state in time, and when a call crossing a down, flapping
or slowed cable ends, against the closed forms of the transport's retry budget."""
import math

import numpy as np
import pytest

from lossysim.fabric import Routes, leaf_spine
from lossysim.fabric.events import (REROUTE_S, LinkSchedule, call_end, load_link_events, parse_link_event,
                                    run_steps)
from lossysim.fabric.load import Flow, cable_loads
from lossysim.timing.retransmission import NIC_PRESETS, ib_timeout_s, outage_waits, rc_give_up_s

RC = NIC_PRESETS["roce-gbn-timeout"]
TAU = ib_timeout_s(20)
NIC_CABLE = "node0.nic0-leaf0"


@pytest.fixture(scope="module")
def small():
    """4 nodes, 2 leaves, 2 spines; a flow from node 0 to node 2 crosses its NIC cable, one uplink, one
    downlink and the far NIC cable."""
    fabric = leaf_spine(nodes=4, leaves=2, spines=2)
    loads = cable_loads(Routes(fabric, 1), [Flow(0, 2, 1e9)])
    up = next(fabric.cables[i].name for i in np.flatnonzero(loads) if fabric.cables[i].src == "leaf0")
    return fabric, loads, up


def test_the_retry_budget_in_closed_form():
    assert rc_give_up_s(20) == pytest.approx(8 * 4.096e-6 * 2**20) and round(rc_give_up_s(20), 1) == 34.4
    assert round(rc_give_up_s(18), 1) == 8.6 and round(ib_timeout_s(20), 1) == 4.3
    assert outage_waits(RC) == (TAU,) * 8 and outage_waits(NIC_PRESETS["irn"], timeout=18) == (ib_timeout_s(18),) * 8
    tcp = outage_waits(NIC_PRESETS["tcp"])          # RTO 200 ms doubling to 120 s, 15 retries
    assert len(tcp) == 16 and sum(tcp) == pytest.approx(sum(min(0.2 * 2**i, 120) for i in range(16)))
    assert outage_waits(NIC_PRESETS["ideal"]) is None


@pytest.mark.parametrize("timeout", [20, 18])
def test_a_cable_down_past_the_budget_fails_the_call_at_the_budget(small, timeout):
    fabric, loads, _ = small
    schedule = LinkSchedule(fabric, [f"{NIC_CABLE}:down:at=10,for=100"], 1000)
    end = call_end(schedule, loads, 0.0, 200.0, outage_waits(RC, timeout))
    assert end.failed and end.end_s == pytest.approx(10 + rc_give_up_s(timeout))


def test_a_shorter_outage_ends_the_call_later_by_the_outage_and_the_pending_timer(small):
    fabric, loads, _ = small
    for outage in (1.0, 20.0, 7 * TAU - 0.01):
        schedule = LinkSchedule(fabric, [f"{NIC_CABLE}:down:at=10,for={outage!r}"], 1000)
        end = call_end(schedule, loads, 0.0, 200.0, outage_waits(RC))
        pending = math.ceil(outage / TAU) * TAU - outage      # the first retry after the cable is back
        assert not end.failed and end.end_s == pytest.approx(200 + outage + pending)
    # past the seventh retry's send nothing is left to try: down 7 tau + a little fails at 8 tau
    schedule = LinkSchedule(fabric, [f"{NIC_CABLE}:down:at=10,for={7 * TAU + 0.01!r}"], 1000)
    assert call_end(schedule, loads, 0.0, 200.0, outage_waits(RC)).failed
    # a call that starts while the cable is down waits from its start
    schedule = LinkSchedule(fabric, [f"{NIC_CABLE}:down:at=0,for=6"], 1000)
    assert call_end(schedule, loads, 5.0, 1.0, outage_waits(RC)).end_s == pytest.approx(5 + TAU + 1)
    # a cable the call does not cross changes nothing
    schedule = LinkSchedule(fabric, ["node1.nic0-leaf0:down:at=0,for=500"], 1000)
    assert call_end(schedule, loads, 0.0, 200.0, outage_waits(RC)).end_s == 200.0


def _flap_end(work, first, period, cost):
    """A call of ``work`` seconds from 0 that each flap it meets (onsets first + k period before its end)
    holds ``cost`` seconds: the end is the fixed point of end = work + cost x onsets before end."""
    end = work
    while True:
        met = math.ceil((end - first) / period) if end > first else 0
        if work + met * cost == end:
            return end
        end = work + met * cost


def test_a_flap_costs_what_its_schedule_predicts(small):
    fabric, loads, _ = small
    schedule = LinkSchedule(fabric, [f"{NIC_CABLE}:flap:at=10,period=60,down=2"], 2000)
    rc = call_end(schedule, loads, 0.0, 500.0, outage_waits(RC))
    assert rc.end_s == pytest.approx(_flap_end(500.0, 10, 60, TAU)) and rc.stalled_s == pytest.approx(rc.end_s - 500)
    ideal = call_end(schedule, loads, 0.0, 500.0, None)          # resends when the cable is back: 2 s a flap
    assert ideal.end_s == pytest.approx(_flap_end(500.0, 10, 60, 2.0))
    assert schedule.down(NIC_CABLE, 70.5) and not schedule.down(NIC_CABLE, 72.5)
    assert schedule.down("leaf0-node0.nic0", 130.0)              # both directions of the cable


def test_routes_reconverge_around_a_switch_cable(small):
    fabric, loads, up = small
    schedule = LinkSchedule(fabric, [f"{up}:down:at=10,for=100"], 1000)
    assert schedule.reroutable(up) and not schedule.reroutable(NIC_CABLE)
    # ECMP withdraws the member after 1 s: the RC queue pair's next retry (one ACK timeout) goes through
    assert call_end(schedule, loads, 0.0, 200.0, outage_waits(RC), REROUTE_S["ecmp"]).end_s == pytest.approx(200 + TAU)
    assert call_end(schedule, loads, 0.0, 200.0, None, REROUTE_S["ecmp"]).end_s == pytest.approx(201.0)
    assert call_end(schedule, loads, 0.0, 200.0, None, REROUTE_S["ib-shield"]).end_s == pytest.approx(200.002)
    assert call_end(schedule, loads, 0.0, 200.0, outage_waits(RC), REROUTE_S["none"]).failed
    # a call after the reroute is not held at all
    assert call_end(schedule, loads, 20.0, 5.0, outage_waits(RC), REROUTE_S["ecmp"]).end_s == pytest.approx(25.0)


def test_half_speed_slows_exactly_the_steps_whose_flows_cross_it(small):
    fabric, crossing, _ = small
    routes = Routes(fabric, 1)
    elsewhere = cable_loads(routes, [Flow(1, 3, 1e9)])             # node 1 -> node 3: not node 0's cable
    schedule = LinkSchedule(fabric, [f"{NIC_CABLE}:speed:at=0,fraction=0.5"], 1000)
    assert schedule.speed(NIC_CABLE, 5.0) == 0.5 and schedule.speed("node1.nic0-leaf0", 5.0) == 1.0
    slowed = call_end(schedule, crossing, 0.0, 10.0, outage_waits(RC))
    assert slowed.end_s == pytest.approx(20.0) and slowed.slowed_s == pytest.approx(10.0)
    assert call_end(schedule, elsewhere, 0.0, 10.0, outage_waits(RC)).end_s == 10.0
    # half speed from 50 s on: a 100 s call does 50 s of work by then and the rest at half the rate
    later = LinkSchedule(fabric, [f"{NIC_CABLE}:speed:at=50,fraction=0.5"], 1000)
    assert call_end(later, crossing, 0.0, 100.0, outage_waits(RC)).end_s == pytest.approx(150.0)
    # a cable at half speed that carries a third of the bottleneck's bytes holds nothing back
    light = crossing.copy()
    light[fabric.cable(NIC_CABLE)] /= 3
    assert call_end(schedule, light, 0.0, 10.0, None).end_s == pytest.approx(10.0)


def test_a_failed_collective_restarts_from_the_last_checkpoint(small):
    fabric, loads, _ = small
    schedule = LinkSchedule(fabric, [f"{NIC_CABLE}:down:at=51.5,for=100"], 1000)
    run = run_steps(schedule, loads, steps=100, compute_s=0.0, comm_s=1.0, waits=outage_waits(RC),
                    checkpoint_every=10, restart_s=300.0)
    # fails at 51.5 + 34.4 s in step 52; back at step 50's checkpoint after 300 s; 50 steps to go
    assert run.failures == 1 and run.end_s == pytest.approx(51.5 + rc_give_up_s(20) + 300 + 50)
    clean = run_steps(LinkSchedule(fabric, [], 1000), loads, 100, 0.5, 0.5, outage_waits(RC))
    assert clean.end_s == pytest.approx(100.0) and clean.failures == 0


def test_events_parse_from_text_and_yaml(small, tmp_path):
    fabric, _, _ = small
    event = parse_link_event("leaf0-spine1:flap:at=5,period=30,down=1.5,for=300")
    assert (event.kind, event.at, event.period, event.down, event.duration) == ("flap", 5, 30, 1.5, 300)
    assert parse_link_event(event.text()) == event
    path = tmp_path / "events.yaml"
    path.write_text("- leaf0-spine1:down:at=10,for=5\n- {cable: leaf1-spine0, kind: speed, at: 0, fraction: 0.25}\n")
    events = load_link_events(path)
    assert [e.kind for e in events] == ["down", "speed"] and events[1].fraction == 0.25
    schedule = LinkSchedule(fabric, events, 100)
    assert schedule.speed("spine0-leaf1", 99.0) == 0.25 and schedule.speed("leaf0-spine1", 12.0) == 0.0
    assert schedule.outages("leaf0-spine1", 0, 100) == [(10.0, 15.0)]


@pytest.mark.parametrize("events, message", [
    (["leaf9-spine1:down:at=1,for=2"], "not in fabric"),
    (["leaf0-spine1:down:at=150,for=2"], "outside the run"),
    (["leaf0-spine1:down:at=90,for=20"], "outside the run"),
    (["leaf0-spine1:down:at=10,for=20", "spine1-leaf0:flap:at=0,period=10,down=1"], "contradict"),
    (["leaf0-spine1:speed:at=0,fraction=0.5", "leaf0-spine1:speed:at=20,for=5,fraction=0.25"], "contradict"),
    (["leaf0-spine1:sideways:at=1"], "KIND one of"),
    (["leaf0-spine1:down:for=2"], "needs at="),
    (["leaf0-spine1:flap:at=1,period=2,down=3"], "0 < down < period"),
    (["leaf0-spine1:speed:at=1,fraction=1"], "fraction"),
    (["leaf0-spine1:down:at=x"], "not a number"),
    (["leaf0-spine1:down:at=1,speed=2"], "not 'speed'"),
])
def test_bad_events_are_one_line(small, events, message):
    fabric, _, _ = small
    with pytest.raises(ValueError, match=message) as error:
        LinkSchedule(fabric, events, 100)
    assert "\n" not in str(error.value)


def test_overlaps_that_agree_are_kept(small):
    fabric, loads, _ = small
    schedule = LinkSchedule(fabric, [f"{NIC_CABLE}:down:at=10,for=5", f"{NIC_CABLE}:down:at=12,for=5",
                                     f"{NIC_CABLE}:speed:at=0,fraction=0.5"], 100)
    assert schedule.outages(NIC_CABLE, 0, 100) == [(10.0, 17.0)]
    assert schedule.speed(NIC_CABLE, 11.0) == 0.0 and schedule.speed(NIC_CABLE, 20.0) == 0.5
