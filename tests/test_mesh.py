"""The mesh: which global rank is which (replica, stage, TP rank), which node holds it, and the networks its
groups train over, in closed form."""
from __future__ import annotations

import re

import pytest
from hypothesis import given, settings, strategies as st

from lossysim.mesh import Mesh
from lossysim.util import stream_seed


def position(mesh: Mesh, rank: int) -> tuple[int, int, int]:
    """(replica, stage, tp rank) of a global rank, read from its coordinates."""
    at = mesh.coordinates(rank)
    return at["dp"], at["pp"], at["tp"]


@pytest.mark.parametrize("tp,dp,per_node", [(2, 4, 4), (4, 2, 2), (1, 3, None), (3, 1, None)])
def test_every_rank_has_one_coordinate_and_one_group_of_each_kind(tp, dp, per_node):
    mesh = Mesh(tp, dp, per_node)
    assert [position(mesh, r) for r in range(mesh.world)] == [(r, 0, t) for r in range(dp) for t in range(tp)]
    assert all(mesh.rank(dp=position(mesh, r)[0], tp=position(mesh, r)[2]) == r for r in range(mesh.world))
    tp_groups = [mesh.group("tp", mesh.rank(dp=r)) for r in range(dp)]
    dp_groups = [mesh.group("dp", mesh.rank(tp=t)) for t in range(tp)]
    for groups in (tp_groups, dp_groups):
        assert sorted(r for g in groups for r in g) == list(range(mesh.world))
    # a rank's TP group and its DP group meet in that rank alone
    for r in range(mesh.world):
        replica, _, t = position(mesh, r)
        assert set(tp_groups[replica]) & set(dp_groups[t]) == {r}
    per = tp if per_node is None else per_node
    assert [mesh.node(r) for r in range(mesh.world)] == [r // per for r in range(mesh.world)]


def test_group_networks_are_placed_on_the_mesh():
    base = dict(loss="bernoulli:0.01", seed=7, ranks_per_node=4)     # a run's network settings: no group size
    mesh = Mesh(2, 4, ranks_per_node=4)          # two replicas to a node
    assert mesh.network_spec("tp", 0, base).ranks == 2             # the mesh says how many ranks a group has
    assert mesh.network_spec("tp", 0, base).ranks_per_node == 2    # a TP group spans one node
    assert mesh.network_spec("tp", 1, base).seed == 7              # replica 0 keeps the run's streams
    assert mesh.network_spec("tp", mesh.rank(dp=3), base).seed == stream_seed(7, "tp.replica3", "network")
    group = mesh.network_spec("dp", mesh.rank(tp=1), base, ("bwd",))
    # 4 replicas, 2 to a node: the DP group's ranks 1, 3 | 5, 7 pair up on two nodes
    assert (group.ranks, group.ranks_per_node, group.topology.nodes) == (4, 2, 2)
    assert [mesh.node(r) for r in mesh.group("dp", 1)] == [0, 0, 1, 1]
    assert group.lossy == ("bwd",) and group.seed == stream_seed(7, "dp.group1", "network")
    assert mesh.network_spec("dp", 0, base, ()).seed != group.seed
    # one replica to a node (the default): every DP rank on its own node
    assert Mesh(2, 4).network_spec("dp", 0, {**base, "ranks_per_node": None}, ("bwd",)).topology.nodes == 4


# -- the pipeline axis ------------------------------------------------------------------------------
def test_tp2_pp2_dp2_ranks_are_laid_out_in_megatrons_order():
    """By hand, the default order tp-cp-ep-dp-pp: rank = (stage * dp + replica) * tp + tp_rank; a stage's
    TP group to a node by default."""
    mesh = Mesh(2, 2, pp=2)
    assert mesh.order == "tp-cp-ep-dp-pp" and mesh.world == 8
    assert [position(mesh, r) for r in range(8)] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1),
                                                      (0, 1, 0), (0, 1, 1), (1, 1, 0), (1, 1, 1)]
    assert all(mesh.rank(dp=replica, tp=t, pp=stage) == r
               for r, (replica, stage, t) in enumerate(position(mesh, r) for r in range(8)))
    assert mesh.rank(pp=1, dp=1) == 6 and mesh.rank(tp=1) == 1          # named coordinates, any order
    assert [mesh.group("tp", mesh.rank(dp=r, pp=s)) for s in range(2) for r in range(2)] == \
        [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [mesh.group("dp", mesh.rank(tp=t, pp=s)) for s in range(2) for t in range(2)] == \
        [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [mesh.group("pp", mesh.rank(dp=r, tp=t)) for r in range(2) for t in range(2)] == \
        [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [mesh.node(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    # a rank's three groups meet in that rank alone
    for r in range(8):
        assert set(mesh.group("tp", r)) & set(mesh.group("dp", r)) == {r}
        assert set(mesh.group("tp", r)) & set(mesh.group("pp", r)) == {r}
        assert set(mesh.group("dp", r)) & set(mesh.group("pp", r)) == {r}


def test_the_old_order_is_one_setting_away():
    """0.4 laid ranks out tp, then pp, then dp: ``parallel_order=tp-cp-ep-pp-dp`` restores it."""
    mesh = Mesh(2, 2, pp=2, order="tp-cp-ep-pp-dp")
    assert [position(mesh, r) for r in range(8)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
                                                      (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert [mesh.group("dp", mesh.rank(tp=t, pp=s)) for s in range(2) for t in range(2)] == \
        [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [mesh.group("pp", mesh.rank(dp=r, tp=t)) for r in range(2) for t in range(2)] == \
        [[0, 2], [1, 3], [4, 6], [5, 7]]


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
            assert [c[axis] for c in coords] == list(range(mesh.size(axis)))
            assert all({k: c[k] for k in mesh.axes if k != axis} == {k: coords[0][k] for k in mesh.axes if k != axis}
                       for c in coords)
    for r in range(mesh.world):
        assert mesh.rank(**mesh.coordinates(r)) == r
        assert set(mesh.group("tp", r)) & set(mesh.group("dp", r)) & set(mesh.group("pp", r)) == {r}


@given(sizes=st.tuples(*[st.integers(1, 3)] * 4), ep=st.integers(1, 9),
       order=st.permutations(["tp", "cp", "ep", "dp", "pp"]))
@settings(max_examples=60, deadline=None)
def test_groups_cut_from_dp_by_cp_walk_their_index_and_keep_every_other_coordinate(sizes, ep, order):
    """dp x cp (the gradients' group), ep and edp, any sizes, any order: a group through r holds r, walks its
    index in order (cp + cp_size x dp; ep; edp) and keeps r's every other coordinate, as ``coordinates`` reads
    them back."""
    tp, cp, dp, pp = sizes
    if (dp * cp) % ep:
        ep = 1
    mesh = Mesh(tp, dp, pp=pp, cp=cp, ep=ep, order="-".join(order))
    walks = {"dp_cp": lambda c: c["cp"] + cp * c["dp"], "ep": lambda c: c["ep"], "edp": lambda c: c["edp"]}
    kept = {"dp_cp": ("tp", "pp"), "ep": ("tp", "pp", "edp"), "edp": ("tp", "pp", "ep")}
    for r in range(mesh.world):
        at = mesh.coordinates(r)
        for axis, walk in walks.items():
            group = mesh.group(axis, r)
            coords = [mesh.coordinates(g) for g in group]
            assert r in group and [walk(c) for c in coords] == list(range(mesh.size(axis)))
            assert all(c[k] == at[k] for c in coords for k in kept[axis])


def test_tp4_on_8_gpu_nodes_puts_two_replicas_of_a_stage_on_a_node():
    """Where the order matters: more than one TP group to a node. Megatron's order (pp outermost) puts two
    replicas of a stage on a node, so their data-parallel link stays on NVLink and the pipeline boundary
    crosses nodes; 0.4's order put two stages of a replica there, the other way round."""
    settings = dict(loss="bernoulli:0.01", seed=1, ranks_per_node=8)
    new, old = Mesh(4, 2, 8, pp=2), Mesh(4, 2, 8, pp=2, order="tp-cp-ep-pp-dp")
    assert [position(new, r) for r in (0, 4)] == [(0, 0, 0), (1, 0, 0)]
    assert [position(old, r) for r in (0, 4)] == [(0, 0, 0), (0, 1, 0)]
    assert new.network_spec("dp", 0, settings, ("bwd",)).topology.nodes == 1
    assert old.network_spec("dp", 0, settings, ("bwd",)).topology.nodes == 2
    assert new.network_spec("pp", 0, settings, ("fwd",)).topology.nodes == 2
    assert old.network_spec("pp", 0, settings, ("fwd",)).topology.nodes == 1


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
    assert [position(mesh, r) for r in range(mesh.world)] == [(r, 0, t) for r in range(dp) for t in range(tp)]
    base = dict(loss="bernoulli:0.01", seed=7, ranks_per_node=per_node)
    if dp > 1:
        assert mesh.network_spec("tp", mesh.rank(dp=1, pp=0), base) == mesh.network_spec("tp", mesh.rank(dp=1), base)
    assert mesh.network_spec("dp", mesh.rank(pp=0), base, ("bwd",)) == mesh.network_spec("dp", 0, base, ("bwd",))


def test_stages_draw_streams_of_their_own():
    """Replica 0's first stage keeps the run's seed (a one-stage run is bit for bit what it was); every
    other stage's TP group, every stage's DP groups and every boundary get their own."""
    base = dict(loss="bernoulli:0.01", seed=7)
    mesh = Mesh(2, 2, pp=3)
    def seed(axis, lossy=None, **at):
        return mesh.network_spec(axis, mesh.rank(**at), base, lossy).seed
    assert seed("tp") == 7
    assert seed("tp", dp=1) == stream_seed(7, "tp.replica1", "network")
    assert seed("tp", pp=2) == stream_seed(7, "tp.replica0.stage2", "network")
    assert seed("tp", dp=1, pp=1) == stream_seed(7, "tp.replica1.stage1", "network")
    assert seed("dp", ("bwd",), tp=1) == stream_seed(7, "dp.group1", "network")
    assert seed("dp", ("bwd",), tp=1, pp=2) == stream_seed(7, "dp.stage2.group1", "network")
    assert seed("pp", ("fwd",), dp=1) == stream_seed(7, "pp.replica1.boundary0", "network")
    seeds = {seed("tp", dp=r, pp=s) for r in range(2) for s in range(3)}
    seeds |= {seed("pp", ("fwd",), dp=r, pp=b) for r in range(2) for b in range(2)}
    seeds |= {seed("dp", ("bwd",), tp=t, pp=s) for t in range(2) for s in range(3)}
    assert len(seeds) == 6 + 4 + 6


def test_a_boundarys_network_holds_both_stages_on_their_nodes():
    """2 tp ranks: stage b's TP ranks then stage b + 1's; local rank t sends to tp + t over the link the
    mesh places between their global ranks; every site lossy, ``lossy`` the directions that lose."""
    base = dict(loss="bernoulli:0.01", seed=7, lossy_layers="0-1", lossy_sites="attn", ranks_per_node=None)
    mesh = Mesh(2, 1, pp=4)                                   # a stage to a node (the default)
    spec = mesh.network_spec("pp", mesh.rank(pp=1), base, ("fwd",))
    assert (spec.ranks, spec.ranks_per_node, spec.topology.nodes) == (4, 2, 2)
    assert spec.lossy == ("fwd",) and spec.selection.everything
    for b in range(3):
        spec = mesh.network_spec("pp", mesh.rank(pp=b), base, ("fwd", "bwd"))
        ranks = mesh.group("tp", mesh.rank(pp=b)) + mesh.group("tp", mesh.rank(pp=b + 1))
        for i in range(4):
            for j in range(4):
                if i != j:
                    same = mesh.node(ranks[i]) == mesh.node(ranks[j])
                    assert spec.topology.link_class(i, j) == ("intra" if same else "inter")
    # two stages to a node: boundaries 0 and 2 stay inside one, boundary 1 crosses
    paired = Mesh(2, 1, ranks_per_node=4, pp=4)
    assert [paired.network_spec("pp", paired.rank(pp=b), base, ("fwd",)).topology.nodes for b in range(3)] == [1, 2, 1]
    # a TP group over two nodes: each stage's halves on nodes of their own
    assert Mesh(4, 1, ranks_per_node=2, pp=2).network_spec("pp", 0, base, ("bwd",)).topology.nodes == 4


@pytest.mark.parametrize("mesh,boundary,needle", [
    (Mesh(2, 1, pp=3), 2, "boundary=2: a pipeline of 3 stages has boundaries 0..1"),
    (Mesh(2, 1, pp=1), 0, "boundary=0: one stage has no pipeline boundary"),
])
def test_a_boundary_the_mesh_cannot_place_is_refused(mesh, boundary, needle):
    with pytest.raises(ValueError, match=needle):
        mesh.network_spec("pp", mesh.rank(pp=boundary), dict(seed=1), ("fwd",))


def test_expert_axes_are_carved_out_of_dp_by_cp():
    """ep 2 on dp 2 x cp 2 (tp 2): a rank's (cp, dp) index cp + 2 dp cut ep innermost; ep and edp have
    coordinates and groups like any axis, but no digit: naming them in a rank only checks them."""
    mesh = Mesh(2, 2, cp=2, ep=2)
    assert [(mesh.coordinates(r)["ep"], mesh.coordinates(r)["edp"]) for r in range(0, 8, 2)] == \
        [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert mesh.size("ep") == 2 and mesh.size("edp") == 2 and "edp" not in mesh.sizes
    assert mesh.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.group("ep", 6) == [4, 6] and mesh.group("edp", 6) == [2, 6]
    assert mesh.rank(dp=1, cp=1, ep=1, edp=1) == 6
    with pytest.raises(ValueError, match=re.escape("ep=0 is carved out of dp x cp: at dp=1, cp=1 it is 1")):
        mesh.rank(dp=1, cp=1, ep=0)
    with pytest.raises(ValueError, match=re.escape("replica: a coordinate is one of tp, cp, ep, dp, pp, edp")):
        mesh.rank(replica=1)


def test_one_rule_places_every_groups_network():
    """Each group's network from one rule: its ranks, their nodes, its streams' name (as they always were
    named), its own NICs for the groups that leave the node (dp, ep, edp) and every site lossy beyond TP."""
    base = dict(loss="bernoulli:0.01", seed=7, ranks_per_node=4, nics_per_node=2, lossy_sites="attn")
    mesh = Mesh(2, 2, ranks_per_node=4, pp=2, cp=2, ep=2)
    cases = [("tp", dict(dp=1, pp=1, cp=1), None, None, "tp.replica1.stage1.cp1", [14, 15]),
             ("cp", dict(dp=1, tp=1, pp=1), ("fwd",), None, "cp.replica1.tp1.stage1", [13, 15]),
             ("dp", dict(tp=1, pp=1, cp=1), ("bwd",), None, "dp.stage1.group1", [11, 15]),
             ("pp", dict(dp=1, cp=1), ("fwd",), None, "pp.replica1.boundary0.cp1", [6, 7, 14, 15]),
             ("ep", dict(tp=1, pp=1, dp=1), ("fwd",), "ep_combine", "ep_combine.tp1.group1.stage1", [13, 15]),
             ("edp", dict(tp=1, cp=1), ("bwd",), None, "edp.tp1.experts1", [3, 7])]
    for axis, at, lossy, traffic, stream, ranks in cases:
        spec = mesh.network_spec(axis, mesh.rank(**at), base, lossy, traffic)
        assert spec.seed == stream_seed(7, stream, "network"), axis
        assert spec.ranks == len(ranks) and spec.ranks_per_node == mesh._per_node(ranks), axis
        assert spec.nics_per_node == (spec.ranks_per_node if axis in ("dp", "ep", "edp") else 2), axis   # one a rank
        assert spec.lossy == (lossy or ("fwd", "bwd")) and spec.selection.everything == (axis != "tp"), axis
    assert mesh.network_spec("tp", 1, base).seed == 7        # the first TP group keeps the run's streams


@pytest.mark.parametrize("axis,lossy,traffic,needle", [
    ("xp", None, None, "axis='xp': a group's network is one of tp, cp, dp, dp_cp, pp, ep, edp"),
    ("tp", ("fwd",), None, "tp's network takes no lossy directions and no traffic class"),
    ("dp", None, None, "dp's network takes lossy directions and no traffic class"),
    ("ep", ("fwd",), None, "ep's network takes lossy directions and a traffic class"),
])
def test_a_network_asked_of_the_wrong_group_is_refused(axis, lossy, traffic, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        Mesh(2, 2, ep=2).network_spec(axis, 0, dict(seed=1), lossy, traffic)


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
        replica, stage, t = position(mesh, r)
        assert groups["tp"][r] == tuple(mesh.group("tp", mesh.rank(dp=replica, pp=stage)))
        assert groups["dp"][r] == tuple(mesh.group("dp", mesh.rank(tp=t, pp=stage)))
        assert groups["pp"][r] == tuple(mesh.group("pp", mesh.rank(dp=replica, tp=t)))


@pytest.mark.parametrize("train, estimate, needle", [
    (["--tp-size", "1", "--pp-size", "2", "--set", "ranks_per_node=3"],
     ["--tp-size", "1", "--pp-size", "2", "--ranks-per-node", "3"], "ranks_per_node=3 is more GPUs than the layout's"),
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


@pytest.mark.parametrize("sizes,order", [(dict(tp=2, cp=2, dp=2, pp=2), "tp-cp-ep-dp-pp"),
                                         (dict(tp=2, cp=2, dp=3, pp=2), "tp-pp-cp-ep-dp"), (dict(tp=4, dp=2), None)])
def test_a_moved_rank_keeps_every_coordinate_but_those_given(sizes, order):
    mesh = Mesh(**sizes, **({"order": order} if order else {}))
    for rank in range(mesh.world):
        at = mesh.coordinates(rank)
        for changes in ({"tp": 0}, {"tp": 0, "pp": 0}, {"pp": mesh.pp - 1, "dp": 0}):
            moved = mesh.coordinates(mesh.moved(rank, **changes))
            assert all(moved[a] == changes.get(a, at[a]) for a in mesh.axes)
        # a TP group's first rank at stage 0, as the run places its TP network
        assert mesh.moved(rank, tp=0, pp=0) == mesh.rank(dp=at["dp"], cp=at["cp"])


@pytest.mark.parametrize("sizes,order", [(dict(tp=2, cp=2, dp=2, pp=2), "tp-cp-ep-dp-pp"),
                                         (dict(tp=2, cp=3, dp=2, pp=2, ep=2), "tp-pp-cp-ep-dp"),
                                         (dict(tp=1, cp=4, dp=2, pp=1, ep=4), "tp-dp-cp-ep-pp"), (dict(tp=4, dp=2), None)])
def test_an_alike_rank_is_the_one_at_those_axes_zero_and_every_other_coordinate_kept(sizes, order):
    mesh = Mesh(**sizes, **({"order": order} if order else {}))
    dense = ("tp", "cp", "dp", "pp")
    for rank in range(mesh.world):
        at = mesh.coordinates(rank)
        for axes in (("cp",), ("tp",), ("tp", "pp"), ("dp",), ("dp", "cp"), ("tp", "cp", "dp", "pp"), ()):
            kept = {a: (0 if a in axes else at[a]) for a in dense}
            assert mesh.alike(rank, *axes) == mesh.rank(**kept)
        # the first of the rank's context group: cp 0, its other coordinates its own
        first = mesh.coordinates(mesh.alike(rank, "cp"))
        assert first["cp"] == 0 and all(first[a] == at[a] for a in ("tp", "dp", "pp"))
        assert mesh.alike(rank, "cp") == mesh.group("cp", rank)[0]
        assert mesh.alike(rank, "tp", "pp") == mesh.group("pp", mesh.group("tp", rank)[0])[0]
    assert mesh.alike(mesh.world - 1, *dense) == 0
    with pytest.raises(ValueError, match=r"^axis='ep': a rank is alike another but in one of "):
        mesh.alike(0, "ep")
