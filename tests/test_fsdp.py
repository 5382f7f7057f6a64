"""FSDP (ZeRO-3, ``dp_mode: fsdp``) on the tiny GPT-2 and the synthetic task: the reduce-scatter is the
ring all-reduce's first half (rescaled: unbiased), loss-free FSDP equals one replica on the global
batch, gathered weights have holes exactly where packets were lost, FSDP traffic loses at the
configured rate, the replicas never drift, the clock's closed form, ``dist`` (one process a rank)
equals ``sim``, and bad settings are one-line errors."""
from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from lossysim.clock import gathered_forward_seconds
from lossysim.dp import fsdp as fsdp_module
from lossysim.dp.buckets import flatten
from lossysim.net import LossyNetwork
from lossysim.net.network import shard_bounds
from lossysim.net.algorithms import chunk_bounds, schedule
from lossysim.net.receivers import combine
from lossysim.run.build import build
from lossysim.run.experiment import run_experiment
from lossysim.run.sweep import config_key
from lossysim.timing import nccl

# The tiny run and DDP's tolerance are data parallelism's (sums over replicas and over the
# global batch add the same numbers in another order: fp32 rounding).
from test_data_parallel import CPU, _full, assert_dist_is_sim, assert_replicas_equal, sim_and_dist, tiny  # noqa: E402
from test_data_parallel import _lossy_step as _train  # noqa: E402
from tiny_runs import dp_group_spec  # noqa: E402

pytestmark = pytest.mark.usefixtures("private_cache")


# -- the reduce-scatter ----------------------------------------------------------------------------

def test_reduce_scatter_is_the_ring_all_reduce_first_half():
    """Same losses on the reduce-scatter sends: each owner holds its chunk exactly as the all-reduce's
    owner does, and nothing of the others' chunks; loss-free, the owner's chunk is the plain sum."""
    R, n_packets, per_packet = 4, 37, 10
    all_reduce, scatter = schedule("ring", "all_reduce", R, n_packets), schedule("ring", "reduce_scatter", R, n_packets)
    k = len(scatter.sends)
    assert scatter.sends == all_reduce.sends[:k] and {s.phase for s in scatter.sends} == {"reduce_scatter"}
    torch.manual_seed(0)
    lost = torch.rand(k, scatter.max_packets) < 0.3
    full = combine(all_reduce, torch.cat([lost, torch.rand(len(all_reduce.sends) - k, all_reduce.max_packets) < 0.3]))
    mine = combine(scatter, lost)
    assert torch.equal(mine.coef, full.coef)
    for c, (first, count) in enumerate(chunk_bounds(n_packets, R)):
        assert not mine.holes[c, first:first + count].any()
        assert mine.holes[c, :first].all() and mine.holes[c, first + count:].all()
    x = torch.randn(R, n_packets * per_packet - 3)
    for recovery in ("zero", "rescale"):
        network = LossyNetwork(R, "none", recovery=recovery)
        got = network.reduce_scatter("s", "bwd", x, range(R))
        for r, (first, count) in enumerate(shard_bounds(network.spec, x.shape[1], x.dtype)):
            torch.testing.assert_close(got[r, first:first + count], x.sum(0)[first:first + count])
            assert not got[r, :first].any() and not got[r, first + count:].any()
    lossy = LossyNetwork(R, "bernoulli:0.1", seed=1)
    lossy.reduce_scatter("s", "bwd", x, range(R))
    rows = lossy.summary(by=("phase",))
    assert [row["phase"] for row in rows] == ["reduce_scatter"]
    assert rows[0]["sent"] == (R - 1) * lossy.packets(x.shape[1], x.dtype)[1]   # each rank sends R-1 chunks


