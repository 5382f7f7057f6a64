"""Link events in training (``net.cable_events``): a downed or slowed cable on a 2-node fabric under a
retransmitting transport, call by call and in a tiny DP run (sim and dist bit for bit); under ``drop``, the
packets of exactly the flows on a down cable lost inside its window; and what training still refuses."""
from __future__ import annotations

import os

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


def _events(text: str, fabric: str = FABRIC) -> cable_events.RunEvents:
    from lossysim.fabric.place import fabric_of
    return cable_events.RunEvents(LinkSchedule(fabric_of(fabric), [text], cable_events.HORIZON_S))


@pytest.fixture
def running(monkeypatch):
    def start(text: str, fabric: str = FABRIC) -> cable_events.RunEvents:
        events = _events(text, fabric)
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
    (dict(transport="deadline"), "under transport=deadline yet"),
    (dict(tp_size=2, ranks_per_node=2), "tp, cp or ep sizes above 1"),
    (dict(dp_size=1, pp_size=2), "pp_size above 1 under transport=retransmit"),
    (dict(dp_size=2, pp_size=2, ranks_per_node=1, fabric="leaf-spine:nodes=4,leaves=2,spines=1",
          link_event="leaf0-spine0.0:down:at=0", transport="drop"), "pp_size above 1 under transport=drop and dp_size=2"),
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


# four nodes, two to a leaf, two parallel uplinks a leaf: with 4 channels a ring's cross-leaf links hash
# some flows onto leaf0-spine0.0 (or its reverse) and some not
WIDE = "leaf-spine:nodes=4,leaves=2,spines=1"


def _drop_net(bad: str = "") -> LossyNetwork:
    return LossyNetwork(NetworkSpec(4, "none", ranks_per_node=1, fabric=WIDE, channels=4, transport="drop",
                                    algorithm="ring", bad_link=(bad,) if bad else (), seed=3))


def _per_link(net: LossyNetwork) -> dict:
    """(src, dst) -> [sent, lost] over every phase, then the counters zeroed."""
    out: dict = {}
    for row in net.stats():
        counts = out.setdefault((row["src"], row["dst"]), [0, 0])
        counts[0] += row["sent"]
        counts[1] += row["lost"]
    net.reset_stats()
    return out


def _down_packets(net: LossyNetwork, down: set, src: int, dst: int, sent: int) -> int:
    """Packets of the link's ``sent`` (one call's) on flows crossing a cable of ``down``, by its routes."""
    return sum(len(range(residue, sent, modulus)) for cables, modulus, residue in net.spec.cables.paths(src, dst)
               if down & set(cables))


def test_drop_loses_every_packet_of_the_flows_on_a_down_cable_in_its_window_and_no_other(running):
    net = _drop_net()
    events = running("leaf0-spine0.0:down:at=10,for=5", WIDE)
    down = set(events.downable)
    assert not net.spec.can_lose and net.drops("bwd", "s")     # a lossless fabric loses to the outage alone
    crossing, partly = 0, 0
    for now, inside in ((0.0, False), (10.0, True), (14.9, True), (15.0, False), (400.0, False)):
        events.at(now)
        x = torch.randn(4, 50000, dtype=torch.float32)
        out = net.all_reduce("s", "bwd", x.clone(), range(4))
        links = _per_link(net)
        for (src, dst), (sent, lost) in links.items():
            expected = _down_packets(net, down, src, dst, sent) if inside else 0
            assert lost == expected, (now, src, dst)
            crossing += inside and expected > 0
            partly += 0 < lost < sent       # a link some of whose flows go round the down cable
        assert (out != x.sum(0)).any() == inside        # the outage costs the sum; outside it arrives exact
    assert crossing >= 2 * 2 and partly >= 2   # links lost packets in both calls, one only some of its own
    assert net.clock()["comm_s"] == pytest.approx(net.clock()["ideal_comm_s"], rel=1e-12)  # drop waits for nothing
    assert events.failures == 0


