"""NCCL's trees in the shared-cable factors: where a group's all-reduce runs as a tree (``algorithm=tree``, or
``auto``'s pick), the factor takes the tree's flows (NCCL's double binary tree of the nodes, a chain within
each), not a ring's; with the ring, the default, nothing changes."""
from __future__ import annotations

from collections import Counter

import pytest

from lossysim.estimate import collisions
from lossysim.fabric.load import Flow, dtree_parents, tree_flows
from tests.test_data_parallel import tiny

# 6 nodes of one rank, nodes 0-2 on leaf0 and 3-5 on leaf1, each leaf one uplink (3 nodes over 3); dp 5 on
# nodes 0-4
FABRIC = "leaf-spine:nodes=6,leaves=2,spines=1,oversubscription=3"


def _config(tmp_path, **changes):
    return tiny(tmp_path, tp_size=1, dp_size=5, batch_size=10, ranks_per_node=1, channels=1,
                transport="retransmit", fabric=FABRIC, **changes)


def test_the_double_binary_tree_is_nccls():
    # NCCL's trees.cc draws 12 ranks (the second tree mirrored: root 11) and 13 (shifted by one: root 1)
    first, second = dtree_parents(12)
    assert first == [-1, 2, 4, 2, 8, 6, 4, 6, 0, 10, 8, 10]
    assert second == [1, 3, 1, 11, 5, 7, 5, 3, 9, 7, 9, -1]
    first, second = dtree_parents(13)
    assert first[12] == 8 and first[10] == 12 and first[8] == 0
    assert second == [9, -1, 3, 5, 3, 9, 7, 5, 7, 1, 11, 0, 11]
    assert dtree_parents(1) == ([-1], [-1]) and dtree_parents(2) == ([-1, 0], [1, -1])


def test_a_tree_edge_carries_half_the_message_each_way_and_a_chain_the_whole():
    # 2 ranks a node: the chains 0-1 and 2-3 (NVLink) and the two trees' edge between the leaders 0 and 2
    flows = Counter(tree_flows([[0, 1, 2, 3]], 8.0, ranks_per_node=2))
    assert flows == {Flow(0, 1, 8.0): 1, Flow(1, 0, 8.0): 1, Flow(2, 3, 8.0): 1, Flow(3, 2, 8.0): 1,
                     Flow(2, 0, 4.0): 2, Flow(0, 2, 4.0): 2}


def test_the_trees_factor_counts_its_half_flows_on_the_uplink(tmp_path):
    """Five nodes' trees (the first 0-4, 4-2, 2-1, 2-3; the second, shifted, 1-0, 0-3, 3-2, 3-4) cross the
    leaves on 0-4, 2-4, 2-3, 0-3, 2-3: five half messages each way on leaf0's one uplink, while the busiest
    NIC (nodes 2 and 3: three edges of one tree, one of the other) sends four: 5/4. The ring 0-1-2-3-4
    crosses once each way, as each NIC sends: 1."""
    first, second = dtree_parents(5)
    assert first == [-1, 2, 4, 2, 0] and second == [1, -1, 3, 0, 3]
    ring, tree = _config(tmp_path), _config(tmp_path, algorithm="tree")
    assert collisions.trees(ring) == () and collisions.factors(ring)["dp"] == 1.0
    assert collisions.trees(tree) == ("tp", "dp", "edp")
    assert collisions.factors(tree)["dp"] == pytest.approx(5 / 4, rel=1e-12)
    assert collisions.summary(tree) == {"dp": pytest.approx(1.25)}
    assert collisions.columns(collisions.factors(tree), collisions.classes_of(tree))["fabric_slowdown"] == "dp 1.25x"
    # auto: the tree's flows exactly where NCCL's tuner runs the buckets' all-reduce as a tree
    auto = _config(tmp_path, algorithm="auto")
    expected = 5 / 4 if "dp" in collisions.trees(auto) else 1.0
    assert collisions.factors(auto)["dp"] == pytest.approx(expected, rel=1e-12)
    # FSDP's gathers and reduce-scatters run on rings whatever the algorithm
    assert "dp" not in collisions.trees(_config(tmp_path, algorithm="tree", dp_mode="fsdp"))


def test_link_events_meet_the_trees_flows_where_the_all_reduce_runs_as_a_tree(tmp_path):
    """A link event's loads take the same flows as the factor: under the tree, dp 5's two trees (16 half
    edges, each carrying a sixteenth of the bytes) cross leaf0's uplink 10 times, 10/16 of the class's bytes;
    the ring (5 equal flows) crosses it twice, 2/5."""
    from lossysim.estimate import events
    tree = _config(tmp_path, algorithm="tree")
    mesh, row = tree.mesh(), {"dp_packets_sent": 1600.0}
    on_tree = events._flows(mesh, ("dp",), row, 1, 1, collisions.trees(tree), 1)["dp"]
    on_ring = events._flows(mesh, ("dp",), row, 1, 1)["dp"]
    assert sum(f.bytes for f in on_tree) == pytest.approx(1600.0) and len(on_tree) == 16
    assert {f.bytes for f in on_tree} == {100.0}
    assert Counter((f.src, f.dst) for f in on_tree) == Counter((f.src, f.dst) for f in tree_flows([range(5)], 1.0))
    leaf = {0: 0, 1: 0, 2: 0, 3: 1, 4: 1}
    crossing = lambda flows: sum(f.bytes for f in flows if leaf[f.src] != leaf[f.dst])
    assert crossing(on_tree) == pytest.approx(1600.0 * 10 / 16)
    assert crossing(on_ring) == pytest.approx(1600.0 * 2 / 5)


def test_an_estimates_link_event_counts_the_trees_flows_on_its_cable():
    """End to end: the cable leaf0-spine0 carries the ring's 2 crossing flows (on 2 channels: 4), the trees'
    10 (20), as the factor's flows."""
    from lossysim.estimate.shapes import load
    from lossysim.estimate.simulate import estimate
    from lossysim.estimate.workload import Workload, job_config
    described = {}
    for algorithm in ("ring", "tree"):
        config = job_config("llama-3.2-1b", 1, "bf16", None, tp_size=1, dp_size=5, ranks_per_node=1, channels=2,
                            fabric=FABRIC, algorithm=algorithm, transport="retransmit", nic="irn",
                            link_event="leaf0-spine0:down:at=1,for=1", event_steps=100)
        described[algorithm] = estimate(load("llama-3.2-1b"), config, Workload(2048), steps=1)["event_flows"]
    assert described == {"ring": "leaf0-spine0: dp 4 flows", "tree": "leaf0-spine0: dp 20 flows"}
