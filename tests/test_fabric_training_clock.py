"""Shared cables on training's step clock: on a fabric where two DP rings' flows cross one leaf uplink by
construction, every DP network's loss-free seconds are the fabric's predicted factor times their own, TP's
(under one leaf) untouched; without a fabric or with shared_cables off, every clock as it was."""
from __future__ import annotations

import pytest

from lossysim.estimate import collisions
from tests.test_data_parallel import tiny

# 4 nodes of one rank, nodes 0-1 on leaf0 and 2-3 on leaf1, one spine: each leaf has one uplink
FABRIC = "leaf-spine:nodes=4,leaves=2,spines=1"
# tp 2 x dp 2: TP groups {0, 1} and {2, 3} stay under a leaf; the DP rings {0, 2} and {1, 3} both send
# leaf0 -> leaf1 over the one uplink (0 -> 2 and 1 -> 3): two flows on one cable, the NIC cables one each
LAYOUT = dict(tp_size=2, dp_size=2, ranks_per_node=1, channels=1, transport="retransmit")


def _run(tmp_path, name, **changes):
    from lossysim.run.experiment import run_experiment
    from lossysim.io import read_jsonl
    config = tiny(tmp_path / name, **{**LAYOUT, **changes}, out=str(tmp_path / name / "out"))
    summary = run_experiment(config, config.out, progress=False)
    assert summary["status"] == "completed"
    rows = [r for r in read_jsonl(tmp_path / name / "out" / "metrics.jsonl") if r["split"] == "train"]
    return config, summary, rows


def _clock(row) -> dict:
    """A train row's simulated seconds (the wall clock's ``time_s`` and ``tokens_per_s`` left out)."""
    return {k: v for k, v in row.items() if (k.endswith("_s") or k.endswith("_per_step"))
            and k not in ("time_s", "tokens_per_s")}


def test_the_predicted_factor_is_two_flows_on_one_cable(tmp_path):
    config = tiny(tmp_path, **LAYOUT, fabric=FABRIC)
    by = collisions.summary(config)
    assert by == {"tp": 1.0, "dp": pytest.approx(2.0)}
    assert collisions.summary(config.replace(shared_cables=False)) == {"tp": 1.0, "dp": 1.0}


@pytest.mark.usefixtures("private_cache")
def test_training_stretches_dp_by_the_fabric_factor_and_nothing_else(tmp_path, one_torch_thread):
    from lossysim.run.build import build
    from lossysim.run.fabric_record import stretch_clocks
    import torch
    runs = {name: _run(tmp_path, name, **changes) for name, changes in
            (("none", {}), ("shared", dict(fabric=FABRIC)), ("unshared", dict(fabric=FABRIC, shared_cables=False)))}
    none, shared, unshared = (runs[n][2] for n in ("none", "shared", "unshared"))
    factor = collisions.summary(runs["shared"][0])["dp"]
    assert factor == pytest.approx(2.0)
    # loss-free (no bad cable): the unshared fabric's clock is the fabric-free one, figure for figure
    for a, b in zip(none, unshared):
        assert _clock(a) == _clock(b) and _clock(a)
    for a, b in zip(unshared, shared):
        # each step's DP seconds (the buckets after the backward: nothing hides them) double; TP's do not
        assert b["dp_s_per_step"] == pytest.approx(factor * a["dp_s_per_step"], rel=1e-9)
        assert b["loss"] == a["loss"]
        assert b["sim_time_s"] > a["sim_time_s"]
    # the clocks set: the DP networks' to the factor, TP's to 1; none without a fabric
    parts = build(runs["shared"][0], torch.device("cpu"), 0, True, None)
    assert stretch_clocks(parts, runs["shared"][0]) == {"tp": 1.0, "dp": pytest.approx(factor)}
    assert parts.dp.networks and all(n.time.stretch == factor for n in parts.dp.networks)
    assert parts.train_net.time.stretch == 1.0
    assert stretch_clocks(parts, runs["none"][0]) == {}


