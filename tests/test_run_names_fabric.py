"""A sweep's run names on a fabric: ``loss`` is every cable's model there, so a run with one bad cable (or a
CorrOpt share) would be named ``none`` like the loss-free run beside it; its name says the fabric and where
the packets are lost. Runs without a fabric keep their names to the byte."""
import yaml

from lossysim.config import from_dict
from lossysim.run import sweep
from lossysim.run.names import config_key, run_name

FABRIC = "leaf-spine:nodes=4,leaves=2,spines=1,oversubscription=2"
BASE = {"name": "t", "model": "tiny", "dataset": "synthetic", "steps": 4, "eval_every": 2, "tp_size": 1,
        "dp_size": 4, "ranks_per_node": 1, "lossy_links": "inter_node"}


def _names(tmp_path, grids) -> list[str]:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**BASE, "grid": grids}, sort_keys=False))
    runs = sweep.expand(sweep.load_spec(path), tmp_path / "out")
    for run in runs:
        assert run.dir_name == f"{run.dir_name.rsplit('-', 1)[0]}-{run.key}"
    return [r.dir_name.rsplit("-", 1)[0] for r in runs]


def test_fabric_runs_say_where_their_packets_are_lost(tmp_path):
    names = _names(tmp_path, [
        {"fabric": [FABRIC], "loss": ["none", "bernoulli:0.05"]},
        {"fabric": [FABRIC], "bad_link": ["leaf0-spine0:bernoulli:0.2", "spine0-leaf1:ge:rate=0.1,burst=4"]},
        {"fabric": [FABRIC], "corrupt_share": [0.25]},
        {"fabric": [FABRIC], "bad_link": ["leaf0-spine0:bernoulli:0.2"], "routing": ["spray"],
         "qps_per_connection": [4], "pxn": [False]},
    ])
    fabric = "leaf-spine-n4-l2-s1-o2"
    assert names == [f"none_{fabric}_tp1_seed0", f"bernoulli-0.05_{fabric}_tp1_seed0",
                     f"none_{fabric}_bad-leaf0-spine0-bernoulli-0.2_tp1_seed0",
                     f"none_{fabric}_bad-spine0-leaf1-ge-0.1-b4_tp1_seed0",
                     f"none_{fabric}_corrupt0.25_tp1_seed0",
                     f"none_{fabric}_bad-leaf0-spine0-bernoulli-0.2_spray_qps4_nopxn_tp1_seed0"]
    # every run is told apart by its name alone, before the hash
    assert len(set(names)) == len(names)


def test_runs_without_a_fabric_keep_their_names(tmp_path):
    names = _names(tmp_path, [{"loss": ["none", "bernoulli:0.05", "ge:rate=0.01,burst=8"], "seed": [0, 1]},
                              {"loss": ["bernoulli:0.05"], "recovery": ["rescale"], "transport": ["retransmit"]}])
    assert names == ["none_tp1_seed0", "none_tp1_seed1", "bernoulli-0.05_tp1_seed0", "bernoulli-0.05_tp1_seed1",
                     "ge-0.01-b8_tp1_seed0", "ge-0.01-b8_tp1_seed1", "bernoulli-0.05_tp1_seed0_rescale_retransmit"]


def test_a_superpod_a_yaml_fabric_and_many_bad_cables_stay_short(tmp_path):
    fabric = tmp_path / "my-fabric.yaml"
    fabric.write_text(yaml.safe_dump({"nodes": 2, "rails": 1, "gbps": 400, "switches": ["leaf0", "leaf1", "spine0"],
                                      "cables": [["node0.nic0", "leaf0"], ["node1.nic0", "leaf1"],
                                                 ["leaf0", "spine0"], ["leaf1", "spine0"]]}))
    config = from_dict({**BASE, "dp_size": 2, "fabric": str(fabric), "bad_link": "leaf0-spine0:bernoulli:0.1"})
    assert run_name(config, "k") == "none_my-fabric_bad-leaf0-spine0-bernoulli-0.1_tp1_seed0-k"
    bad = ";".join(f"node{n}.nic{r}-leaf{r}:bernoulli:0.01" for n in range(3) for r in range(2))
    config = from_dict({**BASE, "dp_size": 16, "ranks_per_node": 8, "fabric": "superpod:2", "bad_link": bad})
    assert run_name(config, config_key(config)).startswith(
        "none_superpod2_bad-node0.nic0-leaf0-bernoulli-0.01_bad-node0.nic1-leaf1-bernoulli-0.01_bad-4-more_tp1_seed0-")
