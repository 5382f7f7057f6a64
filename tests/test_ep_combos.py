"""Expert parallelism beside the other parallelisms: inside pipeline stages (DeepSeek-V3's layout, pp x ep,
at tiny sizes) and beside FSDP, on the tiny Mixtral-like MoE (``tiny-moe``) and the synthetic task.
Loss-free each trains as the unsplit model; under loss, ``dist`` (gloo processes) is ``sim`` bit for bit;
a run resumed from its checkpoint ends as the uninterrupted one. (Experts beside context parallelism:
test_ep_cp.py.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_workers import assert_keeps_first_rows, spawn_runs, written
from lossysim.models import NAMED_SHAPES
from lossysim.run.experiment import run_experiment
from test_data_parallel import PARAM_TOL, assert_dist_is_sim
from test_experts import averaged_against_hf, assert_gradients_are_hf, moe
from tiny_runs import assert_train_refuses, tiny_run, train_steps

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("private_cache", "one_torch_thread")


@pytest.mark.parametrize("model,tp,dp,ep,pp,layout", [
    ("tiny-moe", 1, 2, 2, 2, None), ("tiny-moe", 2, 4, 2, 2, None), ("tiny-moe", 1, 4, 4, 2, None),
    # DeepSeek-V3's own shape of layout (its dense first block on stage 0, experts over ep beside stages)
    ("tiny-deepseek-v3", 1, 4, 4, 2, "1,2"), ("tiny-deepseek-v3", 2, 2, 2, 3, None)])
def test_loss_free_experts_in_stages_are_the_unsharded_model(model, tp, dp, ep, pp, layout, tmp_path):
    """One forward and backward through every stage: every replica's logits and loss are HF's on its rows;
    after the dense buckets' and the experts' averages (each stage's over its own groups) every gradient is
    HF's on the whole batch, to the tolerance the unstaged experts meet."""
    config = moe(tmp_path, model=model, tp_size=tp, dp_size=dp, ep_size=ep, pp_size=pp, pp_layout=layout, microbatches=1)
    parts, _, _, hf_grads = averaged_against_hf(config)
    stages = {m.stage for m in parts.model.experts}
    dense_first = model == "tiny-deepseek-v3"      # its dense first block: stage 0 holds no experts
    assert stages == set(range(1 if dense_first else 0, pp))
    assert_gradients_are_hf(parts, hf_grads)
    # every stage's experts all-to-all over that stage's groups, their streams apart
    sent = {row["sent"] > 0 for rows in parts.ep.summaries().values() for row in rows}
    assert sent == {True} and len(parts.ep.groups) == pp * tp * (dp // ep)


def _weights(parts) -> dict:
    from lossysim.tp import gather_full_model
    return {k: v.detach().clone() for k, v in gather_full_model(parts.model).state_dict().items()}


@pytest.mark.parametrize("combo", [dict(pp_size=2), dict(pp_size=2, tp_size=2, dp_size=4), dict(dp_mode="fsdp"),
                                   dict(dp_mode="fsdp", dp_size=4)])
def test_loss_free_training_follows_the_unsplit_model(combo, tmp_path):
    """Three steps (the gradient clipped: every stage's experts' squares in the norm) with experts in stages
    or beside FSDP end with replica 0 holding the weights of plain data parallelism on the same
    micro-batches, to the tolerance data parallelism meets."""
    settings = dict(dp_size=2, grad_clip=0.5, microbatches=2) | {k: v for k, v in combo.items() if k != "dp_mode"}
    reference, _, _ = train_steps(moe(tmp_path / "one", **{**settings, "pp_size": 1, "tp_size": 1}), 3)
    split, state, _ = train_steps(moe(tmp_path / "split", **{**settings, **combo, "ep_size": 2}), 3)
    assert state.ep_s > 0
    expected, got = _weights(reference), _weights(split)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], **PARAM_TOL, msg=name)


def test_a_stage_s_all_to_alls_are_inside_its_schedule(tmp_path):
    """With stages the all-to-alls sit in their stage's forward and backward: replica 0's stages are busy
    longer than with ep 1 (the same compute, no TP traffic) by exactly its all-to-alls' seconds, and the
    clock does not add them beside the schedule's step a second time."""
    from lossysim.run import clock as record
    settings = dict(dp_size=2, pp_size=2, ranks_per_node=1)
    _, alone, _ = train_steps(moe(tmp_path / "ep1", **settings), 2)
    config = moe(tmp_path / "ep2", **settings, ep_size=2)
    parts, state, _ = train_steps(config, 2)
    assert state.ep_s > 0 and alone.ep_s == 0
    assert state.pp_busy_s - alone.pp_busy_s == pytest.approx(state.ep_s, rel=1e-9)
    clock = record.clock(state, parts.train_net, config, parts.pipeline)
    assert clock["sim_time_s"] == state.pipeline_s + state.dp_s + state.cp_s + state.restart_s


