"""Shared cables in the estimate's loss-free time: each class's concurrent flows stretch its loss-free seconds by
their busiest cable (the factor the hash predicts on a SuperPOD, flatter with more queue pairs, 1 sprayed), the
repairs kept; no fabric, nothing changes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from lossysim.estimate import collisions
from lossysim.estimate.shapes import load
from lossysim.estimate.simulate import estimate
from lossysim.estimate.workload import Workload, job_config
from lossysim.fabric import Routes, parse_fabric
from lossysim.fabric.load import expected_max_flows, ring_slowdown

# 8 nodes of one rank, nodes 0-3 on leaf0 and 4-7 on leaf1, 4 uplinks a leaf over 2 spines (not oversubscribed)
SMALL = "leaf-spine:nodes=8,leaves=2,spines=2"
DP_GROUPS = [[0, 2, 4, 6], [1, 3, 5, 7]]   # tp 2 x dp 4, one rank a node: TP position t's replicas


def _small(**changes):
    return job_config("tiny-llama", 1, "bf16", None, tp_size=2, dp_size=4, ranks_per_node=1, dp_overlap=False,
                      **changes)


def _llama3_order(seed: int, **changes):
    """Llama 3's order tp 8, pp 16, dp 16 on superpod:8, one channel a link."""
    return job_config("llama-3.1-70b", 1, "bf16", 512, tp_size=8, pp_size=16, dp_size=16, ranks_per_node=8,
                      parallel_order="tp-cp-pp-ep-dp", fabric="superpod:8", channels=1, seed=seed, **changes)


def test_a_dp_ring_across_sus_takes_the_factor_the_hash_predicts():
    """Each of the 64 leaves (8 SUs x 8 rails) sends 16 flows up over 32 spines, each spine's cable down to
    the next SU's leaf carries the same ones: the rings are held by the most flows on an uplink of any leaf,
    E = expected_max_flows(16, 32, 64); 4 queue pairs a connection: 64 flows of a quarter each; sprayed, 1.
    The pipeline's sends turn at their leaf (stages on neighbouring nodes): 1 whatever the routing."""
    one = np.array([collisions.factors(_llama3_order(s))["dp"] for s in range(10)])
    four = np.array([collisions.factors(_llama3_order(s, qps_per_connection=4))["dp"] for s in range(6)])
    assert stats.ttest_1samp(one, expected_max_flows(16, 32, 64)).pvalue > 1e-3 and one.min() >= 3
    assert stats.ttest_1samp(four, expected_max_flows(64, 32, 64) / 4).pvalue > 1e-3
    assert four.mean() < one.mean() - 1
    sprayed = collisions.factors(_llama3_order(0, routing="spray", nic="irn"))
    assert sprayed["dp"] == pytest.approx(1.0, abs=1e-9) and sprayed["pp"] == 1.0
    assert collisions.factors(_llama3_order(0))["pp"] == 1.0
    assert collisions.factors(_llama3_order(0).replace(fabric="none")) == {}


def _first_colliding_seed() -> tuple[int, float]:
    """The first hash seed whose DP rings collide on the small fabric (their factor worked out apart from the
    estimate, on routes of its own), and that factor; two channels a link, as the config's."""
    fabric = parse_fabric(SMALL)
    for seed in range(40):
        factor = ring_slowdown(Routes(fabric, 1, seed=seed), DP_GROUPS, channels=2)
        if factor > 1.01:
            return seed, factor
    raise AssertionError("no seed of 40 hashes two of a leaf's DP flows onto one uplink")


def test_the_estimate_stretches_the_dp_buckets_loss_free_time_by_the_factor():
    """tp 2 x dp 4, one rank a node, buckets after the backward (no overlap): on the fabric each bucket's
    loss-free seconds are the factor times their fabric-free ones, so what DP adds to the loss-free step is;
    TP (each group under one leaf) is as without a fabric; sprayed over equal uplinks, every figure as without
    a fabric."""
    seed, factor = _first_colliding_seed()
    shape, w = load("tiny-llama"), Workload(256)
    base = estimate(shape, _small(seed=seed), w, steps=1)
    hashed = estimate(shape, _small(seed=seed, fabric=SMALL), w, steps=1)
    sprayed = estimate(shape, _small(seed=seed, fabric=SMALL, routing="spray", nic="irn"), w, steps=1)
    assert not any("fabric_slowdown" in key for key in base)
    assert hashed["dp_fabric_slowdown"] == pytest.approx(factor) and hashed["tp_fabric_slowdown"] == 1.0
    assert hashed["dp_loss_free_s"] == pytest.approx(factor * base["dp_loss_free_s"], rel=1e-9)
    assert hashed["tp_loss_free_s"] == pytest.approx(base["tp_loss_free_s"], rel=1e-12)
    assert hashed["loss_free_step_s"] == pytest.approx(base["loss_free_step_s"] + (factor - 1) * base["dp_loss_free_s"])
    assert hashed["step_mean_s"] == pytest.approx(hashed["loss_free_step_s"])       # loss-free: no repairs
    assert hashed["fabric_slowdown"] == f"tp 1x, dp {factor:.3g}x"
    assert sprayed["dp_fabric_slowdown"] == 1.0
    assert all(sprayed[k] == base[k] for k in ("loss_free_step_s", "step_mean_s", "dp_loss_free_s", "compute_s"))


