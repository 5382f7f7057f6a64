"""The fabric: presets against the SuperPOD reference, routes (ECMP, queue pairs, spraying, PXN), cables' loss."""
import numpy as np
import pytest
from scipy import stats

from lossysim.fabric import CORROPT_BANDS, Routes, cable_losses, leaf_spine, parse_fabric, superpod

# The SuperPOD reference's component counts: SU -> (leaf, spine, core); node-leaf, leaf-spine and
# spine-core cables each equal the GPU count (256 per SU)
REFERENCE = {2: (16, 8, 0), 4: (32, 16, 0), 8: (64, 32, 0), 16: (128, 128, 64), 64: (512, 512, 256)}


@pytest.fixture(scope="module")
def pod8():
    return superpod(8)


@pytest.mark.parametrize("su", sorted(REFERENCE))
def test_superpod_counts_equal_the_reference(su):
    counts = superpod(su).count()
    leaf, spine, core = REFERENCE[su]
    gpus = 256 * su
    assert (counts["leaf"], counts["spine"], counts.get("core", 0)) == (leaf, spine, core)
    assert counts["nic-leaf"] == counts["leaf-spine"] == gpus
    assert counts.get("spine-core", 0) == (gpus if core else 0)


def _names(fabric, route):
    return [fabric.cables[c].name for c in route.cables]


def test_routes_follow_the_rails(pod8):
    same_su = Routes(pod8, 8).connection(0, 8 + 3)        # node 0 GPU 0 -> node 1 GPU 3, PXN on
    assert _names(pod8, same_su[0]) == ["node0.nic3-leaf3", "leaf3-node1.nic3"]   # turns at rail 3's leaf
    no_pxn = Routes(pod8, 8, pxn=False).connection(0, 8 + 3)[0]
    names = _names(pod8, no_pxn)
    assert names[0] == "node0.nic0-leaf0" and names[-1] == "leaf3-node1.nic3" and len(names) == 4
    across = _names(pod8, Routes(pod8, 8).connection(0, 8 * 40)[0])   # SU 0 -> SU 1, rail 0
    assert across[0] == "node0.nic0-leaf0" and across[-1] == "leaf8-node40.nic0" and len(across) == 4
    assert Routes(pod8, 8).connection(0, 7) == ()          # one node: NVLink, no cable


def test_three_tiers_turn_at_a_core_between_planes():
    pod = superpod(16)
    path = _names(pod, Routes(pod, 8, pxn=False).connection(0, 8 * 40 + 3)[0])
    assert [pod.tier(pod.cables[pod.index[n]].dst) for n in path] == ["leaf", "spine", "core", "spine", "leaf", "nic"]


def test_every_hop_of_a_route_joins_the_last(pod8):
    routes = Routes(pod8, 8, seed=3, qps_per_connection=4)
    rng = np.random.default_rng(0)
    for src, dst in rng.integers(0, pod8.nodes * 8, size=(50, 2)):
        for route in routes.connection(int(src), int(dst)):
            cables = [pod8.cables[c] for c in route.cables]
            assert all(a.dst == b.src for a, b in zip(cables, cables[1:]))


def test_a_flow_keeps_its_path_across_calls_and_instances(pod8):
    first = Routes(pod8, 8, seed=5).connection(3, 8 * 100 + 3, channel=1)
    assert Routes(pod8, 8, seed=5).connection(3, 8 * 100 + 3, channel=1) == first
    moved = sum(Routes(pod8, 8, seed=s).connection(3, 8 * 100 + 3, 1) != first for s in range(6, 16))
    assert moved >= 5          # another hash seed moves it (a 1/32 chance each to stay)


