"""lossysim estimate for a whole job (tp x pp x dp): a tiny 2-D estimate counts and times what a training
run with the same settings does, each traffic class's zero-loss closed forms and packet counts, and
bad layouts in one line."""
import numpy as np
import pytest
import torch

from lossysim.cli import main
from lossysim.data import train_batches
from lossysim.estimate import Shape, Workload, estimate, job_config
from lossysim.models import cost
from lossysim.net import LossyNetwork, NetworkSpec
from lossysim.net.transfer import packets
from lossysim.pp import pipeline_time
from lossysim.run.build import build
from lossysim.run.state import TrainState, Window
from lossysim.run.step import train_step
from tiny_runs import tiny_run

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("private_cache")
STEPS = 2


def _trained(tmp_path, **changes):
    """A tiny-llama LM run of STEPS steps (every batch 8 x 16 tokens), its parts and clock."""
    config = tiny_run(tmp_path / "run", **{**dict(model="tiny-llama", task="lm", max_length=16, max_train_samples=64,
                                                  max_eval_samples=8, steps=STEPS, dropout=0.0, seed=5,
                                                  tp_size=2), **changes})
    parts = build(config, CPU, 0, True, None)
    state, window = TrainState(), Window(CPU)
    for _, batch in zip(range(STEPS), train_batches(parts.data, config.batch_size, config.seed)):
        assert batch["input_ids"].shape == (8, 16)
        assert train_step(parts, config, state, window, batch, CPU)
        state.step += 1
    model = parts.model
    shape = Shape("tiny-llama", model.config, model.plan, parts.parameters, parts.layers, parts.hidden,
                  parts.kernels - cost.collective_kernels(parts.layers, config.tp_size))
    return config, parts, state, shape


def _totals(networks) -> dict:
    sums = {"sent": 0, "lost": 0, "resent": 0}
    for network in networks:
        totals = network.totals()
        for name in sums:
            sums[name] += totals[name]
    return sums


@pytest.mark.parametrize("loss", ["none", "bernoulli:0.05"])
def test_a_tp_pp_estimate_counts_and_times_what_training_does(tmp_path, loss):
    config, parts, state, shape = _trained(tmp_path, pp_size=2, microbatches=4, loss=loss, transport="retransmit",
                                           nic="irn", ranks_per_node=2)
    row = estimate(shape, config, Workload(seq=16), steps=STEPS)    # the run's own config
    pipeline = parts.pipeline
    for cls, networks in (("tp", pipeline.networks), ("pp", pipeline.boundary_networks())):
        trained = _totals(networks)
        for name in ("sent", "lost", "resent"):
            assert row[f"{cls}_packets_{name}"] * STEPS == trained[name], (cls, name)
    assert row["step_mean_s"] == pytest.approx(state.pipeline_s / STEPS, rel=1e-12)
    if loss == "none":
        assert row["loss_free_step_s"] == row["step_mean_s"] and row["packets_lost"] == 0
    else:
        assert row["pp_packets_lost"] > 0 and row["tp_packets_lost"] > 0


@pytest.mark.parametrize("changes", [dict(loss="none"), dict(loss="bernoulli:0.05", transport="retransmit", nic="srd"),
                                     dict(loss="none", dp_overlap=False, dp_bucket_mb=0.5),
                                     dict(loss="none", dp_mode="fsdp")])
def test_a_tp_dp_estimate_counts_and_times_what_training_does(tmp_path, changes):
    config, parts, state, shape = _trained(tmp_path, dp_size=2, ranks_per_node=2, **changes)
    row = estimate(shape, config, Workload(seq=16), steps=STEPS)
    tp_networks = [parts.train_net] + [r.model.group.network for r in parts.dp.replicas[1:]]
    for cls, networks in (("tp", tp_networks), (row["dp_mode"].replace("ddp", "dp"), parts.dp.networks)):
        trained = _totals(networks)
        for name in ("sent", "lost", "resent"):
            assert row[f"{cls}_packets_{name}"] * STEPS == trained[name], (cls, name)
    total = state.compute_s + parts.train_net.clock()["comm_s"] + state.dp_s
    assert row["step_mean_s"] == pytest.approx(total / STEPS, rel=1e-12)
    assert row["gpus"] == 4 and row["layout"] == "tp2 x pp1 x dp2 = 4 GPUs on 2 nodes"