def test_stretching_keeps_the_repairs_and_touches_only_the_fabric():
    times = {"tp": [[([1.0, 0.5], [2.0, 1.0])]], "bucket": [[[3.0, 2.0], [2.0, 2.0]]], "pp": [[None]],
             "cp": np.ones((1, 2, 2, 1)), "gather": []}
    out = collisions.stretched(times, {"dp": 1.5, "tp": 1.0, "cp": 3.0})
    assert out["bucket"] == [[[4.0, 3.0], [3.0, 3.0]]]          # loss-free x 1.5, repair (1 s, 0 s) kept
    assert out["tp"] is times["tp"] and out["cp"] is times["cp"]  # factor 1; cp before its overlap, elsewhere
    assert out["pp"] == [[None]] and times["bucket"] == [[[3.0, 2.0], [2.0, 2.0]]]
    assert collisions.stretched(times, {}) is times
    assert collisions.stretch_rounds([[1.0, 0.5]], 2.0) == [[1.5, 1.0]]
    assert collisions.stretch_rounds([[1.0, 0.5]], None) == [[1.0, 0.5]]


def test_summary_json_names_each_class_factor():
    from lossysim.net import LossyNetwork
    from lossysim.run.fabric_record import fabric_summary
    seed, factor = _first_colliding_seed()
    config = _small(seed=seed, fabric=SMALL)
    parts = SimpleNamespace(pipeline=None, dp=SimpleNamespace(grouped=False), ep=None, context=None,
                            train_net=LossyNetwork(config.network_spec()))
    assert fabric_summary(parts, config)["slowdown"] == {"tp": 1.0, "dp": pytest.approx(factor)}


def test_the_printed_estimate_names_the_factor():
    seed, factor = _first_colliding_seed()
    result = subprocess.run([sys.executable, "-m", "lossysim", "estimate", "tiny-llama", "--seq", "256", "--tp-size",
                             "2", "--dp-size", "4", "--gpus-per-node", "1", "--steps", "1", "--threads", "1",
                             "--seed", str(seed), "--fabric", SMALL, "--no-progress"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert f"fabric slowdown ({SMALL}, ecmp, 1 QP a connection): tp 1x, dp {factor:.3g}x" in result.stdout


def test_a_context_ring_is_stretched_before_attention_hides_it():
    """cp 4 x dp 2 with the context groups strided over the leaves (order tp-dp-cp): a seed whose rings
    collide; what the exchanges add is at least the factor times their fabric-free part (a round's send
    grows by the factor, the attention that hides it does not)."""
    fabric = parse_fabric(SMALL)
    groups = [[0, 2, 4, 6], [1, 3, 5, 7]]     # rank d + 2 c on node d + 2 c
    seed = next(s for s in range(40) if ring_slowdown(Routes(fabric, 1, seed=s), groups, channels=2) > 1.01)
    factor = ring_slowdown(Routes(fabric, 1, seed=seed), groups, channels=2)
    config = job_config("tiny-llama", 1, "bf16", None, tp_size=1, cp_size=4, dp_size=2, ranks_per_node=1,
                        parallel_order="tp-dp-cp-ep-pp", fabric=SMALL, seed=seed)
    shape, w = load("tiny-llama"), Workload(256)
    base = estimate(shape, config.replace(fabric="none"), w, steps=1)
    row = estimate(shape, config, w, steps=1)
    assert row["cp_fabric_slowdown"] == pytest.approx(factor) and base["cp_loss_free_s"] > 0
    assert row["cp_loss_free_s"] >= factor * base["cp_loss_free_s"] * (1 - 1e-9)
    assert row["dp_fabric_slowdown"] == 1.0 and row["dp_loss_free_s"] == pytest.approx(base["dp_loss_free_s"])


def test_unshared_cables_keep_every_time_as_without_a_fabric():
    """``shared_cables: false`` (the assumption's other side): the same colliding hash, every loss-free time as
    without a fabric and no factor columns; the flag reaches the config from the command line."""
    seed, _ = _first_colliding_seed()
    shape, w = load("tiny-llama"), Workload(256)
    base = estimate(shape, _small(seed=seed), w, steps=1)
    unshared = estimate(shape, _small(seed=seed, fabric=SMALL, shared_cables=False), w, steps=1)
    assert unshared["dp_fabric_slowdown"] == 1.0 and unshared["shared_cables"] is False
    assert all(unshared[k] == base[k] for k in ("loss_free_step_s", "step_mean_s", "dp_loss_free_s", "compute_s"))
    result = subprocess.run([sys.executable, "-m", "lossysim", "estimate", "tiny-llama", "--seq", "256", "--tp-size",
                             "2", "--dp-size", "4", "--gpus-per-node", "1", "--steps", "1", "--threads", "1",
                             "--seed", str(seed), "--fabric", SMALL, "--shared-cables", "false", "--no-progress"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "): not charged (shared_cables false)" in result.stdout


def test_the_blast_radius_reads_the_same_in_every_process():
    """estimate.json's blast radius (its groups' order too) does not depend on the process's hash seed."""
    seed, _ = _first_colliding_seed()
    code = ("import json; from lossysim.estimate.simulate import estimate; from lossysim.estimate.shapes import load; "
            "from lossysim.estimate.workload import Workload, job_config; "
            "c = job_config('tiny-llama', 1, 'bf16', None, tp_size=2, dp_size=4, ranks_per_node=1, dp_overlap=False, "
            f"seed={seed}, fabric={SMALL!r}, bad_link='node0.nic0-leaf0:bernoulli:0.01'); "
            "print(json.dumps(estimate(load('tiny-llama'), c, Workload(256), steps=1)['blast']))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": h}).stdout for h in ("1", "2", "3", "4")}
    assert len(outs) == 1, outs
    blast = json.loads(next(iter(outs)))
    assert blast and len(blast[0]["groups"]) >= 2   # two classes on the cable: an order that could differ
