"""Data parallelism (dp_size replicas of the TP group, DDP buckets over lossy DP links), on the tiny
GPT-2 and the synthetic task: loss-free DP equals one replica on the global batch, losses land where
and as often as configured, rescale is unbiased, drift, and the clock's closed form."""
from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from scipy import stats

from lossysim.clock import step_seconds
from lossysim.config import ExperimentConfig
from lossysim.data import train_batches
from lossysim.dp import plan_buckets
from lossysim.io import read_jsonl
from lossysim.run.build import build
from lossysim.run.experiment import run_experiment
from lossysim.run.state import TrainState, Window
from lossysim.run.step import train_step
from lossysim.timing import nccl
from tiny_runs import dp_group_spec, tiny_run, train_steps

CPU = torch.device("cpu")
# Sums over replicas and over the global batch add the same numbers in another order: fp32 rounding.
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
PARAM_TOL = dict(rtol=1e-4, atol=1e-5)


pytestmark = pytest.mark.usefixtures("private_cache")


def tiny(tmp_path, **changes) -> ExperimentConfig:
    sizes = dict(max_train_samples=96, max_eval_samples=32, steps=3, eval_every=3, log_every=1, warmup_steps=1,
                 dropout=0.0, lr=1e-3, tp_size=1, dp_bucket_mb=0.05)
    return tiny_run(tmp_path / "run", **{**sizes, **changes})


def assert_replicas_equal(dp, model) -> None:
    """Every replica holds ``model``'s parameters (to PARAM_TOL), and so the replicas have not drifted."""
    expected = _full(model)
    for replica in dp.replicas:
        got = _full(replica.model)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], **PARAM_TOL, msg=name)
    assert dp.drift() == 0.0


def _backward(model, batch):
    model.train()
    model(**batch).loss.backward()


def _full(model) -> dict:
    """Every parameter (every TP rank's shard), by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tp,dp", [(1, 2), (1, 4), (2, 2), (2, 4)])
def test_loss_free_data_parallel_equals_one_replica_on_the_global_batch(tp, dp, tmp_path, one_torch_thread):
    single = build(tiny(tmp_path, tp_size=tp), CPU, 0, True, None)
    parallel = build(tiny(tmp_path, tp_size=tp, dp_size=dp), CPU, 0, True, None)
    assert len(parallel.dp.buckets) > 1        # the small cap cuts the model into several buckets
    batch = next(train_batches(single.data, 8, 0))
    _backward(single.model, batch)
    for r, replica in enumerate(parallel.dp.replicas):
        _backward(replica.model, {k: v[r * 8 // dp:(r + 1) * 8 // dp] for k, v in batch.items()})
    parallel.dp.average_gradients()
    expected = _grads(single.model)
    for replica in parallel.dp.replicas:
        got = _grads(replica.model)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], **GRAD_TOL, msg=name)

    # A few whole steps: every replica's parameters follow the single replica's.
    single = build(tiny(tmp_path, tp_size=tp), CPU, 0, True, None)
    parallel = build(tiny(tmp_path, tp_size=tp, dp_size=dp), CPU, 0, True, None)
    for parts in (single, parallel):
        state, window = TrainState(), Window(CPU)
        for step, batch in zip(range(3), train_batches(parts.data, 8, 0)):
            assert train_step(parts, parts_config(parts, tp, dp if parts is parallel else 1, tmp_path),
                              state, window, batch, CPU)
            state.step += 1
    assert_replicas_equal(parallel.dp, single.model)


def parts_config(parts, tp, dp, tmp_path):
    return tiny(tmp_path, tp_size=tp, dp_size=dp)


def _lossy_step(config, steps=2):
    return train_steps(config, steps)[:2]


def _dp_counts(parts) -> tuple[int, int]:
    rows = [row for net in parts.dp.networks for row in net.summary()]
    return sum(r["sent"] for r in rows), sum(r["lost"] for r in rows)


def test_dp_links_lose_at_the_configured_rate_and_tp_links_inside_nodes_lose_nothing(tmp_path, one_torch_thread):
    """tp 2 inside nodes x dp 2 across them, loss only between nodes."""
    config = tiny(tmp_path, tp_size=2, dp_size=2, ranks_per_node=2, lossy_links="inter_node",
                  loss="bernoulli:0.05")
    parts, _ = _lossy_step(config)
    for replica in parts.dp.replicas:
        tp = replica.model.network.summary(by=("link_class",))
        assert {row["link_class"] for row in tp} == {"intra"}
        assert sum(row["lost"] for row in tp) == 0 and sum(row["sent"] for row in tp) > 0
    by_class = {row["link_class"] for net in parts.dp.networks for row in net.summary(by=("link_class",))}
    assert by_class == {"inter"}
    sent, lost = _dp_counts(parts)
    assert sent > 5_000
    assert stats.binomtest(lost, sent, 0.05).pvalue > 1e-3, (lost, sent)


def test_lossy_traffic_selects_which_kind_loses_packets(tmp_path, one_torch_thread):
    only_dp, _ = _lossy_step(tiny(tmp_path, tp_size=2, dp_size=2, loss="bernoulli:0.1", lossy_traffic="dp"), 1)
    assert all(row["lost"] == 0 for r in only_dp.dp.replicas for row in r.model.network.summary())
    assert _dp_counts(only_dp)[1] > 0
    only_tp, _ = _lossy_step(tiny(tmp_path, tp_size=2, dp_size=2, loss="bernoulli:0.1",
                                  lossy_traffic="tp_forward,tp_backward"), 1)
    assert _dp_counts(only_tp)[1] == 0
    lost = {row["direction"]: row["lost"] for row in only_tp.train_net.summary()}
    assert lost["fwd"] > 0 and lost["bwd"] > 0
    fwd_only, _ = _lossy_step(tiny(tmp_path, tp_size=2, dp_size=2, loss="bernoulli:0.1",
                                   lossy_traffic="tp_forward"), 1)
    lost = {row["direction"]: row["lost"] for row in fwd_only.train_net.summary()}
    assert lost["fwd"] > 0 and lost["bwd"] == 0 and _dp_counts(fwd_only)[1] == 0


def _constant_gradients(parts):
    """Replica r's every gradient element is 2^r: a delivered sum names the contributions it holds."""
    for r, replica in enumerate(parts.dp.replicas):
        for p in replica.model.parameters():
            p.grad = torch.full_like(p, float(2 ** r))


