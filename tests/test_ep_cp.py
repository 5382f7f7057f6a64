"""Experts beside context parallelism (ep carved out of dp x cp, as Megatron carves it), on the tiny
Mixtral-like MoE (``tiny-moe``): a replica's context ranks are members of its ep group, each holding its
own experts. Loss-free it trains as the unsplit model; under loss ``dist`` (gloo processes) is ``sim`` bit
for bit; a run resumed from its checkpoint ends as the uninterrupted one."""
from __future__ import annotations

import pytest
import torch

from lossysim.ep.context import ContextExperts
from test_data_parallel import PARAM_TOL
from test_experts import _expected_grad, assert_gradients_are_hf, averaged_against_hf, moe
from tiny_runs import assert_train_refuses, train_steps

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("private_cache", "one_torch_thread")


def _expected(module, name: str, leaf: str, hf: dict) -> torch.Tensor:
    """A ``ContextExperts``'s member c's block of the HF gradient (``gate_up_proj_{c}``), else as ep's."""
    if isinstance(module, ContextExperts):
        base, c = leaf.rsplit("_", 1)
        member = module.members[int(c)]
        return hf[f"{name.rsplit('.', 1)[0]}.{base}"][member.first:member.first + member.per_rank]
    return _expected_grad(module, name, leaf, hf)


@pytest.mark.parametrize("tp,cp,dp,ep", [(1, 2, 1, 2), (1, 2, 2, 2), (1, 2, 2, 4), (2, 2, 1, 2)])
def test_loss_free_experts_beside_context_ranks_are_the_unsharded_model(tp, cp, dp, ep, tmp_path):
    """One forward and backward: every replica's logits are HF's on its rows; after the dense buckets' and
    the experts' averages every gradient (each context rank's member's block of the experts') is HF's on
    the whole batch."""
    config = moe(tmp_path, tp_size=tp, cp_size=cp, dp_size=dp, ep_size=ep, microbatches=1)
    parts, _, _, hf_grads = averaged_against_hf(config)
    assert all(isinstance(m, ContextExperts) and len(m.members) == cp for m in parts.model.experts)
    assert_gradients_are_hf(parts, hf_grads, _expected)
    sent = {row["sent"] > 0 for rows in parts.ep.summaries().values() for row in rows}
    assert sent == {True} and len(parts.ep.groups) == tp * (dp * cp // ep)


def _weights(parts) -> dict:
    from lossysim.tp import gather_full_model
    return {k: v.detach().clone() for k, v in gather_full_model(parts.model).state_dict().items()}


@pytest.mark.parametrize("layout", [dict(cp_size=2, dp_size=1, ep_size=2), dict(cp_size=2, dp_size=2, ep_size=2),
                                    dict(cp_size=2, dp_size=2, ep_size=4),
                                    # inside pipeline stages (each stage's blocks on that stage's ep groups)
                                    dict(cp_size=2, pp_size=2, dp_size=1, ep_size=2),
                                    dict(cp_size=2, pp_size=2, dp_size=2, ep_size=4),
                                    dict(tp_size=2, cp_size=2, pp_size=2, dp_size=1, ep_size=2)])
def test_loss_free_training_follows_the_unsplit_model(layout, tmp_path):
    """Three steps (two micro-batches, the gradient clipped: every member's experts' squares in the norm)
    end with replica 0 holding, every expert gathered, the weights of one unsplit replica trained on the
    whole batch, to the tolerance data parallelism meets."""
    settings = dict(grad_clip=0.5, microbatches=2)
    reference, _, _ = train_steps(moe(tmp_path / "one", **settings), 3)
    split, state, _ = train_steps(moe(tmp_path / "split", **settings, **layout), 3)
    assert state.ep_s > 0 and state.cp_s > 0
    expected, got = _weights(reference), _weights(split)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], **PARAM_TOL, msg=name)


@pytest.mark.parametrize("layout", [dict(dp_size=1, ep_size=2), dict(dp_size=2, ep_size=4),
                                    dict(dp_size=1, ep_size=2, pp_size=2, microbatches=2)])
def test_resume_is_exact(layout, tmp_path):
    """Resumed from its step-2 checkpoint, a lossy run with experts beside context ranks ends as the
    uninterrupted one: metrics, summary, exported weights and the last checkpoint, bit for bit."""
    from test_resume import assert_resumes_exactly
    settings = dict(cp_size=2, loss="ge:rate=0.05,burst=4", recovery="zero", checkpoint_every=2,
                    keep_checkpoints=0, save_checkpoint=True, steps=4, eval_every=2, log_every=1, **layout)
    summary = assert_resumes_exactly(moe(tmp_path / "reference", **settings), tmp_path / "resumed")
    assert summary["expert_parallel"]["packets_lost_ep_dispatch"] > 0
    assert summary["expert_parallel"]["edp_size"] == 2 * layout["dp_size"] // layout["ep_size"]


