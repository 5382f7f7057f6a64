"""3-D training: tp x pp x dp on one mesh (Megatron's order, tp innermost, pp outermost), on the tiny
GPT-2 and the synthetic task. Loss-free, every replica of a tp 2 x pp 2 x dp 2 run trains as one
unpipelined replica on the global batch; under loss, every kind of traffic loses at its configured rate
on the groups the mesh places. (``dist`` against ``sim``: tests/test_pipeline_dist.py; resume after
SIGKILL: tests/test_resume.py; the estimate's packets and clock: tests/test_estimate_job.py.)"""
from __future__ import annotations

import pytest
import torch
from scipy import stats

from lossysim.data import train_batches
from lossysim.run.build import build
from lossysim.run.state import TrainState, Window
from lossysim.run.step import train_step
from lossysim.tp import gather_full_model
from test_data_parallel import PARAM_TOL, tiny

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("private_cache")


def _train(config, steps: int):
    parts = build(config, CPU, 0, True, None)
    state, window = TrainState(), Window(CPU)
    for _, batch in zip(range(steps), train_batches(parts.data, config.batch_size, config.seed)):
        assert train_step(parts, config, state, window, batch, CPU)
        state.step += 1
    return parts, state


def test_loss_free_tp2_pp2_dp2_trains_as_one_unpipelined_replica_on_the_global_batch(tmp_path, one_torch_thread):
    """3 AdamW steps: each of the two replicas (each cut into two stages over TP groups of two, averaging
    each stage's buckets over its own groups) ends with one tp 1 replica's weights, trained on the whole
    batch of 8 at once, to PARAM_TOL (fp32 sums in another order: over replicas, micro-batches, shards)."""
    single, _ = _train(tiny(tmp_path, tp_size=1), 3)
    staged, state = _train(tiny(tmp_path, tp_size=2, pp_size=2, dp_size=2), 3)
    assert len(staged.dp.stage_buckets) == 2 and all(len(stage) > 1 for stage in staged.dp.stage_buckets)
    expected = dict(gather_full_model(single.model).named_parameters())
    for replica in staged.dp.replicas:
        full = dict(gather_full_model(replica.model).named_parameters())
        assert full.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(full[name], value.detach(), **PARAM_TOL, msg=name)
    assert staged.dp.drift() == 0.0 and state.pipeline_s > 0 and state.dp_s >= 0


def test_every_kind_of_traffic_loses_at_its_configured_rate_where_the_mesh_places_it(tmp_path, one_torch_thread):
    """tp 2 x pp 2 x dp 2 with a TP group to a node: TP links stay inside nodes and lose nothing; every
    replica's pipeline boundary and every stage's data-parallel groups cross nodes and lose at 5%
    (binomial tests, every packet a trial)."""
    p = 0.05
    config = tiny(tmp_path, tp_size=2, pp_size=2, dp_size=2, ranks_per_node=2, lossy_links="inter_node",
                  loss=f"bernoulli:{p}", steps=2)
    parts, _ = _train(config, 2)
    for replica in parts.dp.replicas:
        for network in replica.pipeline.networks:
            assert network.totals()["sent"] > 0 and network.totals()["lost"] == 0
        for network in replica.pipeline.boundary_networks():
            totals = network.totals()
            assert stats.binomtest(totals["lost"], totals["sent"], p).pvalue > 1e-3
    assert len(parts.dp.stage_networks) == 2 and all(len(stage) == 2 for stage in parts.dp.stage_networks)
    for network in parts.dp.networks:
        totals = network.totals()
        assert totals["sent"] > 0 and stats.binomtest(totals["lost"], totals["sent"], p).pvalue > 1e-3


def test_hidden_rel_diff_is_the_same_on_any_number_of_threads():
    """The diagnostic sim and dist both record: a sim process on two threads and dist's one-thread ranks
    must give its very bits (a whole-tensor norm is split among threads: it once differed in the 7th digit,
    the one column of a tp 2 x pp 2 run where dist was not sim)."""
    from lossysim.tp.parallelize import relative_difference
    generator = torch.Generator().manual_seed(0)
    every = torch.randn(2, 500, 261, generator=generator)
    hidden = every[..., 2:258]                      # a slice of a gathered row, as evaluation reads it
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = relative_difference(hidden)
        torch.set_num_threads(2)
        two = relative_difference(hidden)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and one[0] == 0
    expected = (hidden[1] - hidden[0]).double().norm() / hidden[0].double().norm()
    assert float(one[1]) == pytest.approx(float(expected), rel=1e-6)


