"""Tensor-parallel GPT-2 and Llama in the ``dist`` backend: 2 gloo processes, checked against HF and ``sim``.

One spawn for the whole module (spawn + init + teardown costs seconds): the
worker (``_tp_common.dist_worker``) runs every dist case and saves what each
rank saw; the tests below compute the references here and compare.

Identity with ``sim`` under loss: outputs, losses, every gradient and the
packet statistics are bitwise equal (both backends apply the same masks to the
same numbers in the same order). Replicated gradients too: ``sim`` runs the
modules holding them once per rank (``run_per_rank``), so each rank's gradient
is its own rows' sum and the ranks' sums are added afterwards, as gloo's
all-reduce adds them (with two ranks the one addition has one result).
"""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tp_common import (ALGORITHM_CASES, ATTENTION, CLASSES, LLAMA_DIST_CASES, LOSSY_SPECS, POLICY_BLOCK,  # noqa: E402
                        POLICY_CASES, build, dist_worker,
                        grads, hf_step, lossy_network, lossy_run, make_batch, params, rel_err,
                        sharded_names, tp_layout, tp_step)
from dist_workers import join_or_fail  # noqa: E402

from lossysim import gather_full_model, parallelize  # noqa: E402

WORLD = 2
TOL = 1e-5
DEADLINE_S = 300



pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of the two dist ranks saw (one spawn for every test here)."""
    out = tmp_path_factory.mktemp("dist")
    workers = mp.start_processes(dist_worker, args=(WORLD, str(out)), nprocs=WORLD, join=False,
                                 start_method="spawn")
    join_or_fail(workers, DEADLINE_S)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("kind", list(CLASSES))
def test_dist_matches_hf_without_loss(ranks, kind, attn):
    ref = build(kind, attn)
    sim = parallelize(copy.deepcopy(ref), WORLD)
    batch = make_batch(kind)
    out, loss = hf_step(ref, kind, batch)
    tp_step(sim, kind, batch)
    ref_grads = grads(ref)
    for r, seen in enumerate(ranks):
        got = seen[("exact", kind, attn)]
        assert got["logits"].shape == (1, *out.shape)
        assert rel_err(got["logits"][0], out) <= TOL, r
        assert rel_err(got["losses"][0], loss) <= TOL, r
        assert got["grads"].keys() == ref_grads.keys()
        for name, grad in ref_grads.items():
            assert rel_err(got["grads"][name], tp_layout(sim, name, grad, ranks=[r])) <= TOL, (r, name)
        assert got["stats"] == sim.network.stats()


@pytest.mark.parametrize("attn", ATTENTION)
def test_dist_dropout_without_loss_keeps_ranks_identical(ranks, attn):
    first, second = (seen[("dropout", attn)] for seen in ranks)
    assert torch.equal(first["logits"], second["logits"])
    assert torch.equal(first["losses"], second["losses"])
    ref = build("cls", attn).eval()  # dropout 0: the same weights without dropout
    with torch.no_grad():
        plain = ref(**{k: v for k, v in make_batch("cls").items() if k != "labels"}).logits
    assert rel_err(first["logits"][0], plain) > 1e-3  # dropout was on


def assert_rank_is_sims(mine: dict, theirs: dict, r: int, sharded) -> None:
    """One step of a dist rank (its own row) bit for bit sim's rank r: logits, loss, sharded gradients."""
    assert torch.equal(mine["logits"][0], theirs["logits"][r]) and torch.equal(mine["losses"][0], theirs["losses"][r])
    for name in sharded:
        assert torch.equal(mine["grads"][name][0], theirs["grads"][name][r]), name