def test_zero_delivers_the_sum_of_what_arrived_divided_by_dp(tmp_path, one_torch_thread):
    dp = 4
    parts = build(tiny(tmp_path, dp_size=dp, loss="bernoulli:0.2", algorithm="direct"), CPU, 0, True, None)
    _constant_gradients(parts)
    parts.dp.average_gradients()
    per_packet = parts.dp.networks[0].packets(1, torch.float32)[0]
    for r, replica in enumerate(parts.dp.replicas):
        held = torch.cat([p.grad.flatten() for p in replica.model.parameters()]) * dp
        assert torch.equal(held, held.round()) and held.min() >= 0 and held.max() <= 2 ** dp - 1
        bits = held.long()
        # direct exchange: a receiver's own contribution is always there, the others' when they arrive
        assert bool(((bits >> r) & 1).all())
        sampled = bits[::per_packet]        # about one element per packet: a packet's elements share its fate
        for j in range(dp):
            if j != r:
                arrived = int(((sampled >> j) & 1).sum())
                assert stats.binomtest(arrived, sampled.numel(), 0.8).pvalue > 1e-3, (j, arrived, sampled.numel())


def test_rescale_is_unbiased(tmp_path, one_torch_thread):
    """Ring, 20% loss, dp 4: what arrives, divided hop by hop by the probability it arrives, averages
    to the true mean (one element per packet: elements of one packet share its fate)."""
    dp = 4
    parts = build(tiny(tmp_path, dp_size=dp, loss="bernoulli:0.2", recovery="rescale"), CPU, 0, True, None)
    _constant_gradients(parts)
    parts.dp.average_gradients()
    truth = (2 ** dp - 1) / dp
    per_packet = parts.dp.networks[0].packets(1, torch.float32)[0]
    samples = torch.cat([torch.cat([p.grad.flatten() for p in r.model.parameters()])[::per_packet]
                         for r in parts.dp.replicas])
    assert samples.numel() > 1000
    assert (samples != truth).float().mean() > 0.2        # loss did change what arrived
    assert stats.ttest_1samp(samples.double().numpy(), truth).pvalue > 1e-3
    zero = build(tiny(tmp_path, dp_size=dp, loss="bernoulli:0.2"), CPU, 0, True, None)
    _constant_gradients(zero)
    zero.dp.average_gradients()
    biased = torch.cat([torch.cat([p.grad.flatten() for p in r.model.parameters()]) for r in zero.dp.replicas])
    assert biased.mean() < 0.9 * truth                     # zero drops: biased low


