"""The mesh: which global rank is which (replica, TP rank), which node holds it, and the networks its
groups train over, in closed form."""
from __future__ import annotations

import pytest

from lossysim.mesh import Mesh
from lossysim.util import stream_seed


@pytest.mark.parametrize("tp,dp,per_node", [(2, 4, 4), (4, 2, 2), (1, 3, None), (3, 1, None)])
def test_every_rank_has_one_coordinate_and_one_group_of_each_kind(tp, dp, per_node):
    mesh = Mesh(tp, dp, per_node)
    assert [mesh.coordinate(r) for r in range(mesh.world)] == [(r, t) for r in range(dp) for t in range(tp)]
    assert all(mesh.rank(*mesh.coordinate(r)) == r for r in range(mesh.world))
    tp_groups = [mesh.tp_ranks(r) for r in range(dp)]
    dp_groups = [mesh.dp_ranks(t) for t in range(tp)]
    for groups in (tp_groups, dp_groups):
        assert sorted(r for g in groups for r in g) == list(range(mesh.world))
    # a rank's TP group and its DP group meet in that rank alone
    for r in range(mesh.world):
        replica, t = mesh.coordinate(r)
        assert set(tp_groups[replica]) & set(dp_groups[t]) == {r}
    per = tp if per_node is None else per_node
    assert [mesh.node(r) for r in range(mesh.world)] == [r // per for r in range(mesh.world)]


def test_group_networks_are_placed_on_the_mesh():
    base = dict(loss="bernoulli:0.01", seed=7, ranks_per_node=4)     # a run's network settings: no group size
    mesh = Mesh(2, 4, ranks_per_node=4)          # two replicas to a node
    assert mesh.tp_network_spec(base).ranks == 2                   # the mesh says how many ranks a group has
    assert mesh.tp_network_spec(base).ranks_per_node == 2          # a TP group spans one node
    assert mesh.tp_network_spec(base).seed == 7                    # replica 0 keeps the run's streams
    assert mesh.tp_network_spec(base, 3).seed == stream_seed(7, "tp.replica3", "network")
    group = mesh.dp_network_spec(base, 1, ("bwd",))
    # 4 replicas, 2 to a node: the DP group's ranks 1, 3 | 5, 7 pair up on two nodes
    assert (group.ranks, group.ranks_per_node, group.topology.nodes) == (4, 2, 2)
    assert [mesh.node(r) for r in mesh.dp_ranks(1)] == [0, 0, 1, 1]
    assert group.lossy == ("bwd",) and group.seed == stream_seed(7, "dp.group1", "network")
    assert mesh.dp_network_spec(base, 0, ()).seed != group.seed
    # one replica to a node (the default): every DP rank on its own node
    assert Mesh(2, 4).dp_network_spec({**base, "ranks_per_node": None}, 0, ("bwd",)).topology.nodes == 4