@pytest.mark.parametrize("extra", ALGORITHM_CASES, ids=lambda e: "-".join(map(str, e.values())))
def test_dist_equals_sim_for_every_algorithm_and_transport(ranks, extra):
    """Tree, direct, deadline and retransmit (gloo's sum moves the exact data): bitwise sim's rank r."""
    network = lossy_network(LOSSY_SPECS["ge"], WORLD, **extra)
    sim = parallelize(build("cls"), WORLD, network)
    runs = lossy_run(sim, make_batch("cls"))
    sharded = sharded_names(sim)
    assert sum(row["lost"] for row in network.stats()) > 0
    for r, seen in enumerate(ranks):
        got = seen[("algorithm", *sorted(extra.items()))]
        assert got["stats"] == network.stats() and got["clock"] == network.clock()
        for mine, theirs in zip(got["runs"], runs):
            assert_rank_is_sims(mine, theirs, r, sharded)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
@pytest.mark.parametrize("policy", POLICY_CASES)
def test_dist_equals_sim_for_every_recovery_policy(ranks, policy, algorithm):
    """Each rank, holding only its own row, applies the same signs and keeps the same per-send buffers
    as sim: bitwise sim's rank r over two steps (what a policy keeps carries over), same clock."""
    network = lossy_network(LOSSY_SPECS["ge"], WORLD, recovery=policy, algorithm=algorithm,
                            hadamard_block=POLICY_BLOCK)
    sim = parallelize(build("cls"), WORLD, network)
    runs = lossy_run(sim, make_batch("cls"))
    sharded = sharded_names(sim)
    assert sum(row["lost"] for row in network.stats()) > 0
    for r, seen in enumerate(ranks):
        got = seen[("policy", policy, algorithm)]
        assert got["stats"] == network.stats() and got["clock"] == network.clock()
        for mine, theirs in zip(got["runs"], runs):
            assert_rank_is_sims(mine, theirs, r, sharded)


@pytest.mark.parametrize("recovery", ["zero", "rescale"])
@pytest.mark.parametrize("loss", list(LOSSY_SPECS))
def test_dist_equals_sim_under_loss(ranks, loss, recovery):
    network = lossy_network(LOSSY_SPECS[loss], WORLD, recovery=recovery)
    sim = parallelize(build("cls"), WORLD, network)
    runs = lossy_run(sim, make_batch("cls"))
    sharded = sharded_names(sim)
    assert sum(row["lost"] for row in network.stats()) > 0
    for r, seen in enumerate(ranks):
        got = seen[("lossy", loss, recovery)]
        assert got["stats"] == network.stats()  # the same packets, counted the same way
        assert got["disagreement"] == sim.disagreement()
        for step, (mine, theirs) in enumerate(zip(got["runs"], runs)):
            assert torch.equal(mine["logits"][0], theirs["logits"][r]), (r, step)
            assert torch.equal(mine["losses"][0], theirs["losses"][r]), (r, step)
            for name, grad in theirs["grads"].items():
                assert torch.equal(mine["grads"][name], grad[r:r + 1] if name in sharded else grad), (r, step, name)
    # The ranks really differed (so "rank r equals sim's rank r" is not trivially true). Under
    # ring, a lost reduce-scatter packet hits both ranks alike: they part only at all-gather holes.
    first, second = (ranks[r][("lossy", loss, recovery)]["runs"] for r in (0, 1))
    assert any(not torch.equal(a["logits"], b["logits"]) or not torch.equal(a["losses"], b["losses"])
               for a, b in zip(first, second))


def test_dist_replicated_gradients_average_to_sim(ranks):
    """With sync_replicated=False each dist rank keeps its own replicated gradient; their mean
    is what sim gives every replicated parameter, and what synchronised dist gives too."""
    sim = parallelize(build("cls"), WORLD, lossy_network(LOSSY_SPECS["bernoulli"], WORLD))
    expected = lossy_run(sim, make_batch("cls"), steps=1)[0]["grads"]
    own = [seen[("unsynced",)]["grads"] for seen in ranks]
    synced = [seen[("lossy", "bernoulli", "zero")]["runs"][0]["grads"] for seen in ranks]
    sharded = sharded_names(sim)
    replicated = [name for name in expected if name not in sharded]
    assert replicated
    differing = 0
    for name in replicated:
        mean = (own[0][name] + own[1][name]) / 2
        assert torch.equal(mean, expected[name]), name
        assert torch.equal(synced[0][name], expected[name]), name
        assert torch.equal(synced[0][name], synced[1][name]), name  # both ranks step alike
        differing += rel_err(own[1][name], own[0][name]) > 1e-4
    assert differing >= len(replicated) // 2  # loss made the ranks' own gradients differ