def test_drift_is_zero_without_loss_and_grows_with_loss(tmp_path, one_torch_thread):
    runs = {}
    for loss in ("none", "bernoulli:0.02", "bernoulli:0.2"):
        config = tiny(tmp_path, tp_size=2, dp_size=2, loss=loss, steps=4, out=str(tmp_path / loss))
        summary = run_experiment(config, config.out, progress=False)
        assert summary["status"] == "completed", summary.get("error")
        runs[loss] = summary["data_parallel"]
        rows = read_jsonl(Path(config.out) / "metrics.jsonl")
        assert all("drift" in row for row in rows)
    assert runs["none"]["drift_final"] == 0.0 and runs["none"]["drift_max"] == 0.0
    assert 0 < runs["bernoulli:0.02"]["drift_final"] < runs["bernoulli:0.2"]["drift_final"]


def test_sync_every_k_steps_brings_the_replicas_back_together(tmp_path, one_torch_thread):
    config = tiny(tmp_path, dp_size=2, loss="bernoulli:0.2", steps=4, dp_sync_every=2, dp_overlap=False)
    summary = run_experiment(config, config.out, progress=False)
    train = [r for r in read_jsonl(Path(config.out) / "metrics.jsonl") if r["split"] == "train"]
    assert [r["drift"] == 0.0 for r in train][1::2] == [True, True]   # synchronised after steps 2 and 4
    assert train[2]["drift"] > 0
    plain = run_experiment(config.replace(dp_sync_every=0, out=str(tmp_path / "plain")), str(tmp_path / "plain"),
                           progress=False)
    assert summary["sim_time"]["total_s"] > plain["sim_time"]["total_s"]   # two broadcasts on the clock


@pytest.mark.parametrize("recovery", ["hadamard", "stale", "error_feedback"])
def test_recovery_policies_cope_with_lost_gradient_buckets(recovery, tmp_path, one_torch_thread):
    """A policy acts on DP buckets as on TP all-reduces: the same packets are lost as under zero, and what
    the replicas end with is finite and not zero's."""
    config = tiny(tmp_path, tp_size=1, dp_size=2, loss="bernoulli:0.1", lossy_traffic="dp")
    zero, _ = _lossy_step(config)
    coped, _ = _lossy_step(config.replace(recovery=recovery))
    assert _dp_counts(coped) == _dp_counts(zero) and _dp_counts(zero)[1] > 0
    for rz, rc in zip(zero.dp.replicas, coped.dp.replicas):
        params = list(rc.model.parameters())
        assert all(torch.isfinite(p).all() for p in params)
        assert not all(torch.equal(x, y) for x, y in zip(rz.model.parameters(), params))


def test_same_seed_same_masks(tmp_path, one_torch_thread):
    config = tiny(tmp_path, tp_size=2, dp_size=2, loss="ge:rate=0.05,burst=4")
    a, _ = _lossy_step(config)
    b, _ = _lossy_step(config)
    assert [n.stats() for n in a.dp.networks] == [n.stats() for n in b.dp.networks]
    for ra, rb in zip(a.dp.replicas, b.dp.replicas):
        assert all(torch.equal(x, y) for x, y in zip(ra.model.parameters(), rb.model.parameters()))
    # every DP group and every replica's TP links draw their own chains
    lost = [tuple(row["lost"] for row in n.stats()) for n in a.dp.networks]
    assert lost[0] != lost[1]
    tp_lost = [tuple(row["lost"] for row in r.model.network.stats()) for r in a.dp.replicas]
    assert tp_lost[0] != tp_lost[1]


def test_clock_without_loss_is_compute_plus_the_buckets_closed_form(tmp_path, one_torch_thread):
    config = tiny(tmp_path, dp_size=2, dp_overlap=False, steps=2)
    summary = run_experiment(config, config.out, progress=False)
    parts = build(config, CPU, 0, True, None)
    spec = dp_group_spec(config)
    buckets = sum(nccl.collective_time("all_reduce", "ring", 2, 2, b.numel * 4, (spec.payload_bytes // 4) * 4,
                                       spec.link_intra, spec.link_inter, spec.bus_bandwidth())
                  for b in parts.dp.buckets)
    clock = summary["sim_time"]
    assert clock["comm_s_per_step"] == 0.0                     # tp 1: no TP traffic
    assert math.isclose(clock["total_s"], 2 * (clock["compute_s_per_step"] + buckets), rel_tol=1e-12)
    assert math.isclose(summary["data_parallel"]["dp_s_per_step"], buckets, rel_tol=1e-12)
    overlapped = run_experiment(config.replace(dp_overlap=True, out=str(tmp_path / "o")), str(tmp_path / "o"),
                                progress=False)["sim_time"]["total_s"]
    assert 2 * max(clock["compute_s_per_step"], buckets) <= overlapped < clock["total_s"]


def test_step_seconds_overlap_model():
    # backward 6 s after a 3 s forward; buckets ready at 1/3, 2/3 and all of backward, 1 s each
    assert step_seconds(3, 6, [1 / 3, 2 / 3, 1.0], [1, 1, 1], overlap=False) == 12
    assert step_seconds(3, 6, [1 / 3, 2 / 3, 1.0], [1, 1, 1], overlap=True) == 10
    # communication-bound: buckets queue behind each other
    assert step_seconds(3, 6, [0.5, 0.5, 1.0], [4, 4, 4], overlap=True) == 3 + 3 + 12


def test_buckets_are_reverse_parameter_order_and_capped():
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((100,), (2, 50), (300,), (10,))]
    sharded = {id(params[1])}
    buckets = plan_buckets(params, sharded, cap_bytes=350 * 4)   # 10 + 300 + 50 local elements pass the cap
    assert [b.params for b in buckets] == [(3, 2, 1), (0,)]
    assert buckets[0].numels == (10, 300, 50) and buckets[0].sharded == (False, False, True)
    assert buckets[-1].ready == 1.0 and 0 < buckets[0].ready < 1


