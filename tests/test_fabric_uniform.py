"""One Bernoulli rate on every cable: groups that cross as many cables flow by flow are alike but for their
streams, so the estimate samples them as it samples groups without a fabric; anything else on the cables
(a bad cable, a CorrOpt draw, bursts) or groups that cross unequal counts keeps every group simulated."""
from __future__ import annotations

import pytest
from scipy import stats

from lossysim.estimate.job import Job
from lossysim.estimate.shapes import load
from lossysim.estimate.simulate import estimate
from lossysim.estimate.workload import Workload, job_config
from lossysim.net import NetworkSpec
from lossysim.pp.stages import stage_layout

# 8 nodes of 2 ranks, nodes 0-3 on leaf0 and 4-7 on leaf1: with tp 2 x pp 2 x dp 4 in Megatron's order every
# data-parallel link joins two nodes under one leaf (2 cables: up to the leaf, down to the node) and every
# pipeline send joins the leaves (4 cables, over either spine)
FABRIC = "leaf-spine:nodes=8,leaves=2,spines=2"
P = 0.02


def _job(sampled: int, **changes):
    settings = dict(tp_size=2, pp_size=2, dp_size=4, ranks_per_node=2, fabric=FABRIC, loss=f"bernoulli:{P}",
                    lossy_links="inter_node", transport="retransmit", nic="irn", seed=1) | changes
    config = job_config("tiny-llama", 1, "bf16", None, **settings)
    shape, w = load("tiny-llama"), Workload(256, sampled_groups=sampled)
    return shape, config, w, Job(shape, config, w, stage_layout(None, settings["pp_size"], shape.layers), 256)


@pytest.mark.parametrize("changes, uniform", [
    (dict(), True),
    (dict(bad_link=("leaf0-spine0.0:bernoulli:0.02",)), True),     # the same rate named again: still one rate
    (dict(bad_link=("leaf0-spine0.0:bernoulli:0.03",)), False),
    (dict(corrupt_share=0.1), False),
    (dict(loss="ge:rate=0.02,burst=4"), False),                  # bursts: flows sharing a cable share them
])
def test_uniform_means_one_bernoulli_rate_on_every_cable(changes, uniform):
    settings = dict(loss=f"bernoulli:{P}", fabric=FABRIC, ranks_per_node=1, channels=1) | changes
    spec = NetworkSpec(8, settings.pop("loss"), **settings)
    assert spec.cables.uniform is uniform


def test_alike_groups_on_a_uniform_fabric_are_sampled_and_unlike_ones_are_not():
    _, _, _, job = _job(1)
    assert job._sample(job.pp[0])[1] == 3 and job._sample(job.pp[0])[0][0].copies == 4
    assert all(job._sample(stage)[1] == 1 for stage in job.dp)
    # a bad cable on top: the groups under it are not alike the others, every one is simulated
    _, _, _, job = _job(1, bad_link="leaf0-spine0.0:bernoulli:0.05")
    assert job._sample(job.pp[0]) == (job.pp[0], 0)
    # 6 nodes of one rank, nodes 0-2 on leaf0: TP pairs (0, 1) and (4, 5) turn at their leaf, (2, 3) crosses a
    # spine; its crossings differ, so no TP group stands for another
    _, _, _, job = _job(1, pp_size=1, dp_size=3, ranks_per_node=1, fabric="leaf-spine:nodes=6,leaves=2,spines=1")
    groups = job.tp[0]
    assert len(groups) == 3 and job._sample(groups) == (groups, 0)


def test_sampled_groups_lose_packets_at_the_closed_form_rate_of_their_cables():
    """A packet over c cables at rate p each is lost with probability 1 - (1 - p)^c: the sampled estimate's
    counts, divided back to the groups simulated, are binomial at that rate (every send transmitted counts)."""
    steps = 3
    shape, config, w, job = _job(1)
    row = estimate(shape, config, w, steps=steps)
    for cls, cables, groups in (("pp", 4, 4), ("dp", 2, 2)):   # each class's groups, one simulated per stage
        sent = round(row[f"{cls}_packets_sent"] * steps / groups)
        lost = round(row[f"{cls}_packets_lost"] * steps / groups)
        q = 1 - (1 - P) ** cables
        assert lost > 0 and stats.binomtest(lost, sent, q).pvalue > 1e-3, (cls, lost, sent, q)
    # the loss-free figures do not depend on sampling; every group simulated gives the same
    full = estimate(*_job(0)[:3], steps=steps)
    assert row["loss_free_step_s"] == full["loss_free_step_s"]
    assert row["packets_drawn"] < full["packets_drawn"]


