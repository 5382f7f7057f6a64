"""The combinations with pipeline stages and context parallelism that train: context parallelism inside
pipeline stages, FSDP with pipeline stages, and context ranks' gradients over the lossy dp x cp group.

Each is loss-free the unsplit model's training (one replica on the global batch, to the data-parallel
tests' ``PARAM_TOL``), ``dist`` (one gloo process a rank, one spawn of 4 for the module) is ``sim`` bit for
bit under loss, and a run stopped after a checkpoint and resumed ends as the uninterrupted one."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dist_workers import assert_keeps_first_rows, spawn_runs, written
from lossysim.run import checkpoint
from lossysim.run.experiment import run_experiment
from lossysim.tp import gather_full_model
from test_data_parallel import PARAM_TOL, assert_dist_is_sim, tiny
from test_resume import assert_same_run
from tiny_runs import tiny_run, train_steps

pytestmark = pytest.mark.usefixtures("private_cache")

PROCESSES = 4
DEADLINE_S = 300
BASE = dict(max_train_samples=64, max_eval_samples=32, steps=3, eval_every=3, log_every=1, warmup_steps=1,
            dropout=0.0, lr=1e-3, dp_bucket_mb=0.05, save_checkpoint=True)
LOSSY = dict(loss="bernoulli:0.05", ranks_per_node=1, grad_clip=0.1)   # every link crosses nodes
LAYOUTS = {
    "cp-pp": dict(tp_size=1, cp_size=2, pp_size=2, recovery="mask"),
    "fsdp-pp": dict(tp_size=1, dp_size=2, pp_size=2, dp_mode="fsdp", recovery="zero"),
    # the context ranks' gradients over the lossy dp x cp group
    "cp-dp": dict(tp_size=1, cp_size=2, dp_size=2, recovery="mask"),
}
CASES = {f"{name}-lossy": {**layout, **LOSSY} for name, layout in LAYOUTS.items()}
CASES["cp-pp-resumed"] = {**CASES["cp-pp-lossy"], "steps": 4, "eval_every": 2, "checkpoint_every": 2,
                          "keep_checkpoints": 0}


def _settings(name: str) -> dict:
    return {**BASE, **CASES[name]}


# -- loss-free: the unsplit model's training --------------------------------------------------------

@pytest.mark.parametrize("layout", [dict(tp_size=1, cp_size=2, pp_size=2, microbatches=2),
                                    dict(tp_size=2, cp_size=2, pp_size=2, dp_size=2, ranks_per_node=2),
                                    dict(tp_size=1, dp_size=2, pp_size=2, dp_mode="fsdp", microbatches=2),
                                    dict(tp_size=2, dp_size=2, pp_size=2, dp_mode="fsdp")])
def test_loss_free_combinations_train_as_one_replica_on_the_global_batch(layout, tmp_path, one_torch_thread):
    """Two AdamW steps end with the weights of one tp 1 replica trained on the whole batch, every
    replica's, to PARAM_TOL; the combination's own traffic was sent."""
    single, _, _ = train_steps(tiny(tmp_path, tp_size=1), 2)
    split, state, _ = train_steps(tiny(tmp_path, **layout), 2)
    expected = dict(gather_full_model(single.model).named_parameters())
    for replica in split.dp.replicas:
        got = dict(gather_full_model(replica.model).named_parameters())
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value.detach(), **PARAM_TOL, msg=name)
    assert split.dp.drift() == 0.0 and state.pipeline_s > 0
    assert all(b.network.totals()["sent"] > 0 for b in split.pipeline.boundaries)
    if layout.get("cp_size", 1) > 1:   # every stage's context groups, every context rank's boundaries
        assert len(split.context.train_networks.cp) == 2 * layout["tp_size"] and state.cp_s > 0
        assert all(n.totals()["sent"] > 0 for n in split.context.train_networks.cp)
        assert all(n.totals()["sent"] > 0 for b in split.pipeline.boundaries for n in b.contexts)
    if layout.get("dp_mode") == "fsdp":   # each stage's units over its own groups, the gathers on the clock
        assert split.dp.fsdp and all(len(stage) > 1 for stage in split.dp.stage_buckets) and state.dp_s > 0
        assert all(n.totals()["sent"] > 0 for n in split.dp.networks)


def test_fsdp_gathers_before_each_stage_s_first_forward_lengthen_the_step(tmp_path, one_torch_thread):
    """Loss-free FSDP with stages: the same schedule as DDP's (compute, TP and boundary traffic alike),
    and FSDP's step longer than DDP's by what the gathers add (dp_s: its reduce-scatters are DDP's
    all-reduces' first half, so only the gathers can make it longer)."""
    steps = {}
    for mode in ("ddp", "fsdp"):
        _, state, _ = train_steps(tiny(tmp_path, tp_size=1, dp_size=2, pp_size=2, dp_mode=mode, dp_overlap=False), 2)
        steps[mode] = state
    assert steps["fsdp"].pipeline_s == steps["ddp"].pipeline_s and steps["fsdp"].dp_s > steps["ddp"].dp_s > 0


def test_the_gradients_group_is_megatron_s_dp_x_cp():
    """``dp_cp``: the ranks at one TP position and stage over every (context, replica), context inner, as
    Megatron's data-parallel group with context parallelism; with cp 1 the dp group, its network too."""
    from lossysim.mesh import Mesh
    mesh = Mesh(tp=2, cp=2, dp=2, pp=2)
    for rank in range(mesh.world):
        at = mesh.coordinates(rank)
        group = mesh.group("dp_cp", rank)
        assert group == [mesh.rank(tp=at["tp"], pp=at["pp"], cp=i % 2, dp=i // 2) for i in range(4)]
        assert set(group) == {r for r in range(mesh.world) if {k: v for k, v in mesh.coordinates(r).items()
                                                               if k in ("tp", "pp")} == {"tp": at["tp"], "pp": at["pp"]}}
    flat = Mesh(tp=2, dp=4, pp=2)
    settings = tiny_run("unused", dp_size=4, tp_size=2).network_settings()
    for rank in range(flat.world):
        assert flat.group("dp_cp", rank) == flat.group("dp", rank)
        assert flat.network_spec("dp_cp", rank, settings, ("bwd",)) == flat.network_spec("dp", rank, settings, ("bwd",))


def test_context_ranks_gradients_cross_the_lossy_dp_x_cp_group(tmp_path, one_torch_thread):
    """tp 1 x cp 2 x dp 2, a rank to a node, loss on the gradients alone: each TP position's gradient
    group is Megatron's dp x cp (4 members, every context rank's own gradients), its packets lost at the
    configured rate (binomial test, every packet a trial), the keys and values exact, and the replicas
    drift apart (each keeps what its context ranks received, on average)."""
    from scipy import stats
    p = 0.05
    parts, _, _ = train_steps(tiny(tmp_path, tp_size=1, cp_size=2, dp_size=2, ranks_per_node=1, lossy_traffic="dp",
                                   loss=f"bernoulli:{p}"), 2)
    mesh = parts.dp.replicas[0].model.context
    assert [n.ranks for n in parts.dp.networks] == [4] and mesh.gradients is not None
    totals = parts.dp.networks[0].totals()
    assert totals["sent"] > 0 and stats.binomtest(totals["lost"], totals["sent"], p).pvalue > 1e-3
    assert all(n.totals()["lost"] == 0 < n.totals()["sent"] for r in parts.dp.replicas
               for n in r.model.context.train_networks.cp)
    assert parts.dp.drift() > 0


# -- resume -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_lossy_combination_resumes_exactly(name, tmp_path, one_torch_thread):
    """Stopped after its step-2 checkpoint and resumed, a lossy run ends as the uninterrupted one: every
    row, the summary, the weights and every rank's last checkpoint (networks, streams, counters)."""
    settings = {**BASE, **LAYOUTS[name], **LOSSY, "steps": 4, "eval_every": 2, "checkpoint_every": 2,
                "keep_checkpoints": 0}
    reference = tiny_run(tmp_path / "reference", **settings)
    assert run_experiment(reference, reference.out, progress=False)["status"] == "completed"
    resumed = tiny_run(tmp_path / "resumed", **settings)
    assert run_experiment(resumed, resumed.out, progress=False)["status"] == "completed"
    for later in checkpoint.complete(resumed.out)[1:]:
        shutil.rmtree(later)
    for part in ("summary.json", "checkpoint"):
        path = Path(resumed.out) / part
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    assert run_experiment(resumed, resumed.out, progress=False, resume=True)["status"] == "completed"
    assert_same_run(Path(reference.out), Path(resumed.out))


# -- dist against sim -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case's run directory on dist, by name."""
    return spawn_runs(tmp_path_factory, "combos-dist", [(name, 0, PROCESSES) for name in CASES],
                      {name: _settings(name) for name in CASES}, PROCESSES, DEADLINE_S)


def _sim(runs: Path, name: str, tmp_path_factory, monkeypatch) -> Path:
    monkeypatch.setenv("LOSSYSIM_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    run_dir = runs / name / "sim"
    config = tiny_run(run_dir, backend="sim", **_settings(name))
    assert run_experiment(config, run_dir, progress=False)["status"] == "completed"
    return run_dir


@pytest.mark.parametrize("name", ["cp-pp-lossy", "fsdp-pp-lossy", "cp-dp-lossy"])
def test_lossy_dist_combinations_are_sims_bit_for_bit(name, runs, tmp_path_factory, monkeypatch, one_torch_thread):
    """5% Bernoulli loss on every link, the gradient clipped: every metrics row and saved weight."""
    (sim_rows, sim_weights), (dist_rows, dist_weights) = (written(d) for d in
                                                         (_sim(runs, name, tmp_path_factory, monkeypatch),
                                                          runs / name / "dist"))
    assert len(sim_rows) == len(dist_rows)
    assert_dist_is_sim({"sim": sim_rows, "dist": dist_rows}, [sim_weights, dist_weights])
    last = [r for r in sim_rows if r["split"] == "train"][-1]
    if "pp" in name:
        assert last["packets_lost_pp_fwd"] > 0 and last["packets_lost_pp_bwd"] > 0
    if name.startswith("cp"):
        assert last["packets_lost_cp_fwd"] > 0 and last["packets_lost_cp_bwd"] > 0 and last["cp_s_per_step"] > 0
    if "dp" in name:
        assert last["packets_lost_dp"] > 0 and last["dp_s_per_step"] > 0
        assert (last["drift"] == 0.0) if "fsdp" in name else (last["drift"] > 0)   # FSDP's exact master copy


def test_a_dist_context_pipeline_resumes_exactly(runs, tmp_path_factory, monkeypatch, one_torch_thread):
    """Stopped after its step-2 checkpoint and resumed on dist, tp 1 x cp 2 x pp 2 ends as sim's
    uninterrupted run; the rows up to the checkpoint are the first run's."""
    name = "cp-pp-resumed"
    (sim_rows, sim_weights), (dist_rows, dist_weights) = (written(d) for d in
                                                         (_sim(runs, name, tmp_path_factory, monkeypatch),
                                                          runs / name / "dist"))
    assert_dist_is_sim({"sim": sim_rows, "dist": dist_rows}, [sim_weights, dist_weights])
    assert_keeps_first_rows(runs / name, dist_rows)
