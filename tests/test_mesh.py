"""The mesh: which global rank is which (replica, stage, TP rank), which node holds it, and the networks its
groups train over, in closed form."""
from __future__ import annotations

import re

import pytest
from hypothesis import given, settings, strategies as st

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
def test_tp2_pp2_dp2_ranks_are_laid_out_in_megatrons_order():
    """By hand, the default order tp-cp-ep-dp-pp: rank = (stage * dp + replica) * tp + tp_rank; a stage's
    TP group to a node by default."""
    mesh = Mesh(2, 2, pp=2)
    assert mesh.order == "tp-cp-ep-dp-pp" and mesh.world == 8
    assert [mesh.position(r) for r in range(8)] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1),
                                                     (0, 1, 0), (0, 1, 1), (1, 1, 0), (1, 1, 1)]
    assert all(mesh.rank(replica, t, stage) == r for r, (replica, stage, t) in enumerate(map(mesh.position, range(8))))
    assert mesh.coordinate(6) == (1, 0)                      # (replica, tp_rank): the stage is position's
    assert [mesh.tp_ranks(r, s) for s in range(2) for r in range(2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [mesh.dp_ranks(t, s) for s in range(2) for t in range(2)] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [mesh.pp_ranks(r, t) for r in range(2) for t in range(2)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.stage_ranks(0) == [0, 1, 2, 3] and mesh.stage_ranks(1) == [4, 5, 6, 7]
    assert [mesh.node(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    # a rank's three groups meet in that rank alone
    for r in range(8):
        replica, stage, t = mesh.position(r)
        assert set(mesh.tp_ranks(replica, stage)) & set(mesh.dp_ranks(t, stage)) == {r}
        assert set(mesh.tp_ranks(replica, stage)) & set(mesh.pp_ranks(replica, t)) == {r}
        assert set(mesh.dp_ranks(t, stage)) & set(mesh.pp_ranks(replica, t)) == {r}


def test_the_old_order_is_one_setting_away():
    """0.4 laid ranks out tp, then pp, then dp: ``parallel_order=tp-cp-ep-pp-dp`` restores it."""
    mesh = Mesh(2, 2, pp=2, order="tp-cp-ep-pp-dp")
    assert [mesh.position(r) for r in range(8)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
                                                     (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert [mesh.dp_ranks(t, s) for s in range(2) for t in range(2)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [mesh.pp_ranks(r, t) for r in range(2) for t in range(2)] == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_megatrons_own_example():
    """Megatron-core's ``initialize_model_parallel`` docstring: 16 GPUs, tp 2, pp 4, dp 2 (order
    tp-cp-ep-dp-pp): TP groups [0, 1], [2, 3], ...; DP groups [0, 2], [1, 3], [4, 6], [5, 7], ...;
    pipelines [0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]."""
    mesh = Mesh(2, 2, pp=4)
    assert mesh.groups("tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert mesh.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert mesh.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert mesh.groups("cp") == [[r] for r in range(16)]     # an axis of size 1: every rank alone


@given(sizes=st.tuples(*[st.integers(1, 3)] * 4), order=st.permutations(["tp", "cp", "ep", "dp", "pp"]))
@settings(max_examples=60, deadline=None)
def test_one_rule_gives_every_axis_its_groups(sizes, order):
    """Any sizes, any order: each axis's groups partition the world, a group's ranks differ in that axis
    alone (walked in order), and two axes' groups through a rank meet in that rank only."""
    tp, cp, dp, pp = sizes
    mesh = Mesh(tp, dp, pp=pp, cp=cp, order="-".join(order))
    assert mesh.world == tp * cp * dp * pp
    for axis in ("tp", "cp", "dp", "pp"):
        groups = mesh.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(mesh.world))
        for group in groups:
            coords = [mesh.coordinates(r) for r in group]
            assert [c[axis] for c in coords] == list(range(getattr(mesh, axis)))
            assert all({k: v for k, v in c.items() if k != axis} == {k: v for k, v in coords[0].items() if k != axis}
                       for c in coords)
    for r in range(mesh.world):
        assert mesh.rank_at(**mesh.coordinates(r)) == r
        assert set(mesh.group("tp", r)) & set(mesh.group("dp", r)) & set(mesh.group("pp", r)) == {r}


def test_tp4_on_8_gpu_nodes_puts_two_replicas_of_a_stage_on_a_node():
    """Where the order matters: more than one TP group to a node. Megatron's order (pp outermost) puts two
    replicas of a stage on a node, so their data-parallel link stays on NVLink and the pipeline boundary
    crosses nodes; 0.4's order put two stages of a replica there, the other way round."""
    settings = dict(loss="bernoulli:0.01", seed=1, ranks_per_node=8)
    new, old = Mesh(4, 2, 8, pp=2), Mesh(4, 2, 8, pp=2, order="tp-cp-ep-pp-dp")
    assert [new.position(r) for r in (0, 4)] == [(0, 0, 0), (1, 0, 0)]
    assert [old.position(r) for r in (0, 4)] == [(0, 0, 0), (0, 1, 0)]
    assert new.dp_network_spec(settings, 0, ("bwd",)).topology.nodes == 1
    assert old.dp_network_spec(settings, 0, ("bwd",)).topology.nodes == 2
    assert new.pp_network_spec(settings, 0, 0, ("fwd",)).topology.nodes == 2
    assert old.pp_network_spec(settings, 0, 0, ("fwd",)).topology.nodes == 1


@pytest.mark.parametrize("kwargs,needle", [
    (dict(tp=2, dp=1, ranks_per_node=3, pp=2), "ranks_per_node=3 must divide tp_size=2 or be a multiple of it, "
                                               "and divide the world tp2 x pp2 x dp1 = 4"),
    (dict(tp=1, dp=1, ranks_per_node=3, pp=2), "ranks_per_node=3 is more GPUs than the layout's tp1 x pp2 x dp1"),
    (dict(tp=1, dp=2, ranks_per_node=3, pp=2), "ranks_per_node=3 must divide"),
    (dict(tp=4, dp=2, ranks_per_node=6), "ranks_per_node=6 must divide tp_size=4"),
    (dict(tp=2, dp=0), "dp_size=0 must be an integer >= 1"),
    (dict(tp=2, dp=3, ep=2), "ep_size=2 must divide dp_size x cp_size = 3"),
    (dict(tp=2, order="tp-dp-pp"), "parallel_order='tp-dp-pp' must name each of tp, cp, ep, dp, pp once"),
    (dict(tp=2, order="tp-tp-ep-dp-pp"), "must name each of"),
])
def test_a_layout_the_mesh_cannot_place_is_one_line(kwargs, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        Mesh(**kwargs)


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
])
def test_a_boundary_the_mesh_cannot_place_is_refused(mesh, boundary, needle):
    with pytest.raises(ValueError, match=needle):
        mesh.pp_network_spec(dict(seed=1), 0, boundary, ("fwd",))


@pytest.mark.parametrize("tp,dp,pp", [(2, 2, 1), (2, 2, 2), (1, 2, 3)])
def test_every_process_creates_every_group_in_one_order(tp, dp, pp, monkeypatch):
    """dist's groups (new_group read back): every axis's groups, axis by axis in the mesh's order, each
    rank's group the one holding it."""
    import torch.distributed as dist
    created = []
    monkeypatch.setattr(dist, "new_group", lambda ranks: created.append(list(ranks)) or tuple(ranks))
    mesh = Mesh(tp, dp, pp=pp)
    groups = mesh.process_groups()
    assert created == [g for axis in mesh.axes for g in mesh.groups(axis)]
    for r in range(mesh.world):
        replica, stage, t = mesh.position(r)
        assert groups["tp"][r] == tuple(mesh.tp_ranks(replica, stage))
        assert groups["dp"][r] == tuple(mesh.dp_ranks(t, stage))
        assert groups["pp"][r] == tuple(mesh.pp_ranks(replica, t))


@pytest.mark.parametrize("train, estimate, needle", [
    (["--tp-size", "1", "--pp-size", "2", "--set", "ranks_per_node=3"],
     ["--tp-size", "1", "--pp-size", "2", "--ranks-per-node", "3"], "ranks_per_node=3 is more GPUs than the layout's"),
    (["--tp-size", "2", "--pp-size", "2", "--dp-size", "2", "--dp-mode", "fsdp"],
     ["--tp-size", "2", "--pp-size", "2", "--dp-size", "2", "--dp-mode", "fsdp"], "dp_mode=fsdp with pp_size=2"),
    (["--tp-size", "2", "--pp-size", "2", "--recovery", "outliers"],
     ["--tp-size", "2", "--pp-size", "2", "--recovery", "outliers"],
     "pp_size=2: recovery=outliers does not act on point-to-point sends"),
    (["--tp-size", "2", "--set", "parallel_order=tp-dp-pp"], ["--tp-size", "2", "--parallel-order", "tp-dp-pp"],
     "parallel_order='tp-dp-pp' must name each of"),
])
def test_train_sweep_and_estimate_refuse_a_layout_in_one_and_the_same_line(train, estimate, needle, tmp_path, capsys):
    """One layout check (the mesh's, and the config's pairs) for every command: the same one line, exit 2,
    nothing written."""
    import yaml
    from lossysim.cli import main
    lines = []
    for argv in (["train", "--steps", "1", "--set", "batch_size=8", "--out", str(tmp_path / "t"), "--no-progress", *train],
                 ["estimate", "tiny-llama", "--seq", "8", "--steps", "1", "--no-progress", *estimate]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
        lines.append(err.split(": error: ", 1)[1])
    assert lines[0] == lines[1]
    overrides = dict(zip(train[0::2], train[1::2]))
    keys = {flag.lstrip("-").replace("-", "_"): value for flag, value in overrides.items() if flag != "--set"}
    keys.update(dict(v.split("=", 1) for f, v in zip(train[0::2], train[1::2]) if f == "--set"))
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"base": {}, "steps": 1, "batch_size": 8, "grid": [{k: [v] for k, v in keys.items()}]}))
    assert main(["sweep", str(spec), "--out", str(tmp_path / "s"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and lines[0] in err, err
    assert not (tmp_path / "t").exists() and not (tmp_path / "s").exists()
