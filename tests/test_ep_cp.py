"""Experts beside context parallelism (ep carved out of dp x cp, as Megatron carves it), on the tiny
Mixtral-like MoE (``tiny-moe``): a replica's context ranks are members of its ep group, each holding its
own experts. Loss-free it trains as the unsplit model; under loss ``dist`` (gloo processes) is ``sim`` bit
for bit; a run resumed from its checkpoint ends as the uninterrupted one."""
from __future__ import annotations

import pytest
import torch

from lossysim.data import train_batches
from lossysim.ep.context import ContextExperts
from lossysim.run.build import build
from test_data_parallel import GRAD_TOL, PARAM_TOL
from test_experts import LOGIT_TOL, _expected_grad, _hf, moe
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
    parts = build(config, CPU, 0, True, None)
    hf = _hf(config, parts)
    batch = next(train_batches(parts.data, 8, 0))
    hf.train()
    out = hf(**batch)
    out.loss.backward()
    rows = 8 // dp

    def forward_backward(r: int):
        replica = parts.dp.replicas[r].model
        replica.train()
        got = replica(**{k: v[r * rows:(r + 1) * rows] for k, v in batch.items()})
        got.loss.backward()
        return got.logits.detach()
    results = parts.ep.run([lambda r=r: forward_backward(r) for r in range(dp)])
    for r, logits in enumerate(results):
        torch.testing.assert_close(logits, out.logits[r * rows:(r + 1) * rows].detach(), **LOGIT_TOL)
    parts.dp.average_gradients()
    parts.ep.average_gradients(parts.dp.replicas)
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert all(isinstance(m, ContextExperts) and len(m.members) == cp for m in parts.model.experts)
    for replica in parts.dp.replicas:
        for module_name, module in replica.model.model.named_modules():
            for leaf, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{leaf}"
                assert param.grad is not None, name
                torch.testing.assert_close(param.grad, _expected(module, name, leaf, hf_grads), **GRAD_TOL,
                                           msg=name)
    sent = {row["sent"] > 0 for rows in parts.ep.summaries().values() for row in rows}
    assert sent == {True} and len(parts.ep.groups) == tp * (dp * cp // ep)


def _weights(parts) -> dict:
    from lossysim.tp import gather_full_model
    return {k: v.detach().clone() for k, v in gather_full_model(parts.model).state_dict().items()}


@pytest.mark.parametrize("layout", [dict(cp_size=2, dp_size=1, ep_size=2), dict(cp_size=2, dp_size=2, ep_size=2),
                                    dict(cp_size=2, dp_size=2, ep_size=4)])
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


@pytest.mark.parametrize("layout", [dict(dp_size=1, ep_size=2), dict(dp_size=2, ep_size=4)])
def test_resume_is_exact(layout, tmp_path):
    """Resumed from its step-2 checkpoint, a lossy run with experts beside context ranks ends as the
    uninterrupted one: metrics, summary, exported weights and the last checkpoint, bit for bit."""
    from test_resume import assert_resumes_exactly
    settings = dict(cp_size=2, loss="ge:rate=0.05,burst=4", recovery="zero", checkpoint_every=2,
                    keep_checkpoints=0, save_checkpoint=True, steps=4, eval_every=2, log_every=1, **layout)
    summary = assert_resumes_exactly(moe(tmp_path / "reference", **settings), tmp_path / "resumed")
    assert summary["expert_parallel"]["packets_lost_ep_dispatch"] > 0
    assert summary["expert_parallel"]["edp_size"] == 2 * layout["dp_size"] // layout["ep_size"]


@pytest.mark.parametrize("settings, message", [
    (["--model", "tiny-moe", "--ep-size", "2", "--cp-size", "4", "--set", "max_length=32"],
     "ep_size=2 with cp_size=4: experts beside context parallelism need ep_size a multiple of cp_size"),
    (["--model", "tiny-moe", "--ep-size", "2", "--cp-size", "2", "--pp-size", "2"],
     "training ep_size=2 with cp_size=2 and pp_size=2"),
])
def test_what_is_still_not_modelled_is_refused_in_one_line(settings, message, tmp_path, capsys):
    assert_train_refuses(settings, message, tmp_path / "o", capsys)
