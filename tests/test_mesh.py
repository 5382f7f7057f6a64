"""The mesh: which global rank is which (replica, stage, TP rank), which node holds it, and the networks its
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


# -- the pipeline axis ------------------------------------------------------------------------------
def test_tp2_pp2_dp2_ranks_are_laid_out_tp_then_pp_then_dp():
    """By hand: rank = (replica * pp + stage) * tp + tp_rank; a stage's TP group to a node by default."""
    mesh = Mesh(2, 2, pp=2)
    assert mesh.world == 8
    assert [mesh.position(r) for r in range(8)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
                                                     (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert all(mesh.rank(replica, t, stage) == r for r, (replica, stage, t) in enumerate(map(mesh.position, range(8))))
    assert mesh.coordinate(6) == (1, 0)                      # (replica, tp_rank): the stage is position's
    assert [mesh.tp_ranks(r, s) for r in range(2) for s in range(2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [mesh.dp_ranks(t, s) for s in range(2) for t in range(2)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [mesh.pp_ranks(r, t) for r in range(2) for t in range(2)] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.stage_ranks(0) == [0, 1, 4, 5] and mesh.stage_ranks(1) == [2, 3, 6, 7]
    assert [mesh.node(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    # a rank's three groups meet in that rank alone
    for r in range(8):
        replica, stage, t = mesh.position(r)
        assert set(mesh.tp_ranks(replica, stage)) & set(mesh.dp_ranks(t, stage)) == {r}
        assert set(mesh.tp_ranks(replica, stage)) & set(mesh.pp_ranks(replica, t)) == {r}
        assert set(mesh.dp_ranks(t, stage)) & set(mesh.pp_ranks(replica, t)) == {r}


@pytest.mark.parametrize("tp,dp,per_node", [(2, 4, 4), (4, 2, 2), (1, 3, None)])
def test_one_stage_is_the_mesh_it_was(tp, dp, per_node):
    """pp = 1 (the default, fourth in order): positions are (replica, 0, t), groups and the networks'
    specs are those of a mesh without the axis."""
    mesh, flat = Mesh(tp, dp, per_node), Mesh(tp, dp, per_node, 1)
    assert mesh == flat and mesh.pp == 1
    assert [mesh.position(r) for r in range(mesh.world)] == [(r, 0, t) for r in range(dp) for t in range(tp)]
    base = dict(loss="bernoulli:0.01", seed=7, ranks_per_node=per_node)
    assert mesh.tp_network_spec(base, 1, 0) == mesh.tp_network_spec(base, 1)
    assert mesh.dp_network_spec(base, 0, ("bwd",), 0) == mesh.dp_network_spec(base, 0, ("bwd",))


def test_stages_draw_streams_of_their_own():
    """Replica 0's first stage keeps the run's seed (a one-stage run is bit for bit what it was); every
    other stage's TP group, every stage's DP groups and every boundary get their own."""
    base = dict(loss="bernoulli:0.01", seed=7)
    mesh = Mesh(2, 2, pp=3)
    assert mesh.tp_network_spec(base).seed == 7
    assert mesh.tp_network_spec(base, 1).seed == stream_seed(7, "tp.replica1", "network")
    assert mesh.tp_network_spec(base, 0, 2).seed == stream_seed(7, "tp.replica0.stage2", "network")
    assert mesh.tp_network_spec(base, 1, 1).seed == stream_seed(7, "tp.replica1.stage1", "network")
    assert mesh.dp_network_spec(base, 1, ("bwd",)).seed == stream_seed(7, "dp.group1", "network")
    assert mesh.dp_network_spec(base, 1, ("bwd",), 2).seed == stream_seed(7, "dp.stage2.group1", "network")
    assert mesh.pp_network_spec(base, 1, 0, ("fwd",)).seed == stream_seed(7, "pp.replica1.boundary0", "network")
    seeds = {mesh.tp_network_spec(base, r, s).seed for r in range(2) for s in range(3)}
    seeds |= {mesh.pp_network_spec(base, r, b, ("fwd",)).seed for r in range(2) for b in range(2)}
    seeds |= {mesh.dp_network_spec(base, t, ("bwd",), s).seed for t in range(2) for s in range(3)}
    assert len(seeds) == 6 + 4 + 6


def test_a_boundarys_network_holds_both_stages_on_their_nodes():
    """2 tp ranks: stage b's TP ranks then stage b + 1's; local rank t sends to tp + t over the link the
    mesh places between their global ranks; every site lossy, ``lossy`` the directions that lose."""
    base = dict(loss="bernoulli:0.01", seed=7, lossy_layers="0-1", lossy_sites="attn", ranks_per_node=None)
    mesh = Mesh(2, 1, pp=4)                                   # a stage to a node (the default)
    spec = mesh.pp_network_spec(base, 0, 1, ("fwd",))
    assert (spec.ranks, spec.ranks_per_node, spec.topology.nodes) == (4, 2, 2)
    assert spec.lossy == ("fwd",) and spec.selection.everything
    for b in range(3):
        spec = mesh.pp_network_spec(base, 0, b, ("fwd", "bwd"))
        ranks = mesh.tp_ranks(0, b) + mesh.tp_ranks(0, b + 1)
        for i in range(4):
            for j in range(4):
                if i != j:
                    same = mesh.node(ranks[i]) == mesh.node(ranks[j])
                    assert spec.topology.link_class(i, j) == ("intra" if same else "inter")
    # two stages to a node: boundaries 0 and 2 stay inside one, boundary 1 crosses
    paired = Mesh(2, 1, ranks_per_node=4, pp=4)
    assert [paired.pp_network_spec(base, 0, b, ("fwd",)).topology.nodes for b in range(3)] == [1, 2, 1]
    # a TP group over two nodes: each stage's halves on nodes of their own
    assert Mesh(4, 1, ranks_per_node=2, pp=2).pp_network_spec(base, 0, 0, ("bwd",)).topology.nodes == 4


@pytest.mark.parametrize("mesh,boundary,needle", [
    (Mesh(2, 1, pp=3), 2, "boundary=2: a pipeline of 3 stages has boundaries 0..1"),
    (Mesh(2, 1, pp=1), 0, "boundary=0: one stage has no pipeline boundary"),
    (Mesh(2, 1, ranks_per_node=3, pp=2), 0, "ranks_per_node=3 puts ranks"),
])
def test_a_boundary_the_mesh_cannot_place_is_refused(mesh, boundary, needle):
    with pytest.raises(ValueError, match=needle):
        mesh.pp_network_spec(dict(seed=1), 0, boundary, ("fwd",))


@pytest.mark.parametrize("tp,dp,pp", [(2, 2, 1), (2, 2, 2), (1, 2, 3)])
def test_every_process_creates_every_group_in_one_order(tp, dp, pp, monkeypatch):
    """dist's groups (new_group read back): tp indexed by rank // tp, dp by rank % (tp pp), pp by
    replica * tp + tp_rank; with one stage no pipeline groups and the tp and dp groups as before."""
    import torch.distributed as dist
    created = []
    monkeypatch.setattr(dist, "new_group", lambda ranks: created.append(list(ranks)) or tuple(ranks))
    mesh = Mesh(tp, dp, pp=pp)
    groups = mesh.process_groups()
    assert created == [list(g) for kind in ("tp", "dp", "pp") for g in groups[kind]]
    for r in range(mesh.world):
        replica, stage, t = mesh.position(r)
        assert r in groups["tp"][r // tp] and r in groups["dp"][r % (tp * pp)]
        assert groups["tp"][r // tp] == tuple(mesh.tp_ranks(replica, stage))
        assert groups["dp"][r % (tp * pp)] == tuple(mesh.dp_ranks(t, stage))
        if pp > 1:
            assert groups["pp"][replica * tp + t] == tuple(mesh.pp_ranks(replica, t))
    if pp == 1:
        assert groups["pp"] == []
        assert groups["tp"] == [tuple(mesh.tp_ranks(r)) for r in range(dp)]
        assert groups["dp"] == [tuple(mesh.dp_ranks(t)) for t in range(tp)]