def test_activation_checkpointing_recomputes_every_stage_without_sending_again(tmp_path, one_torch_thread):
    """tp 2 x pp 2 x dp 2 under loss, GPT-2's dropout on: with activation checkpointing every stage's
    recomputed blocks replay their masks and dropout, and a stage's first block gets again what its
    boundary delivered, nothing sent: the same weights and packets, bit for bit, as without; only the
    recomputed all-reduces' time is added (to the TP networks' clocks)."""
    settings = dict(tp_size=2, pp_size=2, dp_size=2, ranks_per_node=2, loss="bernoulli:0.05", dropout=0.1, steps=2)
    plain, plain_state = _train(tiny(tmp_path, **settings), 2)
    again, again_state = _train(tiny(tmp_path, activation_checkpointing=True, **settings), 2)
    for a, b in zip(plain.dp.replicas, again.dp.replicas):
        full_a, full_b = gather_full_model(a.model).state_dict(), gather_full_model(b.model).state_dict()
        assert all(torch.equal(full_a[k], full_b[k]) for k in full_a)
        for n, m in zip([*a.pipeline.networks, *a.pipeline.boundary_networks()],
                        [*b.pipeline.networks, *b.pipeline.boundary_networks()]):
            assert n.totals() == m.totals()
        for n, m in zip(a.pipeline.boundary_networks(), b.pipeline.boundary_networks()):
            assert n.clock() == m.clock()          # nothing sent again
        assert all(m.clock()["comm_s"] > n.clock()["comm_s"] for n, m in zip(a.pipeline.networks, b.pipeline.networks))
    assert again_state.pipeline_s > plain_state.pipeline_s


def test_a_one_rank_group_records_and_replays_nothing():
    """tp 1 under activation checkpointing (a pipeline stage of one rank): its row-parallel layers still call
    the all-reduce of a group of one, which sends nothing; the recomputed forward must not look for a
    recorded call (it once raised IndexError: pop from an empty deque)."""
    from collections import defaultdict, deque
    from lossysim.net import LossyNetwork
    network = LossyNetwork(1, "bernoulli:0.5", seed=0)
    x = torch.ones(1, 8)
    record = defaultdict(deque)
    with network.recording(record):
        assert torch.equal(network.all_reduce("h.0.attn.reduce", "fwd", x, [0]), x)
    with network.replaying(record):
        assert torch.equal(network.all_reduce("h.0.attn.reduce", "fwd", x, [0]), x)
    assert network.totals()["sent"] == 0 and network.clock()["comm_s"] == 0


def test_summary_names_every_class_it_sent_and_which_directions_could_lose(tmp_path, one_torch_thread):
    """summary.json's ``traffic``, one entry per class the run sent (declared in lossysim.traffic), each
    direction's packets and whether ``lossy_traffic`` let it lose; summary.csv's observed loss rate is over
    the lossy directions of every class."""
    import json
    from lossysim.results.table import collect
    from lossysim.run.experiment import run_experiment
    config = tiny(tmp_path, tp_size=2, pp_size=2, dp_size=2, ranks_per_node=1, loss="bernoulli:0.05", steps=2,
                  eval_every=2, lossy_traffic="pp_forward,dp", out=str(tmp_path / "runs" / "a"))
    assert run_experiment(config, config.out, progress=False)["status"] == "completed"
    summary = json.loads((tmp_path / "runs" / "a" / "summary.json").read_text())
    traffic = summary["traffic"]
    assert list(traffic) == ["tp", "pp", "dp"]
    assert {c: {d: v["lossy"] for d, v in per.items()} for c, per in traffic.items()} == \
        {"tp": {"fwd": False, "bwd": False}, "pp": {"fwd": True, "bwd": False}, "dp": {"bwd": True}}
    assert traffic["tp"]["fwd"]["lost"] == 0 and traffic["pp"]["fwd"]["lost"] > 0 and traffic["dp"]["bwd"]["lost"] > 0
    lossy = [traffic["pp"]["fwd"], traffic["dp"]["bwd"]]
    row = collect(tmp_path / "runs").iloc[0]
    assert row["observed_loss_rate"] == sum(d["lost"] for d in lossy) / sum(d["sent"] for d in lossy)
