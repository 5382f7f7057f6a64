"""Collisions: a step's flows share the cables they cross; ECMP's maximum load against the closed form,
more queue pairs, spraying, and a DP ring across scalable units on a SuperPOD."""
import numpy as np
import pytest
from scipy import stats

from lossysim.fabric import Routes, leaf_spine, superpod
from lossysim.fabric.load import (Flow, bottleneck, cable_loads, expected_max_flows, max_flows_pmf, ring_flows,
                                  ring_slowdown, slowdown, step_seconds)

B = 4096 * 1000          # bytes per flow: a whole number of packets, so shares are exact


@pytest.fixture(scope="module")
def pod8():
    return superpod(8)


def test_max_load_small_cases_by_hand():
    # 2 flows over 2 cables: together with probability 1/2
    assert np.allclose(max_flows_pmf(2, 2), [0, 0.5, 0.5])
    # 3 over 2: all on one 2/8, else 2 and 1
    assert np.isclose(expected_max_flows(3, 2), 3 * 2 / 8 + 2 * 6 / 8)
    # 3 over 3: one each 3!/27, all on one 3/27, else a pair 18/27
    assert np.allclose(max_flows_pmf(3, 3), [0, 6 / 27, 18 / 27, 3 / 27])
    assert np.allclose(max_flows_pmf(0, 5), [1.0]) and np.isclose(max_flows_pmf(40, 32).sum(), 1)
    # the largest of two independent hashes of 2 flows over 2: 2 unless both split (1/4)
    assert np.isclose(expected_max_flows(2, 2, switches=2), 1 * 0.25 + 2 * 0.75)


def _pooled_chisquare(observed_m, pmf):
    """Chi-square of observed maxima against pmf, cells with expectation < 5 pooled into their neighbours."""
    counts = np.bincount(observed_m, minlength=len(pmf))[:len(pmf)]
    expected = pmf * len(observed_m)
    obs, exp, o, e = [], [], 0.0, 0.0
    for c, x in zip(counts, expected):
        o, e = o + c, e + x
        if e >= 5:
            obs.append(o), exp.append(e)
            o, e = 0.0, 0.0
    obs[-1] += o
    exp[-1] += e
    return stats.chisquare(obs, exp).pvalue


def test_the_closed_form_matches_uniform_hashing():
    rng = np.random.default_rng(1)
    drawn = np.array([np.bincount(rng.integers(0, 32, 16), minlength=32).max() for _ in range(20000)])
    assert _pooled_chisquare(drawn, max_flows_pmf(16, 32)) > 1e-3


def _leaf0_up(pod, routes, k, bytes_=B):
    """k flows from leaf0's NICs (nodes 0..k-1, rail 0) to SU 1: the most bytes on one of leaf0's 32 uplinks."""
    loads = cable_loads(routes, [Flow(8 * n, 8 * (32 + n), bytes_) for n in range(k)])
    ups = [i for i in np.flatnonzero(loads) if pod.cables[i].src == "leaf0"]
    assert all(pod.tier(pod.cables[i].dst) == "spine" for i in ups)
    return loads[ups].max(), loads[ups].sum()


def test_k_flows_over_u_uplinks_follow_the_closed_form(pod8):
    maxima = []
    for seed in range(300):
        most, total = _leaf0_up(pod8, Routes(pod8, 8, seed=seed), 16)
        assert total == 16 * B                      # every flow leaves by exactly one uplink
        maxima.append(int(round(most / B)))
    assert _pooled_chisquare(np.array(maxima), max_flows_pmf(16, 32)) > 1e-3


def test_more_queue_pairs_flatten_the_load(pod8):
    """q queue pairs a connection: 16 q flows of B / q each; the maximum load follows the same law."""
    seeds = range(120)
    one = np.array([_leaf0_up(pod8, Routes(pod8, 8, seed=s), 16)[0] / B for s in seeds])
    four = np.array([_leaf0_up(pod8, Routes(pod8, 8, seed=s, qps_per_connection=4), 16)[0] / B for s in seeds])
    assert four.mean() < one.mean() - 0.5
    assert stats.ttest_1samp(four, expected_max_flows(64, 32) / 4).pvalue > 1e-3
    assert stats.ttest_1samp(one, expected_max_flows(16, 32)).pvalue > 1e-3