def test_rescaled_reduce_scatter_is_unbiased():
    """Ring, 20% loss, 4 ranks, rank r contributes 2^r everywhere: what each owner holds of its chunk,
    divided hop by hop by the probability that it arrives, averages to the true sum (one element per
    packet: a packet's elements share its fate); zero's is biased low."""
    R, truth = 4, 15.0
    x = torch.stack([torch.full((200_000,), float(2 ** r)) for r in range(R)])
    for recovery in ("rescale", "zero"):
        network = LossyNetwork(R, "bernoulli:0.2", seed=2, recovery=recovery)
        got = network.reduce_scatter("s", "bwd", x, range(R))
        per_packet = network.packets(1, torch.float32)[0]
        owned = torch.cat([got[r, first:first + count:per_packet]
                           for r, (first, count) in enumerate(shard_bounds(network.spec, x.shape[1], x.dtype))])
        assert owned.numel() > 500 and (owned != truth).float().mean() > 0.2
        if recovery == "rescale":
            assert stats.ttest_1samp(owned.double().numpy(), truth).pvalue > 1e-3
        else:
            assert owned.mean() < 0.9 * truth


# -- training --------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp,dp", [(1, 2), (1, 4), (2, 2)])
def test_loss_free_fsdp_equals_one_replica_on_the_global_batch(tp, dp, tmp_path, one_torch_thread):
    single, _ = _train(tiny(tmp_path, tp_size=tp), 3)
    sharded, _ = _train(tiny(tmp_path, tp_size=tp, dp_size=dp, dp_mode="fsdp"), 3)
    assert sharded.dp.fsdp and len(sharded.dp.buckets) > 1
    assert_replicas_equal(sharded.dp, single.model)


def _twin_masks(config, dp):
    """The holes every receiver's copy of every unit has, drawn again by a twin of DP group 0's network
    (same spec, same sites, same calls): gathering shards of ones leaves 1 where a packet arrived and 0
    where it was lost. Returns, per unit, ``[receivers, n]`` and the twin."""
    twin = LossyNetwork(dp_group_spec(config))
    masks = []
    for b, bucket in enumerate(dp.buckets):
        masks.append(fsdp_module.gather(twin, f"fsdp.gather{b}", torch.ones(bucket.numel)))
    return masks, twin


