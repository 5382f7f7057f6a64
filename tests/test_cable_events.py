"""Link events in training (``net.cable_events``): a downed or slowed cable on a 2-node fabric under a
retransmitting transport, call by call and in a tiny DP run (sim and dist bit for bit), and what training
still refuses."""
from __future__ import annotations

import pytest
import torch

from lossysim.config.fabric import event_schedule
from lossysim.fabric.events import LinkSchedule
from lossysim.net import LossyNetwork, NetworkSpec, cable_events
from lossysim.timing.retransmission import ib_timeout_s

# two nodes of one rank each, node 0 on leaf0 and node 1 on leaf1, one spine: every DP packet crosses
# leaf0-spine0 one way or the other
FABRIC = "leaf-spine:nodes=2,leaves=2,spines=1"


def _net() -> LossyNetwork:
    return LossyNetwork(NetworkSpec(2, "none", ranks_per_node=1, fabric=FABRIC, channels=1, transport="retransmit",
                                    nic="irn"))


def _call(net: LossyNetwork, events: cable_events.RunEvents, now: float, site: str = "s") -> float:
    """The simulated seconds one all-reduce at ``now`` takes."""
    events.at(now)
    before = net.clock()["comm_s"]
    net.simulate(site, "bwd", 200000, torch.float32, "all_reduce")
    return net.clock()["comm_s"] - before


def _events(text: str) -> cable_events.RunEvents:
    from lossysim.fabric.place import fabric_of
    return cable_events.RunEvents(LinkSchedule(fabric_of(FABRIC), [text], cable_events.HORIZON_S))


@pytest.fixture
def running(monkeypatch):
    def start(text: str) -> cable_events.RunEvents:
        events = _events(text)
        monkeypatch.setattr(cable_events, "ACTIVE", events)
        return events
    return start


def test_a_short_outage_ends_the_call_later_by_the_outage_and_the_pending_timer(running):
    net = _net()
    events = running("leaf0-spine0:down:at=100,for=5")
    ideal = _call(net, events, 0.0)                       # before the outage: the loss-free time
    assert ideal == pytest.approx(net.clock()["ideal_comm_s"], rel=1e-12) and ideal < 1e-2
    # cut at 100 with no work done, back at 105: the first retry at or after it is the second (8.59 s)
    assert _call(net, events, 100.0) == pytest.approx(ideal + 2 * ib_timeout_s(20), rel=1e-12)
    assert _call(net, events, 103.0) == pytest.approx(ideal + ib_timeout_s(20), rel=1e-12)
    assert _call(net, events, 105.0) == pytest.approx(ideal, rel=1e-12)   # up again
    assert events.failures == 0
    # the ideal nic waits for the cable alone
    assert net.clock()["comm_s_ideal_nic"] - net.clock()["ideal_comm_s"] == pytest.approx(5 + 2, abs=1e-9)


def test_an_outage_past_the_retry_budget_fails_the_collective_once_a_step(running):
    net = _net()
    events = running("leaf0-spine0:down:at=0")
    seconds = _call(net, events, 0.0)
    assert seconds == pytest.approx(8 * ib_timeout_s(20), rel=1e-12)   # given up at the budget's time: 34.4 s
    assert events.failures == 1
    _call(net, events, 0.0, "t")              # a second collective of the same step: one abort
    assert events.failures == 1
    _call(net, events, 400.0)
    assert events.failures == 2
    # at NCCL_IB_TIMEOUT 18 the budget is 8.6 s
    short = cable_events.RunEvents(events.schedule, ib_timeout=18)
    cable_events.ACTIVE = short
    assert _call(_net(), short, 0.0) == pytest.approx(8 * ib_timeout_s(18), rel=1e-12)   # 8.6 s
    assert short.failures == 1


def test_a_speed_cut_stretches_the_crossing_calls_by_its_cable_alone(running):
    net = _net()
    events = running("leaf0-spine0:speed:at=10,fraction=0.25,for=10")
    fabric = events.schedule.fabric
    ideal = _call(net, events, 0.0)
    loads = events.loads(net, next(iter(net._transfers.values())))
    per_byte = {c.name: loads[i] * 8 / (c.gbps * 1e9) for i, c in enumerate(fabric.cables) if loads[i] > 0}
    slowed = max(per_byte["leaf0-spine0"], per_byte["spine0-leaf0"]) / 0.25
    expected = ideal * max(slowed, *per_byte.values()) / max(per_byte.values())
    assert expected > 1.5 * ideal
    assert _call(net, events, 12.0) == pytest.approx(expected, rel=1e-9)
    assert _call(net, events, 20.0) == pytest.approx(ideal, rel=1e-12)


