"""``lossysim estimate --trace`` on a fabric: a traced job's groups sit on its own global ranks, so the groups
whose routes cross a lossy cable (the blast radius) are those the real layout puts there."""
import json

import pytest

from lossysim.cli import main
from lossysim.estimate import trace as traces
from lossysim.estimate import trace_replay as replays
from lossysim.estimate.workload import job_config
from lossysim.fabric.place import placement
from nccl_trace import NcclCall, write_trace

# four nodes, one rank each: nodes 0-1 under leaf0, 2-3 under leaf1, one cable each way to the spine
FABRIC = "leaf-spine:nodes=4,leaves=2,spines=1,oversubscription=2"
# cp 2 x dp 2 (order tp-cp-ep-dp-pp: rank = cp + 2 dp): CP groups (0, 1), (2, 3), DP groups (0, 2), (1, 3)
GROUPS = {"0": (0, 1, 2, 3), "c0": (0, 1), "c1": (2, 3), "d0": (0, 2), "d1": (1, 3)}


def _cp_dp_job(tmp_path):
    """Per step each CP group all-gathers its keys and values and each DP group all-reduces its gradients."""
    folder = tmp_path / "cpdp"
    folder.mkdir()
    for rank in range(4):
        cp, dp = f"c{rank // 2}", f"d{rank % 2}"
        calls = [NcclCall("_allgather_base", 65536, 131072, cp, 100, 50),
                 NcclCall("allreduce", 262144, 262144, dp, 400, 200, dtype="Float")]
        write_trace(folder / f"rank{rank}.json.gz", rank, GROUPS, [(0, 1000, calls)], [(0, 90)])
    return folder


def _config(bad_link):
    return job_config(tp_size=1, cp_size=2, dp_size=2, ranks_per_node=1, fabric=FABRIC, bad_link=bad_link,
                      link_inter="roce-100g")


def _crossing(cable: str) -> dict:
    """The real layout's groups whose links cross ``cable``, each class's first ranks, worked out from the
    fabric's routes of each group's global ranks (not through the replay)."""
    out = {}
    for cls, groups in (("cp", ((0, 1), (2, 3))), ("dp", ((0, 2), (1, 3)))):
        for ranks in groups:
            place = placement(FABRIC, ranks, 1, channels=2, seed=0, bad_link=(f"{cable}:bernoulli:0.2",))
            if any(place.crosses(s, d) for s in range(len(ranks)) for d in range(len(ranks)) if s != d):
                out.setdefault(cls, []).append(ranks[0])
    return out


def _blast(tmp_path, cable: str) -> dict:
    row = replays.simulate_trace(traces.read(_cp_dp_job(tmp_path)), _config(f"{cable}:bernoulli:0.2"), steps=2)
    (entry,) = row["blast"]
    assert entry["cable"] == cable and row["lossy_cables"] == 1 and row["fabric"] == FABRIC
    return row, entry


def test_a_nic_cable_is_crossed_by_the_groups_of_the_rank_on_that_node(tmp_path):
    # node 3's NIC up to its leaf: rank 3's CP group (2, 3) and DP group (1, 3), no other; placed as ranks
    # 0..n-1, the CP group (2, 3) would sit on nodes 0-1 and the DP group (1, 3) on (0, 2)'s nodes
    cable = "node3.nic0-leaf1"
    assert _crossing(cable) == {"cp": [2], "dp": [1]}
    row, entry = _blast(tmp_path, cable)
    assert entry["groups"] == {"cp": 1, "dp": 1} and entry["ranks_first"] == [1, 2, 3]
    assert row["cp_packets_lost"] > 0 and row["dp_packets_lost"] > 0
    # rank 3 sends one of its CP group's two links and one of its DP group's: a quarter of each class's
    # packets (every rank sends alike)
    assert entry["share"]["cp"] == pytest.approx(0.25) and entry["share"]["dp"] == pytest.approx(0.25)


def test_each_context_ranks_dp_group_is_on_its_own_nodes(tmp_path):
    # leaf1 up to the spine: both DP groups (2 -> 0 and 3 -> 1 go up it), neither CP group (each one leaf);
    # sharing one network placed on cp 0's ranks, the two DP groups would count as one
    cable = "leaf1-spine0"
    assert _crossing(cable) == {"dp": [0, 1]}
    row, entry = _blast(tmp_path, cable)
    assert entry["groups"] == {"dp": 2} and entry["ranks_first"] == [0, 1, 2, 3]
    assert row["cp_packets_lost"] == 0 and row["dp_packets_lost"] > 0
    assert entry["share"] == {"dp": pytest.approx(0.5)}


def test_the_traced_estimate_prints_and_writes_the_blast_radius(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["estimate", "--trace", str(_cp_dp_job(tmp_path)), "--tp-size", "1", "--cp-size", "2",
                 "--dp-size", "2", "--ranks-per-node", "1", "--fabric", FABRIC,
                 "--bad-link", "node3.nic0-leaf1:bernoulli:0.2", "--link-inter", "roce-100g", "--steps", "1",
                 "--no-progress", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "blast radius" in printed and "node3.nic0-leaf1 (bernoulli:0.2): 3 ranks" in printed
    (row,) = json.loads((out / "estimate.json").read_text())
    assert row["blast"][0]["groups"] == {"cp": 1, "dp": 1}


def test_without_a_fabric_the_traced_row_has_no_fabric_columns(tmp_path):
    config = job_config(tp_size=1, cp_size=2, dp_size=2, ranks_per_node=1, loss="bernoulli:0.05",
                        link_inter="roce-100g")
    row = replays.simulate_trace(traces.read(_cp_dp_job(tmp_path)), config, steps=2)
    assert "blast" not in row and "fabric" not in row and row["dp_packets_lost"] > 0


def test_one_mirrored_file_on_a_fabric_is_refused_in_one_line(tmp_path, capsys):
    # one rank's file stands for its alike groups; on a fabric the groups that cross the cable may be others
    path = tmp_path / "rank0.json"
    write_trace(path, 0, {"0": (0, 1)}, [(0, 1000, [NcclCall("allreduce", 4096, 4096, "0", 100, 50)])], [(0, 90)])
    code = main(["estimate", "--trace", str(path), "--ranks-per-node", "1", "--fabric", FABRIC,
                 "--bad-link", "leaf0-spine0:bernoulli:0.2", "--no-progress", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "needs every rank's trace" in err, err
    assert not (tmp_path / "out").exists()