def test_dist_gather_full_model(ranks):
    sim = parallelize(build("lm"), WORLD)
    with torch.no_grad():
        for p in sim.sharded_parameters():
            for r in range(WORLD):
                p[r].add_(0.01 * (r + 1))  # as each dist rank shifted its shard
    full = params(gather_full_model(sim))
    shards = params(sim)
    sharded = sharded_names(sim)
    for r, seen in enumerate(ranks):
        got = seen[("gather",)]
        assert got["full"].keys() == full.keys()
        for name, value in full.items():
            assert torch.equal(got["full"][name], value), (r, name)  # every rank gets every shard
        for name, value in shards.items():
            assert torch.equal(got["shards"][name], value[r:r + 1] if name in sharded else value), (r, name)


# -- Llama ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind, attn, kv_heads", LLAMA_DIST_CASES)
def test_dist_llama_matches_hf_without_loss(ranks, kind, attn, kv_heads):
    ref = build(kind, attn, family="llama", kv_heads=kv_heads)
    sim = parallelize(copy.deepcopy(ref), WORLD)
    batch = make_batch(kind)
    out, loss = hf_step(ref, kind, batch)
    ref_grads = grads(ref)
    for r, seen in enumerate(ranks):
        got = seen[("llama-exact", kind, attn, kv_heads)]
        assert rel_err(got["logits"][0], out) <= TOL, r
        assert rel_err(got["losses"][0], loss) <= TOL, r
        assert got["grads"].keys() == ref_grads.keys()
        for name, grad in ref_grads.items():
            assert rel_err(got["grads"][name], tp_layout(sim, name, grad, ranks=[r])) <= TOL, (r, name)


def test_dist_llama_equals_sim_under_loss(ranks):
    """Grouped-query attention with both ranks holding the one kv head: its copies' gradients are
    summed over the reliable channel in dist and in one tensor in sim, in the same order."""
    network = lossy_network(LOSSY_SPECS["ge"], WORLD)
    sim = parallelize(build("cls", family="llama", kv_heads=1), WORLD, network)
    runs = lossy_run(sim, make_batch("cls"))
    sharded = sharded_names(sim)
    assert sum(row["lost"] for row in network.stats()) > 0
    for r, seen in enumerate(ranks):
        got = seen[("llama-lossy",)]
        assert got["stats"] == network.stats()
        for step, (mine, theirs) in enumerate(zip(got["runs"], runs)):
            assert torch.equal(mine["logits"][0], theirs["logits"][r]), (r, step)
            assert torch.equal(mine["losses"][0], theirs["losses"][r]), (r, step)
            for name, grad in theirs["grads"].items():
                assert torch.equal(mine["grads"][name], grad[r:r + 1] if name in sharded else grad), (r, step, name)
    assert not torch.equal(ranks[0][("llama-lossy",)]["runs"][0]["logits"],
                           ranks[1][("llama-lossy",)]["runs"][0]["logits"])


def test_dist_llama_gather_full_model(ranks):
    sim = parallelize(build("lm", family="llama"), WORLD)
    with torch.no_grad():
        for p in sim.sharded_parameters():
            for r in range(WORLD):
                p[r].add_(0.01 * (r + 1))
    full = params(gather_full_model(sim))
    for r, seen in enumerate(ranks):
        got = seen[("llama-gather",)]
        assert got.keys() == full.keys()
        for name, value in full.items():
            assert torch.equal(got[name], value), (r, name)