def test_a_call_off_the_event_cable_pays_nothing(running):
    net = LossyNetwork(NetworkSpec(2, "none", ranks_per_node=1, fabric="leaf-spine:nodes=4,leaves=2,spines=1",
                                   channels=1, transport="retransmit"))
    events = running("leaf1-spine0:down:at=0")      # nodes 0 and 1 both sit on leaf0
    assert _call(net, events, 0.0) == pytest.approx(net.clock()["ideal_comm_s"], rel=1e-12)
    assert events.failures == 0


@pytest.mark.parametrize("changes, message", [
    (dict(transport="drop"), "under transport=drop yet"),
    (dict(tp_size=2, ranks_per_node=2), "tp, pp, cp or ep sizes above 1"),
    (dict(checkpoint_every=2), "checkpoint_every > 0"),
])
def test_training_still_refuses_what_is_not_built(tmp_path, changes, message):
    from test_data_parallel import tiny
    from lossysim.run.experiment import run_experiment
    settings = dict(dp_size=2, ranks_per_node=1, fabric=FABRIC, link_event="leaf0-spine0:down:at=0",
                    transport="retransmit") | changes
    config = tiny(tmp_path, **settings)
    with pytest.raises(ValueError, match=message):
        run_experiment(config, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.usefixtures("private_cache")
def test_a_cable_down_the_whole_run_fails_every_step_and_dist_equals_sim(tmp_path, one_torch_thread):
    """dp 2 on the 2-node fabric, leaf0-spine0 down from t = 0 for good: every step's first bucket fails
    (one failed collective a step), each charged restart_s and restart_lost_steps as any failure; sim
    and two gloo processes agree bit for bit."""
    from test_data_parallel import assert_dist_is_sim, sim_and_dist

    rows, weights = sim_and_dist(tmp_path, tp_size=1, dp_size=2, ranks_per_node=1, fabric=FABRIC,
                                 transport="retransmit", link_event="leaf0-spine0:down:at=0", steps=3,
                                 restart_s=100.0, restart_lost_steps=0)
    assert_dist_is_sim(rows, weights)
    train = [r for r in rows["sim"] if r["split"] == "train"]
    assert [r["failures"] for r in train] == [1, 2, 3]
    # each step: its buckets each held 34.4 s by the retry budget, then the restart
    for a, b in zip(train, train[1:]):
        assert b["sim_time_s"] - a["sim_time_s"] > 100.0 + 8 * ib_timeout_s(20)


def test_a_short_outage_in_training_costs_time_and_no_failure(tmp_path):
    from test_data_parallel import tiny
    from lossysim.run.experiment import run_experiment
    from lossysim.io import read_jsonl
    runs = {}
    for name, event in (("free", ""), ("down", "leaf0-spine0:down:at=0,for=5")):
        config = tiny(tmp_path / name, dp_size=2, ranks_per_node=1, fabric=FABRIC, transport="retransmit",
                      link_event=event, out=str(tmp_path / name / "out"))
        assert run_experiment(config, config.out, progress=False)["status"] == "completed"
        runs[name] = [r for r in read_jsonl(tmp_path / name / "out" / "metrics.jsonl") if r["split"] == "train"]
    free, down = runs["free"], runs["down"]
    assert [r["failures"] for r in down] == [0, 0, 0]
    # step 1's buckets all start at 0 inside the outage: each ends 8.59 s later; steps 2 and 3 pay nothing
    assert down[0]["dp_s_per_step"] - free[0]["dp_s_per_step"] >= 2 * ib_timeout_s(20)
    for a, b in zip(free[1:], down[1:]):
        # (the bucket's seconds read off a clock that holds 8.59 s more: equal to its rounding)
        assert b["dp_s_per_step"] == pytest.approx(a["dp_s_per_step"], rel=1e-9) and b["loss"] == a["loss"]