@pytest.mark.parametrize("changes,message", [
    (dict(dp_size=0), "dp_size=0"),
    (dict(dp_size=3), "batch_size=8 must be a multiple of dp_size=3"),
    (dict(dp_size=2, tp_size=2, ranks_per_node=3), "ranks_per_node=3"),
    (dict(lossy_traffic="tp,dp"), "lossy_traffic"),
    (dict(dp_bucket_mb=0), "dp_bucket_mb"),
])
def test_bad_data_parallel_settings_are_one_line_errors(changes, message, tmp_path):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        tiny(tmp_path, **changes)


def sim_and_dist(tmp_path, **settings) -> tuple[dict, list]:
    """A short tiny run of ``settings`` on sim and as tp x dp gloo processes on dist (torchrun, one
    thread each): each one's metrics.jsonl rows (same length) and saved weights."""
    import yaml
    from safetensors.torch import load_file

    from torchrun_launch import torchrun

    settings = dict(model="tiny", dataset="synthetic", max_length=32, max_train_samples=96, max_eval_samples=32,
                    batch_size=8, eval_batch_size=32, steps=3, eval_every=3, log_every=1, warmup_steps=1,
                    dropout=0.0, lr=1e-3, dp_bucket_mb=0.05, save_checkpoint=True) | settings
    spec = tmp_path / "run.yaml"
    spec.write_text(yaml.safe_dump(settings))
    sim = tiny(tmp_path, **settings, out=str(tmp_path / "sim"))
    assert run_experiment(sim, sim.out, progress=False)["status"] == "completed"
    result = torchrun(["train", "--config", str(spec), "--backend", "dist", "--out", str(tmp_path / "dist"),
                       "--no-progress"],
                      nproc=settings["tp_size"] * settings["dp_size"] * settings.get("cp_size", 1),
                      env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {name: read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("sim", "dist")}
    assert len(rows["sim"]) == len(rows["dist"])
    weights = [load_file(tmp_path / name / "checkpoint" / "model.safetensors") for name in ("sim", "dist")]
    return rows, weights


def assert_dist_is_sim(rows: dict, weights: list) -> None:
    """Every metrics column but wall-clock time (packets, loss rates, clock, losses, accuracies,
    drift, disagreement) and every saved weight, bit for bit."""
    for a, b in zip(rows["sim"], rows["dist"]):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if key not in ("time_s", "tokens_per_s"):
                assert b[key] == value, (a["step"], a["split"], key)
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        assert torch.equal(weights[1][name], weights[0][name]), name


def test_dist_equals_sim_under_loss(tmp_path, one_torch_thread):
    """tp 2 x dp 2 as 4 gloo processes (2-D process groups) against sim (on one intra-op thread, as
    the ranks run: CPU matmuls round differently across thread counts), Gilbert-Elliott loss on every
    kind of traffic, 6 steps with the gradient clipped at each, each replica's shard in two micro-batches:
    bit for bit (``assert_dist_is_sim``). A sum taken in another order (a replicated gradient, the clipping
    norm, drift, the micro-batches' gradients) fails it within them."""
    rows, weights = sim_and_dist(tmp_path, tp_size=2, dp_size=2, loss="ge:rate=0.05,burst=4", grad_clip=0.1,
                                 steps=6, eval_every=6, microbatches=2)
    assert_dist_is_sim(rows, weights)
    last = [r for r in rows["sim"] if r["split"] == "train"][-1]
    assert last["packets_lost_dp"] > 0 and last["packets_lost_fwd"] > 0 and last["drift"] > 0