def test_expert_groups_on_a_uniform_fabric_are_sampled_at_their_cables_closed_form_rate():
    """tp 1 x pp 2 x dp 8, ep 4, one rank a node on 16 nodes, 0-7 under leaf0: every ep group's pairs join two
    nodes under one leaf (2 cables each). Sampled as without a fabric: one group's one micro-batch stands for
    every group, micro-batch and step (copies = steps x groups x micro-batches), at 1 - (1 - p)^2."""
    steps, m, groups = 3, 2, 4   # 2 stages x 2 expert-data groups
    config = job_config("tiny-moe", micro_batch=2, microbatches=m, tp_size=1, dp_size=8, ep_size=4, pp_size=2,
                        ranks_per_node=1, fabric="leaf-spine:nodes=16,leaves=2,spines=2", loss=f"bernoulli:{P}",
                        lossy_links="inter_node", transport="retransmit", nic="irn", seed=1)
    shape = load("tiny-moe")
    job = Job(shape, config, Workload(256, sampled_groups=1), stage_layout(None, 2, shape.layers), 256)
    assert job.ep_lossy and all(len(stage) == 2 and stage[0].copies == 1 for stage in job.ep)
    assert not Job(shape, config, Workload(256, sampled_groups=0), stage_layout(None, 2, shape.layers), 256).ep_lossy
    row = estimate(shape, config, Workload(256, sampled_groups=1), steps=steps)
    sent = round(sum(row[f"{c}_packets_sent"] for c in ("ep_dispatch", "ep_combine")) / (groups * m))
    lost = round(sum(row[f"{c}_packets_lost"] for c in ("ep_dispatch", "ep_combine")) / (groups * m))
    assert lost > 0 and stats.binomtest(lost, sent, 1 - (1 - P) ** 2).pvalue > 1e-3, (lost, sent)


@pytest.mark.parametrize("moe", [False, True])
def test_a_sampled_uniform_fabric_names_the_blast_radius_every_group_would(moe):
    """Each group a sampled one stands for is counted on its own cables: the same cables, ranks and groups as
    with every group simulated, each class's share of packets on a cable within retransmissions' noise."""
    if moe:
        settings = dict(micro_batch=2, microbatches=2, tp_size=1, dp_size=8, ep_size=4, pp_size=2, ranks_per_node=1,
                        fabric="leaf-spine:nodes=16,leaves=2,spines=2")
        name = "tiny-moe"
    else:
        settings = dict(tp_size=2, pp_size=2, dp_size=4, ranks_per_node=2, fabric=FABRIC)
        name = "tiny-llama"
    # a low rate, so a share's noise (its retransmissions) stays well under the tolerance
    config = job_config(name, **({"micro_batch": 1} if not moe else {}), loss="bernoulli:0.002",
                        lossy_links="inter_node", transport="retransmit", nic="irn", seed=1, **settings)
    blasts = [estimate(load(name), config, Workload(256, sampled_groups=k), steps=1)["blast"] for k in (1, 0)]
    sampled, full = ({b["cable"]: b for b in blast} for blast in blasts)
    assert sampled.keys() == full.keys() and len(full) > 4
    for cable, entry in full.items():
        assert (sampled[cable]["ranks"], sampled[cable]["groups"]) == (entry["ranks"], entry["groups"]), cable
        assert sampled[cable]["ranks_first"] == entry["ranks_first"]
        for cls, share in entry["share"].items():
            assert sampled[cable]["share"][cls] == pytest.approx(share, rel=0.02), (cable, cls)