@pytest.mark.parametrize("changes", [dict(loss="none"), dict(loss="bernoulli:0.05", transport="retransmit", nic="irn"),
                                     dict(loss="bernoulli:0.05", recovery="zero", dp_overlap=False),
                                     dict(loss="bernoulli:0.05", transport="retransmit", activation_checkpointing=True)])
def test_a_tp_pp_dp_estimate_counts_and_times_what_training_does(tmp_path, changes):
    """The 3-D job (tp 2 x pp 2 x dp 2, a TP group to a node): every replica's stages and boundaries, every
    stage's DDP groups, counted and timed by the estimate as the training run of the same config did (with
    activation checkpointing: each recomputed block's all-reduces charged again, a boundary's activations
    not sent again)."""
    config, parts, state, shape = _trained(tmp_path, pp_size=2, dp_size=2, microbatches=2, ranks_per_node=2,
                                           dp_bucket_mb=0.05, **changes)
    row = estimate(shape, config, Workload(seq=16), steps=STEPS)
    replicas = parts.dp.replicas
    for cls, networks in (("tp", [n for r in replicas for n in r.pipeline.networks]),
                          ("pp", [n for r in replicas for n in r.pipeline.boundary_networks()]),
                          ("dp", parts.dp.networks)):
        trained = _totals(networks)
        for name in ("sent", "lost", "resent"):
            assert row[f"{cls}_packets_{name}"] * STEPS == trained[name], (cls, name)
    assert row["step_mean_s"] == pytest.approx((state.pipeline_s + state.dp_s) / STEPS, rel=1e-12)
    assert row["layout"] == "tp2 x pp2 x dp2 = 8 GPUs on 4 nodes"
    if changes["loss"] != "none":
        assert row["dp_packets_lost"] > 0 and row["pp_packets_lost"] > 0


def _micro_seconds(shape, tokens: int, tp: int, seq: int) -> float:
    """One micro-batch's modelled compute, as training charges it."""
    from lossysim import timing
    return timing.parse_compute("h100").step_time(
        shape.parameters, tokens, tp, kernels=shape.kernels + cost.collective_kernels(shape.layers, tp),
        attention_flops=cost.step_flops(0, tokens, shape.layers, shape.hidden, seq))


def _all_reduce_s(spec: NetworkSpec, nodes: int, numel: int, dtype: torch.dtype) -> float:
    from lossysim.timing import nccl
    per_packet, _ = packets(spec.payload_bytes, numel, dtype)
    return nccl.collective_time("all_reduce", "ring", spec.ranks, nodes, numel * dtype.itemsize,
                                per_packet * dtype.itemsize, spec.link_intra, spec.link_inter, spec.bus_bandwidth())


