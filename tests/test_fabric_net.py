"""The fabric under the network: one chain per lossy cable, packets lost where their routes cross one,
training (sim and dist) and the estimate on small fabrics, bad input."""
from __future__ import annotations

import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest
import torch
from scipy import stats

from lossysim.net import LossyNetwork, NetworkSpec

# 4 nodes of one rank each, nodes 0-1 on leaf0 and 2-3 on leaf1, one spine, one cable a leaf up and down
SMALL = "leaf-spine:nodes=4,leaves=2,spines=1,oversubscription=2"


def _net(bad: str, ranks: int = 4, **settings) -> LossyNetwork:
    return LossyNetwork(NetworkSpec(ranks, settings.pop("loss", "none"), ranks_per_node=1, fabric=SMALL,
                                    bad_link=(bad,), channels=1, **settings))


def _per_link(net: LossyNetwork) -> dict:
    out = defaultdict(lambda: np.zeros(2, dtype=np.int64))
    for row in net.stats():
        out[row["src"], row["dst"]] += (row["sent"], row["lost"])
    return out


def test_packets_crossing_the_bad_cable_lose_at_its_rate_and_no_others_lose():
    p = 0.02
    net = _net(f"leaf0-spine0:bernoulli:{p}", algorithm="direct")
    for i in range(40):
        net.simulate(f"site{i % 4}", "fwd", 400000, torch.float32, "all_reduce", deliver=False)
    crossing = {(s, d) for s in (0, 1) for d in (2, 3)}     # leaf0's nodes to leaf1's: up leaf0-spine0
    sent = lost = 0
    for link, (n, k) in _per_link(net).items():
        if link in crossing:
            sent, lost = sent + n, lost + k
        else:
            assert k == 0, link
    assert sent > 40000
    assert stats.binomtest(int(lost), int(sent), p).pvalue > 1e-3
    assert lost > 0


def test_fabric_none_draws_what_no_fabric_draws():
    a = LossyNetwork(NetworkSpec(4, "ge:rate=0.05,burst=4", ranks_per_node=2, fabric="none"))
    b = LossyNetwork(NetworkSpec(4, "ge:rate=0.05,burst=4", ranks_per_node=2))
    for net in (a, b):
        for i in range(5):
            net.simulate(f"s{i}", "bwd", 5000, torch.float32, "all_reduce", deliver=False)
    assert a.stats() == b.stats() and a.spec.as_dict() == b.spec.as_dict()


def _masks(net: LossyNetwork, links: list, width: int, site: str = "x"):
    ids = torch.tensor([net.links.index(link) for link in links])
    chains = net.channels.get(site, "fwd", "cpu").chains
    lost, _, _ = chains.draw(ids, list(range(len(links))), width, torch.full((len(links),), width))
    return lost.numpy()


def test_two_flows_on_one_bursty_cable_share_its_bursts():
    """Flows 0->2 and 1->3 both go up leaf0-spine0 (Gilbert-Elliott, bursts of 8): where one loses a packet
    the other loses that position far more often than the rate; flows on two different bursty cables
    (0->2 up leaf0-spine0, 2->0 up leaf1-spine0) lose independently."""
    rate = 0.02
    shared = _net("leaf0-spine0:ge:rate=0.02,burst=8")
    a, b = _masks(shared, [(0, 2), (1, 3)], 200000)
    both, first = int((a & b).sum()), int(a.sum())
    assert stats.binomtest(both, first, rate, alternative="greater").pvalue < 1e-12
    assert both / first > 0.5
    apart = LossyNetwork(NetworkSpec(4, "none", ranks_per_node=1, fabric=SMALL, channels=1,
                                     bad_link=("leaf0-spine0:ge:rate=0.02,burst=8", "leaf1-spine0:ge:rate=0.02,burst=8")))
    a, c = _masks(apart, [(0, 2), (2, 0)], 200000)
    assert stats.binomtest(int((a & c).sum()), int(a.sum()), rate).pvalue > 1e-3
    # each flow still loses at the cable's rate
    assert stats.binomtest(int(a.sum()), a.size, rate).pvalue > 1e-4


def test_chains_are_the_same_in_every_process():
    code = ("import torch; from lossysim.net import LossyNetwork, NetworkSpec;"
            f"n = LossyNetwork(NetworkSpec(4, 'none', ranks_per_node=1, fabric='{SMALL}', "
            "bad_link=('leaf0-spine0:ge:rate=0.05,burst=4',)));"
            "[n.simulate('s', 'fwd', 30000, torch.float32, 'all_reduce', deliver=False) for _ in range(3)];"
            "print(sorted((r['src'], r['dst'], r['lost']) for r in n.stats()))")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert runs[0] == runs[1] and "(1, 2, 0)" not in runs[0]


def test_spraying_spreads_a_link_over_every_spine():
    """Sprayed, a leaf0 -> leaf1 link's packets split evenly over its two spines, so a bad cable on one
    of them takes half its packets' share; hashed (ECMP, one queue pair), a flow takes one path."""
    fabric = "leaf-spine:nodes=4,leaves=2,spines=2"
    sprayed = NetworkSpec(4, "none", ranks_per_node=1, fabric=fabric, routing="spray", channels=1, nic="irn",
                          bad_link=("leaf0-spine0:bernoulli:0.1",))
    assert sprayed.cables.crosses(0, 2) == {sprayed.cables.fabric.cable("leaf0-spine0"): 0.5}
    hashed = NetworkSpec(4, "none", ranks_per_node=1, fabric=fabric, channels=1, bad_link=("leaf0-spine0:bernoulli:0.1",))
    assert set(hashed.cables.crosses(0, 2).values()) <= {1.0}