@pytest.mark.parametrize("algorithm", ["direct", "ring"])
def test_gathered_weights_have_holes_exactly_where_packets_were_lost(algorithm, tmp_path, one_torch_thread):
    config = tiny(tmp_path, dp_size=4, dp_mode="fsdp", loss="bernoulli:0.05", algorithm=algorithm)
    parts = build(config, CPU, 0, True, None)
    dp = parts.dp
    master = [p.detach().clone() for p in dp.replicas[0].model.parameters()]
    dp.gather_weights()
    masks, twin = _twin_masks(config, dp)
    holes = 0
    for b, bucket in enumerate(dp.buckets):
        expected = flatten(master, bucket, 0) * masks[b]                # [receivers, n]
        for r, replica in enumerate(dp.replicas):
            working = flatten([p.detach() for p in replica.model.parameters()], bucket, 0)
            assert torch.equal(working, expected[r]), (b, r)
        holes += int((masks[b] == 0).sum())
    assert holes > 0
    lost = {row["site"]: row["lost"] for row in dp.networks[0].summary(by=("site",))}
    assert lost == {row["site"]: row["lost"] for row in twin.summary(by=("site",))}
    if algorithm == "direct":
        # one send per (owner, receiver): every lost packet is one hole, a whole packet of zeros, in one
        # receiver's copy (counted over the padded message: padding is sent too)
        per_packet = twin.packets(1, torch.float32)[0]
        for b, bucket in enumerate(dp.buckets):
            shard = fsdp_module.shard_numel(twin, bucket.numel, torch.float32)
            replay = LossyNetwork(dp_group_spec(config))
            delivered = replay.all_gather(f"fsdp.gather{b}", "fwd", torch.ones(4, shard), range(4))
            zero_packets = (delivered.reshape(4, 4, shard // per_packet, per_packet) == 0).all(-1)
            assert torch.equal(zero_packets, (delivered.reshape(4, 4, shard // per_packet, per_packet) == 0).any(-1))
            assert int(zero_packets.sum()) == lost[f"fsdp.gather{b}"], b


def _counts(parts, direction=None) -> tuple[int, int]:
    rows = [row for net in parts.dp.networks for row in net.summary()
            if direction is None or row["direction"] == direction]
    return sum(r["sent"] for r in rows), sum(r["lost"] for r in rows)


def test_fsdp_traffic_loses_at_the_configured_rate_and_replicas_never_drift(tmp_path, one_torch_thread):
    """tp 2 inside nodes x dp 2 across them, loss only between nodes: gathers (fwd) and reduce-scatters
    (bwd) both lose packets at the configured rate; every replica still equals the others."""
    config = tiny(tmp_path, tp_size=2, dp_size=2, ranks_per_node=2, lossy_links="inter_node",
                  loss="bernoulli:0.05", dp_mode="fsdp")
    parts, _ = _train(config, 2)
    phases = {(row["direction"], row["phase"]) for net in parts.dp.networks for row in net.summary(by=("direction", "phase"))}
    assert phases == {("fwd", "all_gather"), ("bwd", "reduce_scatter")}
    for direction in ("fwd", "bwd"):
        sent, lost = _counts(parts, direction)
        assert sent > 2_000 and lost > 0
        assert stats.binomtest(lost, sent, 0.05).pvalue > 1e-3, (direction, lost, sent)
    sent, lost = _counts(parts)
    assert stats.binomtest(lost, sent, 0.05).pvalue > 1e-3, (lost, sent)
    assert parts.dp.drift() == 0.0
    base = _full(parts.dp.replicas[0].model)
    assert all(torch.equal(p, base[n]) for n, p in _full(parts.dp.replicas[1].model).items())
    # the losses did change training: not the loss-free run's weights
    clean, _ = _train(config.replace(loss="none"), 2)
    assert any(not torch.equal(p, base[n]) for n, p in _full(clean.model).items())


def test_lossy_traffic_dp_covers_gathers_and_reduce_scatters(tmp_path, one_torch_thread):
    only_dp, _ = _train(tiny(tmp_path, tp_size=2, dp_size=2, loss="bernoulli:0.1", lossy_traffic="dp",
                             dp_mode="fsdp"), 1)
    assert _counts(only_dp, "fwd")[1] > 0 and _counts(only_dp, "bwd")[1] > 0
    assert all(row["lost"] == 0 for r in only_dp.dp.replicas for row in r.model.network.summary())
    only_tp, _ = _train(tiny(tmp_path, tp_size=2, dp_size=2, loss="bernoulli:0.1",
                             lossy_traffic="tp_forward,tp_backward", dp_mode="fsdp"), 1)
    sent, lost = _counts(only_tp)
    assert sent > 0 and lost == 0


def test_owners_receive_the_sum_of_what_arrived(tmp_path, one_torch_thread):
    """Replica r's every gradient element is 2^r: an owner's element names the contributions it holds.
    Ring, 20% loss, dp 4: the owner's own contribution always arrives (it ends the chain), the others'
    sometimes not; what every replica gets is the owners' shards, so the same on every replica."""
    dp = 4
    config = tiny(tmp_path, dp_size=dp, dp_mode="fsdp", loss="bernoulli:0.2")
    parts = build(config, CPU, 0, True, None)
    for r, replica in enumerate(parts.dp.replicas):
        for p in replica.model.parameters():
            p.grad = torch.full_like(p, float(2 ** r))
    parts.dp.average_gradients()
    network = parts.dp.networks[0]
    grads = [[p.grad for p in replica.model.parameters()] for replica in parts.dp.replicas]
    missing = 0
    for bucket in parts.dp.buckets:
        held = flatten(grads[0], bucket, 0) * dp
        for g in grads[1:]:
            assert torch.equal(flatten(g, bucket, 0) * dp, held)
        shard = fsdp_module.shard_numel(network, bucket.numel, torch.float32)
        bits = held.round().long()
        assert torch.equal(held, bits.float()) and bits.max() <= 2 ** dp - 1
        for owner in range(dp):
            mine = bits[owner * shard:(owner + 1) * shard]
            if mine.numel():
                assert bool(((mine >> owner) & 1).all())
                missing += int((mine != 2 ** dp - 1).sum())
    assert missing > 0


def test_clock_without_loss_is_compute_plus_gathers_and_reduce_scatters(tmp_path, one_torch_thread):
    config = tiny(tmp_path, dp_size=2, dp_mode="fsdp", dp_overlap=False, steps=2)
    summary = run_experiment(config, config.out, progress=False)
    assert summary["status"] == "completed", summary.get("error")
    parts = build(config, CPU, 0, True, None)
    spec, network = dp_group_spec(config), parts.dp.networks[0]
    per_packet = (spec.payload_bytes // 4) * 4
    comm = 0.0
    for bucket in parts.dp.buckets:
        shard = fsdp_module.shard_numel(network, bucket.numel, torch.float32) * 4
        comm += nccl.collective_time("all_gather", "ring", 2, 2, shard, per_packet, spec.link_intra,
                                     spec.link_inter, spec.bus_bandwidth())
        comm += nccl.collective_time("reduce_scatter", "ring", 2, 2, 2 * shard, per_packet, spec.link_intra,
                                     spec.link_inter, spec.bus_bandwidth())
    clock = summary["sim_time"]
    assert math.isclose(clock["total_s"], 2 * (clock["compute_s_per_step"] + comm), rel_tol=1e-12)
    assert math.isclose(summary["data_parallel"]["dp_s_per_step"], comm, rel_tol=1e-12)
    assert summary["data_parallel"]["mode"] == "fsdp" and summary["data_parallel"]["drift_final"] == 0.0
    overlapped = run_experiment(config.replace(dp_overlap=True, out=str(tmp_path / "o")), str(tmp_path / "o"),
                                progress=False)["sim_time"]["total_s"]
    assert 2 * max(clock["compute_s_per_step"], comm) <= overlapped < clock["total_s"]


def test_gathered_forward_overlap_model():
    # units in backward order hold 1/2, 1/4, 1/4 of the bytes; forward runs them last to first
    ready = [0.5, 0.75, 1.0]
    assert gathered_forward_seconds(8, ready, [], overlap=True) == 8
    assert gathered_forward_seconds(8, ready, [1, 1, 1], overlap=False) == 3 + 8
    # gather 1 ends at 1, its unit computes 1..3; gather 2 (issued at 1) ends at 2, computes 3..5;
    # gather 3 (issued at 3) ends at 4, computes 5..9
    assert gathered_forward_seconds(8, ready, [1, 1, 1], overlap=True) == 9
    # communication-bound: each unit waits for its weights
    assert gathered_forward_seconds(8, ready, [4, 4, 4], overlap=True) == 4 + 2 + 2 + 4 + 4


def test_dp_mode_at_its_default_keeps_run_names(tmp_path):
    config = tiny(tmp_path, dp_size=2)
    assert "dp_mode" in config.to_dict()
    assert config_key(config) == config_key(config.replace(dp_mode="ddp"))
    assert config_key(config) != config_key(config.replace(dp_mode="fsdp"))


@pytest.mark.parametrize("changes,message", [
    (dict(dp_mode="zero3"), "dp_mode='zero3' must be one of ddp, fsdp"),
    (dict(dp_mode="fsdp", dp_size=2, recovery="hadamard"), "dp_mode=fsdp: recovery=hadamard does not act on reduce-scatters: use one of zero, rescale"),
    (dict(dp_mode="fsdp", dp_size=2, dp_sync_every=2), "dp_sync_every with dp_mode=fsdp"),
])
def test_bad_fsdp_settings_are_one_line_errors(changes, message, tmp_path):
    with pytest.raises(ValueError, match=message) as err:
        tiny(tmp_path, **changes)
    assert "\n" not in str(err.value)


# -- dist ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp,dp,loss", [(1, 2, "bernoulli:0.05"), (2, 2, "ge:rate=0.05,burst=4")])
def test_dist_equals_sim_under_loss(tp, dp, loss, tmp_path, one_torch_thread):
    """FSDP as tp x dp gloo processes against sim (on one intra-op thread, as the ranks run), loss on
    every kind of traffic, 6 steps with the gradient clipped at each: every metrics column and the saved
    weights bit for bit (``assert_dist_is_sim``), and no drift on either."""
    rows, weights = sim_and_dist(tmp_path, tp_size=tp, dp_size=dp, loss=loss, dp_mode="fsdp", grad_clip=0.1,
                                 steps=6, eval_every=6)
    assert_dist_is_sim(rows, weights)
    train = [r for r in rows["sim"] if r["split"] == "train"]
    assert train[-1]["packets_lost_dp"] > 0 and (tp == 1 or train[-1]["packets_lost_fwd"] > 0)
    assert all(r["drift"] == 0.0 for r in rows["dist"] if "drift" in r)