def test_zero_loss_pipeline_is_its_schedule_over_closed_forms_and_its_packets_are_sends_times_packets():
    from lossysim.estimate import load
    from lossysim.pp.stages import stage_parameters
    from lossysim.timing import nccl
    from transformers import AutoModelForCausalLM
    shape, tp, m, seq, rows = load("tiny-llama"), 2, 3, 8, 2
    config = job_config("tiny-llama", micro_batch=rows, tp_size=tp, pp_size=2, microbatches=m, ranks_per_node=tp,
                        link_inter="roce-400g")
    spec = config.network_spec()
    row = estimate(shape, config, Workload(seq=seq), steps=2)
    numel, dtype = seq * rows * shape.hidden, torch.bfloat16
    per_packet, n = packets(spec.payload_bytes, numel, dtype)
    # every TP rank's copy, both ways, every micro-batch, one boundary
    assert row["pp_packets_sent"] == n * tp * 2 * m and row["packets_lost"] == 0
    # a ring all-reduce sends each packet 2 (R - 1) times; 2 stages x 4 all-reduces per micro-batch
    assert row["tp_packets_sent"] == m * 2 * 4 * 2 * (tp - 1) * n
    send = nccl.p2p_time(numel * 2, per_packet * 2, spec.link_inter)
    one = _all_reduce_s(spec, 1, numel, dtype)
    c = _micro_seconds(shape, seq * rows, tp, seq)
    with torch.device("meta"):
        counts = stage_parameters(AutoModelForCausalLM.from_config(shape.config), (1, 1))
    flops = [cost.step_flops(k, seq * rows, 1, shape.hidden, seq) for k in counts]
    shares = [f / sum(flops) for f in flops]
    forward = [[c * (1 / 3) * s + 2 * one] * m for s in shares]
    backward = [[c * (2 / 3) * s + 2 * one] * m for s in shares]
    expected = pipeline_time("1f1b", 2, m, forward, backward, send, send).step_s
    assert row["step_mean_s"] == pytest.approx(expected, rel=1e-12)
    assert row["loss_free_step_s"] == row["step_mean_s"] and row["slowdown"] == 1.0
    # what the sends add: the step less the same schedule with free sends (0 when slack hides them)
    free = pipeline_time("1f1b", 2, m, forward, backward).step_s
    assert row["pp_loss_free_s"] == pytest.approx(expected - free, abs=1e-15) and row["pp_repair_s"] == 0
    assert sum(row[f"stack_{k}_s"] for k in ("compute", "tp", "pp", "repair")) == pytest.approx(row["step_mean_s"])


@pytest.mark.parametrize("overlap", [True, False])
def test_zero_loss_ddp_is_compute_tp_and_its_bucket_in_closed_form(overlap):
    from lossysim.estimate import load
    from lossysim.tp.parallelize import parallelize
    from transformers import AutoModelForCausalLM
    shape, tp, dp, seq, rows = load("tiny-llama"), 2, 2, 8, 2
    config = job_config("tiny-llama", micro_batch=rows, tp_size=tp, dp_size=dp, ranks_per_node=tp, dp_bucket_mb=1000,
                        dp_overlap=overlap, link_inter="roce-400g")
    spec = config.network_spec()
    row = estimate(shape, config, Workload(seq=seq), steps=1)
    with torch.device("meta"):
        model = parallelize(AutoModelForCausalLM.from_config(shape.config), tp, LossyNetwork(tp))
    sharded = {id(p) for p in model.sharded_parameters()}
    local = sum((p[0] if id(p) in sharded else p).numel() for p in model.parameters())   # one bucket: all of it
    dp_spec = NetworkSpec(dp, "none", ranks_per_node=1, link_inter="roce-400g")
    bucket = _all_reduce_s(dp_spec, dp, local, torch.float32)
    numel = seq * rows * shape.hidden
    tp_s = 4 * 2 * _all_reduce_s(spec, 1, numel, torch.bfloat16)     # 2 blocks x (2 forward + 2 backward)
    c = _micro_seconds(shape, seq * rows, tp, seq)
    # one bucket, ready when the backward ends: it follows the backward with overlap or without
    assert row["step_mean_s"] == pytest.approx(c + tp_s + bucket, rel=1e-12)
    assert row["dp_loss_free_s"] == pytest.approx(bucket, rel=1e-9)
    _, n = packets(dp_spec.payload_bytes, local, torch.float32)
    assert row["dp_packets_sent"] == tp * 2 * (dp - 1) * n   # a group per TP position, a ring of dp


