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