@pytest.mark.parametrize("changes, message", [
    (dict(bad_link=("leaf7-spine0:bernoulli:0.01",)), "cable 'leaf7-spine0' is not in fabric"),
    (dict(bad_link=("leaf0-spine0",)), "must be CABLE:LOSS"),
    (dict(fabric="leaf-spine:nodes=2"), "has 2 nodes"),
    (dict(fabric="superpod:3"), "superpod:3"),
    (dict(routing="sideways"), "routing='sideways'"),
    (dict(fabric="none", bad_link=("leaf0-spine0:bernoulli:0.1",)), "needs a fabric"),
])
def test_bad_fabric_settings_are_one_line_errors(changes, message):
    settings = dict(fabric=SMALL, bad_link=("leaf0-spine0:bernoulli:0.1",)) | changes
    with pytest.raises(ValueError, match=message) as error:
        NetworkSpec(4, "none", ranks_per_node=1, **settings)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("flags, message", [
    (["--fabric", "leaf-spine:nodes=2"], "has 2 nodes"),
    (["--fabric", SMALL, "--bad-link", "spine9-leaf0:bernoulli:0.01"], "not in fabric"),
    (["--fabric", "missing.yaml"], "fabric file missing.yaml"),
])
def test_bad_fabric_input_at_the_cli_exits_2(flags, message):
    result = subprocess.run([sys.executable, "-m", "lossysim", "estimate", "tiny", "--seq", "64", "--tp-size", "1",
                             "--dp-size", "4", "--gpus-per-node", "1", "--steps", "1", *flags],
                            capture_output=True, text=True)
    assert result.returncode == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.usefixtures("private_cache")
def test_training_on_a_fabric_dist_equals_sim_and_loses_only_on_the_bad_cable(tmp_path, one_torch_thread):
    """tp 1 x dp 2 on two nodes, one on each leaf; the cable up from leaf0 loses in bursts under DP's
    buckets: sim and two gloo processes agree bit for bit and DP traffic loses packets; only the link
    node0 -> node1 crosses that cable, the way back (up from leaf1) loses nothing."""
    from test_data_parallel import assert_dist_is_sim, sim_and_dist

    fabric = "leaf-spine:nodes=2,leaves=2,spines=1"
    rows, weights = sim_and_dist(tmp_path, tp_size=1, dp_size=2, ranks_per_node=1, fabric=fabric,
                                 bad_link="leaf0-spine0:ge:rate=0.05,burst=4", lossy_traffic="dp", steps=3)
    assert_dist_is_sim(rows, weights)
    last = [r for r in rows["sim"] if r["split"] == "train"][-1]
    assert last["packets_lost_dp"] > 0
    spec = NetworkSpec(2, "none", ranks_per_node=1, fabric=fabric, bad_link=("leaf0-spine0:bernoulli:0.5",))
    assert spec.link_lossy(0, 1) and not spec.link_lossy(1, 0)


def test_the_estimate_simulates_every_group_that_crosses_a_lossy_cable_and_names_its_blast_radius():
    """tp 2 x pp 2 x dp 4 on 8 nodes of 2, nodes 0-3 on leaf0 and 4-7 on leaf1: each DP group sits under
    one leaf (no cable), every pipeline boundary joins the leaves. With one sampled group a stage, every
    boundary group whose route crosses the bad cable is still simulated, each standing for itself, the clean
    ones alias one; the blast radius names exactly the ranks whose links cross it, and only pp traffic."""
    from lossysim.estimate.job import Job
    from lossysim.estimate.shapes import load
    from lossysim.estimate.simulate import estimate
    from lossysim.estimate.workload import Workload, job_config
    from lossysim.pp.stages import stage_layout

    config = job_config("tiny-llama", 1, "bf16", None, tp_size=2, pp_size=2, dp_size=4, ranks_per_node=2,
                        fabric="leaf-spine:nodes=8,leaves=2,spines=2", bad_link="leaf0-spine0.0:bernoulli:0.02",
                        transport="retransmit", nic="irn", seed=1)
    shape, w = load("tiny-llama"), Workload(256, sampled_groups=1)
    job = Job(shape, config, w, stage_layout(None, 2, shape.layers), 256)
    groups = job.pp[0]
    crossing = [g for g in groups if g.spec.can_lose]
    assert crossing and all(g.copies == 1 and g.same_as < 0 for g in crossing)
    assert job._sample(groups) == (groups, 0)
    assert all(g.same_as >= 0 or g.spec.can_lose or g.copies == len(groups) - len(crossing) for g in groups)
    assert all(len(g) == 1 for g in job.dp)        # under one leaf: one clean group stands for all
    expected = set()
    for g in crossing:
        place = g.spec.cables
        for t in range(2):     # a boundary's sends: TP rank t of one stage to TP rank t of the next, and back
            for s, d in ((t, 2 + t), (2 + t, t)):
                if place.lossy(s, d):
                    expected |= {place.ranks[s], place.ranks[d]}
    row = estimate(shape, config, w, steps=1)
    (blast,) = row["blast"]
    assert blast["cable"] == "leaf0-spine0.0" and set(blast["groups"]) == {"pp"}
    assert blast["ranks"] == len(expected) and set(blast["ranks_first"]) <= expected
    assert 0 < blast["share"]["pp"] < 1 and row["pp_packets_lost"] > 0 and row["dp_packets_lost"] == 0