def test_spraying_reaches_each_cables_full_share(pod8):
    """32 flows from leaf0's 32 NICs sprayed over its 32 uplinks: each carries exactly one flow's bytes,
    so the step runs at the NICs' speed; ECMP's most loaded uplink holds several flows (and its spine's one
    cable down to leaf8 the same ones)."""
    routes = Routes(pod8, 8, spray=True)
    flows = [Flow(8 * n, 8 * (32 + n), 32 * B) for n in range(32)]
    loads = cable_loads(routes, flows)
    ups = [i for i in range(len(pod8.cables)) if pod8.cables[i].src == "leaf0" and pod8.tier(pod8.cables[i].dst) == "spine"]
    assert len(ups) == 32 and np.allclose(loads[ups], 32 * B)
    assert slowdown(routes, flows) == pytest.approx(1.0)
    ecmp = [slowdown(Routes(pod8, 8, seed=s), flows) for s in range(40)]
    assert min(ecmp) >= 2 and stats.ttest_1samp(ecmp, expected_max_flows(32, 32)).pvalue > 1e-3


def _rail0_rings():
    """Llama 3's order (tp, pp, dp) with tp 8 in a node, pp 16, dp 16 on 256 nodes: the DP rings of
    rail 0, node s + 16 d for replica d of stage s; each SU's nodes 16..31 send to the next SU."""
    return [[8 * (s + 16 * d) for d in range(16)] for s in range(16)]


def test_a_dp_ring_across_sus_is_slower_with_ecmp_by_what_the_hash_predicts(pod8):
    """Each of rail 0's 8 leaves sends 16 flows up over 32 spines (one cable each, and the spine's one cable
    down carries the same flows): the step is held by the most flows on one uplink of any leaf."""
    groups = _rail0_rings()
    leaves = [f"leaf{8 * su}" for su in range(8)]
    ecmp, per_leaf = [], []
    for seed in range(60):
        routes = Routes(pod8, 8, seed=seed)
        loads = cable_loads(routes, ring_flows(groups, 64 * B))
        most = [max(loads[i] for i in range(len(pod8.cables)) if pod8.cables[i].src == leaf) / (64 * B)
                for leaf in leaves]
        per_leaf += [int(round(m)) for m in most]
        ecmp.append(ring_slowdown(routes, groups, bytes_per_rank=64 * B))
        assert ecmp[-1] == pytest.approx(max(most))     # held by the most flows on one uplink of any leaf
    assert _pooled_chisquare(np.array(per_leaf), max_flows_pmf(16, 32)) > 1e-3
    ecmp = np.array(ecmp)
    sprayed = ring_slowdown(Routes(pod8, 8, spray=True), groups)
    assert sprayed == pytest.approx(1.0, abs=1e-6)      # 16 flows over 32 uplinks: half a NIC's bytes each
    predicted = expected_max_flows(16, 32, switches=8)
    assert stats.ttest_1samp(ecmp / sprayed, predicted).pvalue > 1e-3
    assert ecmp.min() >= 2


def test_step_seconds_bottleneck_and_a_node_inside(pod8):
    routes = Routes(pod8, 8)
    loads = cable_loads(routes, [Flow(0, 8, 50e9)])          # 50 GB over 400 Gb/s cables: 1 s
    assert step_seconds(pod8, loads) == pytest.approx(1.0)
    assert bottleneck(pod8, loads)[0] == "node0.nic0-leaf0"
    assert not cable_loads(routes, [Flow(0, 7, 1e9)]).any()     # one node: NVLink
    assert slowdown(routes, [Flow(0, 7, 1e9)]) == 1.0
    half = np.ones(len(pod8.cables))
    half[pod8.cable("leaf0-node1.nic0")] = 0.5
    assert step_seconds(pod8, loads, half) == pytest.approx(2.0)


def test_ring_flows_and_bad_input():
    flows = ring_flows([[0, 8, 16], [1]], 300.0, channels=3)
    assert len(flows) == 9 and {(f.src, f.dst) for f in flows} == {(0, 8), (8, 16), (16, 0)}
    assert all(f.bytes == 100.0 for f in flows)
    fabric = leaf_spine(nodes=4, leaves=2, spines=2)
    for call, message in ((lambda: ring_flows([[0, 1]], 1.0, channels=0), "channels"),
                          (lambda: cable_loads(Routes(fabric, 1), [Flow(0, 2, -1.0)]), "bytes"),
                          (lambda: cable_loads(Routes(fabric, 1), [], packet_bytes=0), "packet_bytes"),
                          (lambda: max_flows_pmf(3, 0), "u=")):
        with pytest.raises(ValueError, match=message) as error:
            call()
        assert "\n" not in str(error.value)