@pytest.mark.parametrize("loss", ["bernoulli:0.05", "ge:rate=0.05,burst=4"])
def test_an_outage_under_drop_leaves_every_other_draw_as_a_run_without_it(running, loss):
    """spine0-leaf1.1 lossy: the event net and one without events, same seed, lose the same packets on every
    link no flow of which crosses the down cable, and (the lossy chain stepped alike) on every link after it."""
    bad = f"spine0-leaf1.1:{loss}"
    plain, evented = _drop_net(bad), _drop_net(bad)
    events = running("leaf0-spine0.0:down:at=10,for=5", WIDE)
    down = set(events.downable)
    for now in (10.0, 12.0, 20.0, 30.0):
        x = torch.randn(4, 50000, dtype=torch.float32)
        cable_events.ACTIVE = None
        plain.all_reduce("s", "bwd", x.clone(), range(4))
        cable_events.ACTIVE = events
        events.at(now)
        evented.all_reduce("s", "bwd", x.clone(), range(4))
        a, b = _per_link(plain), _per_link(evented)
        assert sum(lost for _, lost in a.values()) > 0           # the lossy cable lost something
        for link, (sent, lost) in a.items():
            hit = _down_packets(evented, down, *link, sent) if now < 15 else 0
            if not hit:
                assert b[link] == [sent, lost], (now, link)
            else:   # the down flows' packets all lost, the others' as the lossy cable drew them
                assert hit <= b[link][1] <= hit + lost


@pytest.mark.usefixtures("private_cache")
def test_a_cable_down_for_the_first_steps_under_drop_loses_their_dp_packets_and_dist_equals_sim(
        tmp_path, one_torch_thread):
    """dp 2 on the 2-node fabric under drop, leaf0-spine0 down from t = 0 for 2 ms of simulated time: every
    DP packet of the steps that start inside it is lost, none of the later ones; time as the free run's
    (nothing waits), the training loss pays; sim and two gloo processes bit for bit."""
    from test_data_parallel import assert_dist_is_sim, sim_and_dist, tiny
    from lossysim.io import read_jsonl
    from lossysim.run.experiment import run_experiment

    settings = dict(tp_size=1, dp_size=2, ranks_per_node=1, fabric=FABRIC, transport="drop", steps=4, eval_every=4)
    (tmp_path / "down").mkdir()
    rows, weights = sim_and_dist(tmp_path / "down", link_event="leaf0-spine0:down:at=0,for=0.002", **settings)
    assert_dist_is_sim(rows, weights)
    free = tiny(tmp_path / "free", **settings, out=str(tmp_path / "free" / "out"))
    assert run_experiment(free, free.out, progress=False)["status"] == "completed"
    free = [r for r in read_jsonl(tmp_path / "free" / "out" / "metrics.jsonl") if r["split"] == "train"]
    down = [r for r in rows["sim"] if r["split"] == "train"]
    starts = [0.0] + [r["sim_time_s"] for r in down[:-1]]
    inside = [t < 0.002 for t in starts]
    assert any(inside) and not all(inside)          # the window holds the first steps, not all of them
    _assert_steps_lose_all_dp_packets_exactly_when(down, inside)
    assert [r["sim_time_s"] for r in down] == [r["sim_time_s"] for r in free]
    assert [r["failures"] for r in down] == [0] * len(down)
    assert down[0]["loss"] == free[0]["loss"] and down[-1]["loss"] != free[-1]["loss"]


def test_a_flap_with_no_end_in_training_runs_and_loses_the_steps_its_down_windows_hold(tmp_path):
    """dp 2 under drop, leaf0-spine0 flapping with no ``for=`` (to training's 1e9 s horizon; it once walked
    every period to it and never got past a step): every DP packet of the steps that start inside a down
    window is lost, none of the others'; time as the free run's."""
    from test_data_parallel import tiny
    from lossysim.fabric.place import fabric_of
    from lossysim.io import read_jsonl
    from lossysim.run.experiment import run_experiment

    settings = dict(tp_size=1, dp_size=2, ranks_per_node=1, fabric=FABRIC, transport="drop", steps=6, eval_every=6)
    free = tiny(tmp_path / "free", **settings, out=str(tmp_path / "free" / "out"))
    assert run_experiment(free, free.out, progress=False)["status"] == "completed"
    free = [r for r in read_jsonl(tmp_path / "free" / "out" / "metrics.jsonl") if r["split"] == "train"]
    step = free[0]["sim_time_s"]
    flap = f"leaf0-spine0:flap:at=0,period={2.7 * step:.9g},down={1.2 * step:.9g}"
    run = tiny(tmp_path / "flap", **settings, link_event=flap, out=str(tmp_path / "flap" / "out"))
    assert run_experiment(run, run.out, progress=False)["status"] == "completed"
    rows = [r for r in read_jsonl(tmp_path / "flap" / "out" / "metrics.jsonl") if r["split"] == "train"]
    schedule = LinkSchedule(fabric_of(FABRIC), [flap], cable_events.HORIZON_S)
    inside = [schedule.down("leaf0-spine0", t) for t in [0.0] + [r["sim_time_s"] for r in free[:-1]]]
    assert len(rows) == 6 and any(inside) and not all(inside)
    _assert_steps_lose_all_dp_packets_exactly_when(rows, inside)
    assert [r["sim_time_s"] for r in rows] == [r["sim_time_s"] for r in free]