def _error(capsys, *argv) -> str:
    assert main(["estimate", "tiny-llama", "--tp-size", "2", "--seq", "8", *argv, "--steps", "1",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err


def test_bad_layouts_are_one_line_errors(capsys):
    assert "pp_size=3 does not divide the model's 2 layers" in _error(capsys, "--pp-size", "3")
    assert "ranks_per_node=4 must divide" in _error(capsys, "--dp-size", "3", "--gpus-per-node", "4")
    assert "global_batch=7 does not split" in _error(capsys, "--dp-size", "2", "--global-batch", "7")
    assert "global_batch=8 is not micro_batch=1 x microbatches=3" in _error(
        capsys, "--dp-size", "2", "--global-batch", "8", "--microbatches", "3")
    assert "ranks_per_node=16 is more GPUs than" in _error(capsys, "--dp-size", "2", "--gpus-per-node", "16")
    assert "dp_size=0 must be" in _error(capsys, "--dp-size", "0")
    assert "dp_mode=fsdp with pp_size=2" in _error(capsys, "--dp-size", "2", "--dp-mode", "fsdp", "--pp-size", "2")


def test_a_global_batch_sets_the_microbatches_and_the_summary_names_the_layout(capsys):
    config = job_config("tiny-llama", micro_batch=2, global_batch=12, tp_size=2, pp_size=2, dp_size=2, ranks_per_node=4)
    row = estimate("tiny-llama", config, Workload(seq=8), steps=1)
    assert row["microbatches"] == 3 and row["global_batch"] == 12
    assert row["layout"] == "tp2 x pp2 x dp2 = 8 GPUs on 2 nodes"


def test_each_stage_buckets_its_own_local_gradients():
    """A stage's DDP buckets hold exactly its parameters' local shards: its blocks, the embeddings on the
    first stage, the final norm and the head on the last."""
    from lossysim.estimate import load
    from lossysim.estimate.job import Job
    from lossysim.tp.parallelize import parallelize
    from transformers import AutoModelForCausalLM
    shape, tp = load("tiny-llama"), 2
    config = job_config("tiny-llama", tp_size=tp, pp_size=2, dp_size=2, dp_bucket_mb=0.05, ranks_per_node=tp)
    job = Job(shape, config, Workload(seq=8), (1, 1), 8)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape.config)
    tp_model = parallelize(model, tp, LossyNetwork(tp))
    sharded = {id(p) for p in tp_model.sharded_parameters()}
    local = [0, 0]
    for name, p in model.named_parameters():
        stage = 1 if ".layers.1." in name or ".norm." in name or name.startswith("lm_head") else 0
        local[stage] += (p[0] if id(p) in sharded else p).numel()
    assert [sum(b.numel for b in stage) for stage in job.buckets] == local
    assert all(len(stage) > 1 for stage in job.buckets)


def _step_means(shape, sampled: int, seeds, tp: int, pp: int, overlap: bool) -> list[float]:
    return [estimate(shape, job_config(shape.name, micro_batch=4, tp_size=tp, pp_size=pp, dp_size=4, microbatches=8,
                                       ranks_per_node=tp, dp_bucket_mb=0.01, dp_overlap=overlap, loss="bernoulli:0.02",
                                       transport="retransmit", nic="irn", link_inter="roce-400g",
                                       lossy_links="inter_node", seed=seed),
                     Workload(seq=64, sampled_groups=sampled), steps=2)["step_mean_s"] for seed in seeds]


@pytest.mark.parametrize("tp, pp, overlap", [(2, 2, True), (4, 1, False), (2, 4, False)])
def test_the_slowest_of_sampled_groups_has_full_simulations_distribution(tmp_path, tp, pp, overlap):
    """Two of each stage's (boundary's) lossy groups simulated, the slowest of the rest drawn from their
    times: the step's distribution over seeds is the full simulation's (two-sample KS and Welch's t on
    30 seeds each; disjoint seeds, so the samples are independent). tp 2 x pp 2 x dp 4: every replica's
    pp sends (4 per boundary, 2 drawn); tp 4 x dp 4: every DDP bucket (4 groups, 2 drawn; no overlap,
    so each bucket's slowest is on the step's path); tp 2 x pp 4 x dp 4: stages 1 and 2 (one block each,
    alike) share stage 1's two simulated DDP groups, stage 2's drawn whole."""
    from scipy import stats
    from lossysim.estimate import load
    config = load("tiny-llama").config
    config.num_hidden_layers = pp if pp > 2 else 2     # a block a stage: the middle stages alike
    config.save_pretrained(tmp_path)
    shape = load(str(tmp_path / "config.json"))
    full = _step_means(shape, 0, range(30), tp, pp, overlap)
    sampled = _step_means(shape, 2, range(1000, 1030), tp, pp, overlap)
    assert len(set(full)) == 30    # continuous enough for the test: no ties
    assert stats.ks_2samp(full, sampled).pvalue > 0.01
    assert stats.ttest_ind(full, sampled, equal_var=False).pvalue > 0.01    # Welch: the means too


def test_sampled_groups_count_what_they_stand_for_and_is_exact_when_zero():
    """The model scales the simulated groups' packets by G / k (so a loss-free job counts exactly), and
    sampled_groups=0 simulates every group: its row is the default's on a small mesh."""
    from lossysim.estimate import load
    shape = load("tiny-llama")
    config = job_config("tiny-llama", micro_batch=2, tp_size=2, pp_size=2, dp_size=4, ranks_per_node=2,
                        link_inter="roce-400g", lossy_links="inter_node")
    rows = [estimate(shape, config, Workload(seq=8, sampled_groups=k), steps=2) for k in (None, 0, 1)]
    assert rows[0] == rows[1]
    for key in ("tp_packets_sent", "pp_packets_sent", "dp_packets_sent", "step_mean_s"):
        assert rows[2][key] == pytest.approx(rows[0][key], rel=1e-12), key
    with pytest.raises(ValueError, match="sampled_groups"):
        Workload(sampled_groups=-1)


def test_equal_estimates_draw_alike_whatever_memory_is_reused():
    """Networks are let go once counted: two equal estimates in one process, with garbage collected and
    memory churned between them, give the same row (stage ownership of parameters once hung on ids of
    freed objects, which made such runs differ)."""
    import gc
    from lossysim.estimate import load
    shape = load("tiny-llama")
    config = job_config("tiny-llama", micro_batch=2, tp_size=2, pp_size=2, dp_size=2, ranks_per_node=2,
                        dp_bucket_mb=0.01, loss="bernoulli:0.05", transport="retransmit", nic="irn",
                        link_inter="roce-400g", lossy_links="inter_node", seed=3)
    workload = Workload(seq=16)
    first = estimate(shape, config, workload, steps=3)
    gc.collect()
    churn = [bytearray(1000) for _ in range(1000)]
    again = estimate(shape, config, workload, steps=3)
    assert first["packets_lost"] > 0 and first == again and len(churn) == 1000


@pytest.mark.parametrize("algorithm", ["ring", "auto"])
def test_the_csv_names_what_each_class_ran(algorithm):
    """The ``collectives`` column: per class and collective, the (algorithm/protocol, channels) NCCL's
    model runs it as, as a network of that class records it (``LossyNetwork.choices``)."""
    config = job_config("tiny", tp_size=2, pp_size=2, dp_size=2, ranks_per_node=2, algorithm=algorithm,
                        loss="bernoulli:0.01", transport="retransmit")
    row = estimate("tiny", config, Workload(seq=64), steps=1)
    entries = row["collectives"].split("; ")
    assert {e.split(":")[0] for e in entries} == {"tp all_reduce", "pp send", "dp all_reduce"}
    assert all(" x" in e and ("KiB" in e or "MiB" in e) for e in entries)
    assert any(e.startswith("pp send: p2p/") for e in entries)
    tp = LossyNetwork(config.network_spec())
    tp.simulate("h.0.attn.reduce", "fwd", 64 * 2 * 64, torch.bfloat16, "all_reduce", deliver=False)
    (choice,) = tp.choices()
    assert any(e.startswith(f"tp all_reduce: {choice['algorithm']}/{choice['protocol']} x{choice['channels']}")
               for e in entries)


def test_fsdp_counts_the_elements_its_gathers_and_reduce_scatters_lose():
    """Dropped at p on every link of a ring of R: a gathered shard misses a packet at the receiver d hops
    on with probability 1 - (1-p)^d (its own shard is exact), a reduce-scattered sum misses a contribution
    with 1 - (1-p)^(R-1). Each unit leaves R x R shards after its gather and R sums after its reduce-scatter,
    so the class's share is their weighted mean (20 steps: ~55,000 losses, a relative error of about 1%)."""
    p, R = 0.05, 4
    gather = sum(1 - (1 - p) ** d for d in range(1, R)) / R
    reduce = 1 - (1 - p) ** (R - 1)
    job = dict(micro_batch=2, tp_size=1, dp_size=R, dp_mode="fsdp", ranks_per_node=1, loss=f"bernoulli:{p}")
    row = estimate("tiny-llama", job_config("tiny-llama", transport="drop", seed=1, **job), Workload(seq=8), steps=20)
    assert row["fsdp_elements_lost"] == pytest.approx((R * R * gather + R * reduce) / (R * R + R), rel=0.05)
    exact = estimate("tiny-llama", job_config("tiny-llama", transport="retransmit", **job), Workload(seq=8), steps=2)
    assert exact["fsdp_elements_lost"] == 0 and exact["fsdp_packets_lost"] > 0


def test_a_class_repair_is_what_its_losses_add_and_nothing_where_it_loses_nothing():
    """A class's repair seconds are the step less the same step with only that class's messages loss-free:
    never negative (a schedule's end never grows as a part shrinks) and exactly 0 for a class that lost no
    packet (TP on loss-free links here), however the other classes' repairs move the schedule."""
    from lossysim.estimate import load
    network = dict(loss="bernoulli:0.05", transport="retransmit", nic="tcp", ranks_per_node=2,
                   link_inter="roce-400g", lossy_links="inter_node")
    for layout in (dict(pp_size=2, microbatches=3), dict(dp_size=2)):
        config = job_config("tiny-llama", micro_batch=2, tp_size=2, **layout, **network)
        row = estimate(load("tiny-llama"), config, Workload(seq=8), steps=3)
        assert row["tp_packets_lost"] == 0 and row["tp_repair_s"] == 0.0
        lossy = [c for c in ("pp", "dp") if row[f"{c}_packets_lost"] > 0]
        assert lossy and all(row[f"{c}_repair_s"] > 0 for c in lossy)
        assert all(row[f"{c}_repair_s"] >= 0 for c in ("tp", "pp", "dp", "fsdp"))


def test_groups_alike_share_their_transfers_and_their_rows_are_those_of_networks_built_alone(monkeypatch):
    """The groups of a stage differ only by their seeds, so they share each call shape's transfer (built once,
    not once a group): the row is the one networks built alone give, to the last bit, under loss and
    retransmission (its lazily derived parts included)."""
    from lossysim.estimate import load, messages
    from lossysim.net import transfer
    shape = load("tiny-llama")
    config = job_config("tiny-llama", micro_batch=2, tp_size=2, pp_size=2, dp_size=4, ranks_per_node=2,
                        dp_bucket_mb=0.01, loss="bernoulli:0.05", transport="retransmit", nic="irn",
                        link_inter="roce-400g", lossy_links="inter_node", seed=4)
    built = []
    real_build = transfer.build
    monkeypatch.setattr(transfer, "build", lambda *a, **k: built.append(a[2:]) or real_build(*a, **k))
    shared = estimate(shape, config, Workload(seq=16, sampled_groups=0), steps=2)
    shared_builds = len(built)
    monkeypatch.setattr(messages, "_network", lambda spec, shapes: LossyNetwork(spec))
    built.clear()
    alone = estimate(shape, config, Workload(seq=16, sampled_groups=0), steps=2)
    assert shared["packets_lost"] > 0 and shared["packets_resent"] > 0 and shared == alone
    assert shared_builds < len(built) and len(set(built)) < len(built)