@pytest.mark.parametrize("combo", [dict(pp_size=2), dict(dp_mode="fsdp")])
def test_resume_is_exact(combo, tmp_path):
    """Resumed from its step-2 checkpoint, a lossy run with experts in stages or beside FSDP ends as the
    uninterrupted one: metrics, summary, exported weights (every expert of every stage gathered) and the
    last checkpoint (every stage's ep and edp networks), bit for bit."""
    from test_resume import assert_resumes_exactly
    settings = dict(dp_size=4, ep_size=2, loss="ge:rate=0.05,burst=4", checkpoint_every=2, keep_checkpoints=0,
                    save_checkpoint=True, steps=4, eval_every=2, log_every=1, **combo)
    summary = assert_resumes_exactly(moe(tmp_path / "reference", **settings), tmp_path / "resumed")
    assert summary["expert_parallel"]["packets_lost_ep_dispatch"] > 0


@pytest.mark.parametrize("settings, message", [
    (["--model", "tiny-moe", "--dp-size", "2", "--ep-size", "2", "--pp-size", "2", "--set",
      "activation_checkpointing=true"],
     "training ep_size=2 with activation_checkpointing=True (recomputed blocks) is not supported"),
])
def test_what_is_still_not_modelled_is_refused_in_one_line(settings, message, tmp_path, capsys):
    assert_train_refuses(settings, message, tmp_path / "o", capsys)


# -- dist against sim ------------------------------------------------------------------------------------

PROCESSES = 4
DEADLINE_S = 420
BASE = dict(model="tiny-moe", tp_size=1, max_train_samples=96, max_eval_samples=32, steps=3, eval_every=3, log_every=1,
            warmup_steps=1, dropout=0.0, lr=1e-3, dp_bucket_mb=0.05, save_checkpoint=True, grad_clip=0.1,
            loss="ge:rate=0.05,burst=4", recovery="drop_token", ranks_per_node=1)
CASES = {
    # every packet a trial: dispatch, combine, TP, pipeline and both data-parallel groups' traffic lose
    "pp-lossy": dict(dp_size=2, ep_size=2, pp_size=2),
    "fsdp-lossy": dict(dp_size=2, ep_size=2, dp_mode="fsdp", microbatches=2),
    "pp-resumed": dict(dp_size=2, ep_size=2, pp_size=2, steps=4, eval_every=2, checkpoint_every=2,
                       keep_checkpoints=0),
    "fsdp-edp-resumed": dict(dp_size=4, ep_size=2, dp_mode="fsdp", steps=4, eval_every=2, checkpoint_every=2,
                             keep_checkpoints=0),
}
PHASES = [[("pp-lossy", 0, 4), ("pp-resumed", 0, 4), ("fsdp-edp-resumed", 0, 4), ("fsdp-lossy", 0, 2)]]


def _untied() -> None:
    """tiny-moe with a head of its own: a dist pipeline's first and last stage cannot share one."""
    model_type, shape = NAMED_SHAPES["tiny-moe"]
    NAMED_SHAPES["tiny-moe"] = (model_type, {**shape, "tie_word_embeddings": False})


def _settings(name: str) -> dict:
    return {**BASE, **CASES[name]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case's run directory on dist, by name."""
    return spawn_runs(tmp_path_factory, "ep-combos-dist",
                      [case for phase in PHASES for case in phase], {name: _settings(name) for name in CASES},
                      PROCESSES, DEADLINE_S, setup=_untied)


@pytest.fixture
def sim(runs, monkeypatch):
    """A case's uninterrupted run on sim, in this process, with the same untied head."""
    model_type, shape = NAMED_SHAPES["tiny-moe"]
    monkeypatch.setitem(NAMED_SHAPES, "tiny-moe", (model_type, {**shape, "tie_word_embeddings": False}))

    def run(name: str) -> Path:
        run_dir = runs / name / "sim"
        config = tiny_run(run_dir, backend="sim", **_settings(name))
        assert run_experiment(config, run_dir, progress=False)["status"] == "completed"
        return run_dir
    return run


@pytest.mark.parametrize("name", list(CASES))
def test_dist_is_sim_bit_for_bit_under_loss(runs, sim, name):
    """Gilbert-Elliott loss on every link (dispatch and combine both ways, TP, pipeline, DP, FSDP, the
    experts' own groups), drop_token, the gradient clipped: every metrics row and saved weight of the gloo
    processes is sim's; a run stopped after its step-2 checkpoint and resumed too."""
    (sim_rows, sim_weights), (dist_rows, dist_weights) = written(sim(name)), written(runs / name / "dist")
    assert len(sim_rows) == len(dist_rows)
    assert_dist_is_sim({"sim": sim_rows, "dist": dist_rows}, [sim_weights, dist_weights])
    last = [r for r in sim_rows if r["split"] == "train"][-1]
    assert last["packets_lost_ep_dispatch"] > 0 and last["packets_lost_ep_combine"] > 0
    if CASES[name].get("pp_size", 1) > 1:
        assert last["packets_lost_pp_fwd"] > 0 and last["pipeline_s_per_step"] > 0
    if name.endswith("-resumed"):
        assert_keeps_first_rows(runs / name, dist_rows)