@pytest.mark.usefixtures("private_cache")
def test_a_cable_down_for_the_first_steps_loses_the_pipelines_sends_under_drop_and_dist_equals_sim(
        tmp_path, one_torch_thread):
    """pp 2 on the 2-node fabric under drop (one stage a node: every activation and gradient send crosses
    leaf0-spine0 one way or the other), the cable down for the first 2 ms: every send of the steps that start
    inside it is lost, none of the later ones'; sim and two gloo processes (one a stage) bit for bit."""
    import yaml
    from safetensors.torch import load_file
    from test_data_parallel import assert_dist_is_sim, tiny
    from torchrun_launch import torchrun
    from lossysim.io import read_jsonl
    from lossysim.run.experiment import run_experiment

    settings = dict(model="tiny", dataset="synthetic", max_length=32, max_train_samples=96, max_eval_samples=32,
                    batch_size=8, eval_batch_size=32, steps=4, eval_every=4, log_every=1, warmup_steps=1,
                    dropout=0.0, lr=1e-3, save_checkpoint=True, tp_size=1, pp_size=2, ranks_per_node=1,
                    fabric=FABRIC, transport="drop", recovery="zero", link_event="leaf0-spine0:down:at=0,for=0.002")
    spec = tmp_path / "run.yaml"
    spec.write_text(yaml.safe_dump(settings))
    sim = tiny(tmp_path, **settings, out=str(tmp_path / "sim"))
    assert run_experiment(sim, sim.out, progress=False)["status"] == "completed"
    result = torchrun(["train", "--config", str(spec), "--backend", "dist", "--out", str(tmp_path / "dist"),
                       "--no-progress"], nproc=2, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {name: read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("sim", "dist")}
    weights = [load_file(tmp_path / name / "checkpoint" / "model.safetensors") for name in ("sim", "dist")]
    assert len(rows["sim"]) == len(rows["dist"])
    assert_dist_is_sim(rows, weights)
    train = [r for r in rows["sim"] if r["split"] == "train"]
    starts = [0.0] + [r["sim_time_s"] for r in train[:-1]]
    inside = [t < 0.002 for t in starts]
    assert any(inside) and not all(inside)
    before = {key: 0 for key in ("packets_sent_pp_fwd", "packets_lost_pp_fwd", "packets_sent_pp_bwd",
                                 "packets_lost_pp_bwd")}
    for row, is_inside in zip(train, inside):
        for direction in ("fwd", "bwd"):
            sent = row[f"packets_sent_pp_{direction}"] - before[f"packets_sent_pp_{direction}"]
            lost = row[f"packets_lost_pp_{direction}"] - before[f"packets_lost_pp_{direction}"]
            assert sent > 0 and lost == (sent if is_inside else 0), (row["step"], direction)
        before = {key: row[key] for key in before}


def _assert_steps_lose_all_dp_packets_exactly_when(rows, inside) -> None:
    """Each step sends DP packets and loses every one of them where ``inside`` says, none elsewhere."""
    sent_before = lost_before = 0
    for row, is_inside in zip(rows, inside):
        sent, lost = row["packets_sent_dp"] - sent_before, row["packets_lost_dp"] - lost_before
        assert sent > 0 and lost == (sent if is_inside else 0), row["step"]
        sent_before, lost_before = row["packets_sent_dp"], row["packets_lost_dp"]


def test_a_stretched_call_meets_the_outage_and_ends_on_its_stretched_seconds(running):
    """On shared cables the clock stretches a call's loss-free seconds by the collision factor x: an outage at
    1.5 x the call's own seconds after its start meets the x = 3 call (not the unstretched one), which works
    1.5 of them, waits to the first retry after the cable is back (2 TAU after the cut at 100, back at 105),
    then does the rest: x * ideal + 2 TAU in all."""
    events = running("leaf0-spine0:down:at=100,for=5")
    plain, stretched = _net(), _net()
    ideal = _call(plain, events, 0.0)
    start = 100.0 - 1.5 * ideal
    assert _call(plain, events, start) == pytest.approx(ideal, rel=1e-12)       # over before the cut
    stretched.time.stretch = 3.0
    assert _call(stretched, events, 0.0) == pytest.approx(3 * ideal, rel=1e-12)
    before = stretched.clock()["comm_s_ideal_nic"]
    assert _call(stretched, events, start) == pytest.approx(3 * ideal + 2 * ib_timeout_s(20), rel=1e-9)
    # the ideal nic waits for the cable alone: back at 105, then the 1.5 ideal left
    assert stretched.clock()["comm_s_ideal_nic"] - before == pytest.approx(3 * ideal + 5.0, rel=1e-9)
    assert events.failures == 0