@pytest.mark.usefixtures("private_cache")
def test_training_stretches_the_pipeline_sends_by_their_factor(tmp_path, one_torch_thread):
    """pp 2 x dp 2, the stages on a leaf each (stage 0 on nodes 0-1): both replicas' boundary sends cross the
    one uplink at once (factor 2), the DP rings stay under a leaf (1): each step's PP seconds double."""
    pipeline = dict(tp_size=1, pp_size=2, parallel_order="tp-cp-ep-dp-pp", fabric=FABRIC)
    shared = _run(tmp_path, "shared", **pipeline)
    unshared = _run(tmp_path, "unshared", **pipeline, shared_cables=False)
    by = collisions.summary(shared[0])
    assert by == {"pp": pytest.approx(2.0), "dp": 1.0}
    for a, b in zip(unshared[2], shared[2]):
        assert b["pp_s_per_step"] == pytest.approx(by["pp"] * a["pp_s_per_step"], rel=1e-9)
        assert b["dp_s_per_step"] == pytest.approx(a["dp_s_per_step"], rel=1e-12) and b["loss"] == a["loss"]


@pytest.mark.usefixtures("private_cache")
def test_every_expert_groups_all_to_alls_take_their_class_factor(tmp_path, one_torch_thread):
    """dp 4 x ep 2: two expert groups; the stretch reaches every group's dispatch and combine networks (the
    blast radius counts the first group's alone), each at its class's factor."""
    import torch
    from lossysim.run.build import build
    from lossysim.run.fabric_record import stretch_clocks
    config = tiny(tmp_path, model="tiny-moe", tp_size=1, dp_size=4, ep_size=2, ranks_per_node=1,
                  transport="retransmit", fabric=FABRIC)
    parts = build(config, torch.device("cpu"), 0, True, None)
    by = collisions.summary(config)
    for group in parts.ep.groups:   # a mark each group's clock must lose (the factors here are 1.0)
        for net in group.train.values():
            net.time.stretch = 7.0
    set_ = stretch_clocks(parts, config)
    classes = [name for name in set_ if name.startswith("ep_")]
    assert classes and len(parts.ep.groups) == 2
    for name in classes:
        assert set_[name] == by.get(name, 1.0)
        assert all(g.train[name].time.stretch == set_[name] for g in parts.ep.groups)


@pytest.mark.usefixtures("private_cache")
def test_training_stretches_the_experts_buckets_by_the_expert_data_factor_and_nothing_else(
        tmp_path, one_torch_thread, monkeypatch):
    """dp 4 x ep 2 of tiny-moe, a rank a node: the expert groups {0, 1} and {2, 3} stay under a leaf (their
    all-to-alls 1x), the dense ring 0-1-2-3 crosses the uplink once each way (1x), the expert-data groups
    {0, 2} and {1, 3} both send leaf0 -> leaf1 over the one uplink (2x): each step's expert buckets' seconds
    double, every other clock stays as without shared cables."""
    from lossysim.ep.apply import ExpertParallelism
    layout = dict(model="tiny-moe", tp_size=1, dp_size=4, ep_size=2)
    flows = collisions.factors(tiny(tmp_path, **{**LAYOUT, **layout}, fabric=FABRIC))
    assert flows["edp"] == pytest.approx(2.0) and flows["dp"] == 1.0 and flows["ep"] == 1.0
    seconds: list = []
    original = ExpertParallelism.average_gradients

    def kept(self, replicas):
        seconds.append(original(self, replicas))
        return seconds[-1]
    monkeypatch.setattr(ExpertParallelism, "average_gradients", kept)
    runs = {}
    for name, changes in (("unshared", dict(shared_cables=False)), ("shared", {})):
        seconds.clear()
        runs[name] = (_run(tmp_path, name, **layout, fabric=FABRIC, **changes), list(seconds))
    (_, _, unshared), experts_before = runs["unshared"]
    (_, _, shared), experts_after = runs["shared"]
    assert experts_before and all(s > 0 for s in experts_before)
    assert experts_after == pytest.approx([2 * s for s in experts_before], rel=1e-12)
    for a, b in zip(unshared, shared):
        assert b["loss"] == a["loss"]
        moved = {k for k in _clock(a) if _clock(a)[k] != _clock(b)[k]}
        # the experts' buckets are charged on the DP clock (after the dense buckets), so dp_s and the run's sum move
        assert moved <= {"dp_s_per_step", "sim_time_s", "comm_s_per_step"}, moved
        assert b["dp_s_per_step"] > a["dp_s_per_step"]
    step = len(unshared)
    extra = sum(experts_before[:step]) / step     # the rows' per-step means: what the stretch adds to each
    assert shared[-1]["dp_s_per_step"] - unshared[-1]["dp_s_per_step"] == pytest.approx(extra, rel=1e-6)