def _uplinks_hit(fabric, k, seed):
    """Leaf 0's uplinks (32, one per spine) that k flows from its NICs to other SUs land on."""
    routes = Routes(fabric, 8, seed=seed)
    return {routes.connection(8 * n, 8 * (32 + n), channel=c)[0].cables[1]
            for n, c in ((i % 32, i // 32) for i in range(k))}


@pytest.mark.parametrize("k", [4, 16, 48])
def test_ecmp_share_of_uplinks_hit_follows_the_hash(pod8, k):
    """A given uplink carries at least one of k hashed flows with probability 1 - (31/32)^k."""
    p = 1 - (31 / 32) ** k
    seeds = range(300)
    first = pod8.next_hops("leaf0", "node32.nic0")[0]
    hits = [_uplinks_hit(pod8, k, s) for s in seeds]
    assert stats.binomtest(sum(first in h for h in hits), len(hits), p).pvalue > 1e-3
    shares = np.array([len(h) / 32 for h in hits])   # the mean share of all 32 uplinks: same expectation
    assert abs(shares.mean() - p) < 4 * shares.std(ddof=1) / np.sqrt(len(shares)) + 1e-9


def test_more_queue_pairs_spread_a_connection(pod8):
    """q queue pairs, each hashed: distinct uplinks 32 (1 - (31/32)^q) on average; packets i mod q."""
    spread = {q: np.mean([len({r.cables[1] for r in Routes(pod8, 8, seed=s, qps_per_connection=q).connection(0, 8 * 64)})
                          for s in range(200)]) for q in (1, 4)}
    assert spread[1] == 1
    assert abs(spread[4] - 32 * (1 - (31 / 32) ** 4)) < 0.15
    routes = Routes(pod8, 8, qps_per_connection=4).connection(0, 8 * 64)
    assert [r.packets(1001) for r in routes] == [251, 250, 250, 250]


def test_spraying_puts_equal_packets_on_equal_paths(pod8):
    routes = Routes(pod8, 8, spray=True).connection(0, 8 * 64)
    assert len(routes) == 32 and len({r.cables for r in routes}) == 32
    for count in (32 * 50, 32 * 50 + 7):
        shares = [r.packets(count) for r in routes]
        assert sum(shares) == count and max(shares) - min(shares) <= 1
    covered = sorted(i for r in routes for i in range(r.residue, 320, r.modulus))
    assert covered == list(range(320))     # every packet on exactly one path


def test_leaf_spine_counts_and_oversubscription():
    fabric = leaf_spine(nodes=8, rails=2, leaves=4, spines=2, oversubscription=2)
    counts = fabric.count()
    assert (counts["leaf"], counts["spine"], counts["nic-leaf"]) == (4, 2, 16)
    assert counts["leaf-spine"] == 4 * 2          # 4 nodes a leaf, 2:1 -> 2 uplinks, one to each spine
    assert parse_fabric("leaf-spine:nodes=8,rails=2,leaves=4,spines=2,oversubscription=2").count() == counts
    assert parse_fabric("none") is None


def test_a_fabric_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text("nodes: 2\nswitches: [leaf0, leaf1, spine0]\ncables:\n"
                    "  - [node0.nic0, leaf0]\n  - [node1.nic0, leaf1]\n"
                    "  - [leaf0, spine0, 2]\n  - {a: leaf1, b: spine0, count: 2, gbps: 800}\n")
    fabric = parse_fabric(str(path))
    assert fabric.count() == {"leaf": 2, "spine": 1, "nic-leaf": 2, "leaf-spine": 4}
    assert fabric.cables[fabric.cable("leaf1-spine0.1")].gbps == 800
    assert len(Routes(fabric, 1).connection(0, 1)[0].cables) == 4


@pytest.mark.parametrize("text, message", [
    ("superpod:3", "must be 2, 4, 8, 16, 32, 64 scalable units"),
    ("superpod:x", "takes a number of scalable units"),
    ("leaf-spine:nodes=3,leaves=2", "divide nodes=3"),
    ("leaf-spine:leaves=2", "needs nodes=N"),
    ("leaf-spine:nodes=4,bogus=1", "key one of"),
    ("torus:4", "must be none, superpod:SU"),
])
def test_bad_fabrics_are_one_line(text, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_fabric(text)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("body, message", [
    ("nodes: 2\nswitches: [leaf0]\ncables:\n  - [node0.nic0, leaf0]\n  - [node1.nic0, leaf9]\n", "names 'leaf9'"),
    ("nodes: 2\nswitches: [leaf0]\ncables:\n  - [node0.nic0, leaf0]\n", "node1.nic0 has no cable"),
    ("nodes: 2\nswitches: [leaf0, leaf1]\ncables:\n  - [node0.nic0, leaf0]\n  - [node1.nic0, leaf1]\n",
     "no route joins node0.nic0 to node1.nic0"),
    ("nodes: 2\ncables: [[a]]\n", "cable 0 must be"),
    ("nodes: [\n", "fabric file"),
    ("nodes: 2\nswitch: []\ncables: []\n", "unknown key 'switch'"),
])
def test_bad_fabric_files_are_one_line(tmp_path, body, message):
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(ValueError, match=message) as error:
        parse_fabric(str(path))
    assert "\n" not in str(error.value) and "bad.yaml" in str(error.value)


def test_a_fabric_too_small_for_the_layout(pod8):
    with pytest.raises(ValueError, match="has 256 nodes; the layout needs 512"):
        pod8.check_nodes(512)


def test_one_named_bad_cable(pod8):
    losses = cable_losses(pod8, bad_links=("leaf3-spine1:bernoulli:1e-3",))
    assert list(losses) == [pod8.index["leaf3-spine1"]] and losses[pod8.index["leaf3-spine1"]].loss_rate == 1e-3
    with pytest.raises(ValueError, match="nearest: leaf3-spine1"):
        cable_losses(pod8, bad_links=("leaf3-spine01:bernoulli:1e-3",))
    with pytest.raises(ValueError, match="must be CABLE:LOSS"):
        cable_losses(pod8, bad_links=("leaf3-spine1",))


def test_every_cable_alike_and_none(pod8):
    assert len(cable_losses(pod8, every_cable="bernoulli:1e-4")) == len(pod8.cables)
    assert cable_losses(pod8, every_cable="none") == {}


def test_corropt_draws_its_share_and_bands(pod8):
    share = 0.05
    losses = cable_losses(pod8, corrupt_share=share, seed=1)
    assert len(losses) == round(share * len(pod8.cables))
    assert losses == cable_losses(pod8, corrupt_share=share, seed=1)
    assert losses.keys() != cable_losses(pod8, corrupt_share=share, seed=2).keys()
    rates = np.array([m.loss_rate for m in losses.values()])
    edges = [band[1] for band in CORROPT_BANDS] + [CORROPT_BANDS[-1][2]]
    observed = np.histogram(rates, bins=edges)[0]
    expected = np.array([band[0] for band in CORROPT_BANDS])
    expected = expected / expected.sum() * len(rates)
    assert stats.chisquare(observed, expected).pvalue > 1e-3
