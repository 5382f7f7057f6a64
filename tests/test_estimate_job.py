"""lossysim estimate for a whole job (tp x pp x dp): a tiny 2-D estimate counts and times what a training
run with the same settings does, each traffic class's zero-loss closed forms and packet counts, and
bad layouts in one line."""
import pytest
import torch

from lossysim.cli import main
from lossysim.data import train_batches
from lossysim.estimate import Shape, Workload, estimate
from lossysim.models import cost
from lossysim.net import LossyNetwork, NetworkSpec
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
    workload = Workload(seq=16, micro_batch=2, dtype="fp32", pp_size=2, microbatches=4)
    row = estimate(shape, config.network_spec(), workload, steps=STEPS)
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
    workload = Workload(seq=16, micro_batch=4, dtype="fp32", dp_size=2, dp_mode=config.dp_mode,
                        dp_bucket_mb=config.dp_bucket_mb, dp_overlap=config.dp_overlap)
    row = estimate(shape, config.network_spec(), workload, steps=STEPS)
    tp_networks = [parts.train_net] + [r.model.group.network for r in parts.dp.replicas[1:]]
    for cls, networks in (("tp", tp_networks), (row["dp_mode"].replace("ddp", "dp"), parts.dp.networks)):
        trained = _totals(networks)
        for name in ("sent", "lost", "resent"):
            assert row[f"{cls}_packets_{name}"] * STEPS == trained[name], (cls, name)
    total = state.compute_s + parts.train_net.clock()["comm_s"] + state.dp_s
    assert row["step_mean_s"] == pytest.approx(total / STEPS, rel=1e-12)
    assert row["gpus"] == 4 and row["layout"] == "tp2 x pp1 x dp2 = 4 GPUs on 2 nodes"