def test_each_member_s_experts_cross_its_own_lossy_expert_data_parallel_group(tmp_path):
    """tp 1 x cp 2 x dp 2 x ep 2, a rank to a node, loss on the gradients alone: each member's experts are
    averaged over its own network (two, each of the two replicas' same context rank), its packets lost at
    the configured rate (binomial test, every packet a trial), and the replicas' experts drift apart."""
    from scipy import stats
    p = 0.05
    parts, _, _ = train_steps(moe(tmp_path, cp_size=2, dp_size=2, ep_size=2, ranks_per_node=1, lossy_traffic="dp",
                                  loss=f"bernoulli:{p}", recovery="zero"), 2)
    assert len(parts.ep.edp) == 2 and all(n.ranks == 2 for e in parts.ep.edp for n in e.networks)
    totals = [n.totals() for e in parts.ep.edp for n in e.networks]
    assert len({n.spec.seed for e in parts.ep.edp for n in e.networks}) == 2
    sent, lost = sum(t["sent"] for t in totals), sum(t["lost"] for t in totals)
    assert all(t["sent"] > 0 for t in totals) and stats.binomtest(lost, sent, p).pvalue > 1e-3
    first, second = (r.model.experts[0] for r in parts.dp.replicas)
    for a, b in zip(first.members, second.members):
        assert not torch.equal(a.gate_up_proj, b.gate_up_proj)


@pytest.mark.parametrize("settings, message", [
    (["--model", "tiny-moe", "--ep-size", "2", "--cp-size", "4", "--set", "max_length=32"],
     "ep_size=2 with cp_size=4: experts beside context parallelism need ep_size a multiple of cp_size"),
])
def test_what_is_still_not_modelled_is_refused_in_one_line(settings, message, tmp_path, capsys):
    assert_train_refuses(settings, message, tmp_path / "o", capsys)


# -- dist against sim ------------------------------------------------------------------------------------

PROCESSES = 4
DEADLINE_S = 420
BASE = dict(model="tiny-moe", tp_size=1, cp_size=2, max_train_samples=96, max_eval_samples=32, steps=3, eval_every=3,
            log_every=1, warmup_steps=1, dropout=0.0, lr=1e-3, dp_bucket_mb=0.05, save_checkpoint=True,
            grad_clip=0.1, loss="ge:rate=0.05,burst=4", recovery="zero", ranks_per_node=1)
CASES = {
    # every packet a trial: dispatch, combine, keys and values, and (with replicas) both gradient groups lose
    "cp-lossy": dict(dp_size=1, ep_size=2),
    "cp-dp-lossy": dict(dp_size=2, ep_size=2, microbatches=2),
    # every TP rank's own ep group of the context ranks (a rank to a node: TP traffic loses too)
    "tp-cp-lossy": dict(tp_size=2, dp_size=1, ep_size=2),
    # an ep group over two replicas' context ranks, stopped after its step-2 checkpoint and resumed
    "cp-ep4-resumed": dict(dp_size=2, ep_size=4, steps=4, eval_every=2, checkpoint_every=2, keep_checkpoints=0),
    # inside two pipeline stages (every class losing packets: boundaries too), stopped and resumed
    "cp-pp-resumed": dict(dp_size=1, ep_size=2, pp_size=2, microbatches=2, steps=4, eval_every=2, checkpoint_every=2,
                          keep_checkpoints=0),
}
# (name, first process, processes), one after another
PLAN = [("cp-lossy", 0, 2), ("cp-dp-lossy", 0, 4), ("tp-cp-lossy", 0, 4), ("cp-ep4-resumed", 0, 4),
        ("cp-pp-resumed", 0, 4)]


def _settings(name: str) -> dict:
    return {**BASE, **CASES[name]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case's run directory on dist, by name."""
    from dist_workers import spawn_runs
    return spawn_runs(tmp_path_factory, "ep-cp-dist", PLAN, {name: _settings(name) for name in CASES}, PROCESSES,
                      DEADLINE_S)


@pytest.mark.parametrize("name", list(CASES))
def test_dist_is_sim_bit_for_bit_under_loss(runs, name):
    """Gilbert-Elliott loss on every link (dispatch and combine both ways, keys and values, the dense
    gradients' dp x cp group, the experts' own groups), the gradient clipped: every metrics row and saved
    weight of the gloo processes is sim's; a run stopped after its step-2 checkpoint and resumed too."""
    from dist_workers import assert_keeps_first_rows, written
    from lossysim.run.experiment import run_experiment
    from test_data_parallel import assert_dist_is_sim
    from tiny_runs import tiny_run
    sim_dir = runs / name / "sim"
    config = tiny_run(sim_dir, backend="sim", **_settings(name))
    assert run_experiment(config, sim_dir, progress=False)["status"] == "completed"
    (sim_rows, sim_weights), (dist_rows, dist_weights) = written(sim_dir), written(runs / name / "dist")
    assert len(sim_rows) == len(dist_rows)
    assert_dist_is_sim({"sim": sim_rows, "dist": dist_rows}, [sim_weights, dist_weights])
    last = [r for r in sim_rows if r["split"] == "train"][-1]
    assert last["packets_lost_ep_dispatch"] > 0 and last["packets_lost_ep_combine"] > 0
    assert last["packets_lost_cp_fwd"] > 0 and last["packets_lost_cp_bwd"] > 0
    if CASES[name]["dp_size"] > 1:
        assert last["packets_lost_dp"] > 0
    if CASES[name].get("tp_size", 1) > 1:
        assert last["packets_lost_fwd"] > 0
    if name.endswith("-resumed"):
        assert_keeps_first_rows(runs / name, dist_rows)
