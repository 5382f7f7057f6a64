"""Gradient accumulation (``microbatches``): a replica's shard in k forward/backwards of B/k rows
trains as one forward/backward of B rows, with and without tensor and data parallelism (loss-free)."""
from __future__ import annotations

import pytest
import torch

from lossysim.run.build import build
from tiny_runs import tiny_run, train_steps

CPU = torch.device("cpu")
# The micro-batches' gradients are summed in another order than one backward sums them: fp32 rounding,
# compounded over a few AdamW steps (the loss-free DP test's tolerance).
PARAM_TOL = dict(rtol=1e-4, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
# Attention's key bias gets no gradient in exact arithmetic (softmax ignores what q.b adds to a whole
# row of scores), only fp32 rounding of about 1e-11; AdamW divides that by its own square root, so
# those elements move by rounding noise, differently on every CPU's kernels. Weights are compared
# where the whole batch's gradient is above that noise.
NOISE = 1e-8

pytestmark = pytest.mark.usefixtures("private_cache")


def _config(tmp_path, steps=3, **changes):
    return tiny_run(tmp_path / "run", max_train_samples=96, max_eval_samples=32, steps=steps, warmup_steps=1,
                    dropout=0.0, lr=1e-3, grad_clip=0.0, dp_bucket_mb=0.05, **changes)


def _train(tmp_path, steps=3, **changes):
    return train_steps(_config(tmp_path, steps, **changes), steps)


@pytest.mark.parametrize("tp,dp,k", [(1, 1, 2), (1, 1, 8), (2, 1, 4), (2, 2, 2)])
def test_microbatches_train_as_one_batch(tp, dp, k, tmp_path, one_torch_thread):
    whole, whole_state, whole_window = _train(tmp_path, tp_size=tp, dp_size=dp)
    split, split_state, split_window = _train(tmp_path, tp_size=tp, dp_size=dp, microbatches=k)
    start = build(_config(tmp_path, tp_size=tp, dp_size=dp), CPU, 0, True, None).model
    moved, noisy = 0.0, 0
    for (name, expected), got, initial in zip(whole.model.named_parameters(), split.model.parameters(),
                                              start.parameters()):
        gradient = whole.optimizer.state[expected]["exp_avg"].abs()
        kept = (gradient > NOISE) | (gradient == 0)      # unused embedding rows: no gradient, the same decay
        noisy += int((~kept).sum())
        torch.testing.assert_close(got[kept], expected[kept], **PARAM_TOL, msg=name)
        moved = max(moved, float((expected - initial).detach().abs().max()))
    assert moved > 100 * PARAM_TOL["atol"]     # the steps moved the weights well beyond the tolerance
    assert noisy <= 1e-3 * sum(p.numel() for p in whole.model.parameters())   # the key biases, hardly more
    # The gradients themselves (AdamW's step hardly sees their scale; its first moment holds them, and
    # nothing is clipped): k micro-batches' mean, not their sum.
    for (name, p), q in zip(whole.model.named_parameters(), split.model.parameters()):
        torch.testing.assert_close(split.optimizer.state[q]["exp_avg"], whole.optimizer.state[p]["exp_avg"],
                                   **GRAD_TOL, msg=name)
    for replica in split.dp.replicas:     # every replica took the same step
        for p, q in zip(replica.model.parameters(), split.model.parameters()):
            torch.testing.assert_close(p, q, **PARAM_TOL)
    # What is counted, not computed, is exact: tokens, examples, steps.
    assert split_state.tokens == whole_state.tokens
    assert (split_window.examples, split_window.steps) == (whole_window.examples, whole_window.steps)
    # every micro-batch's loss enters the window: its mean is the batch's (equal rows, loss-free)
    torch.testing.assert_close(split_window.loss, whole_window.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("changes,message", [
    (dict(microbatches=0), "microbatches=0 must be >= 1"),
    (dict(microbatches=3), "batch_size=8 must be a multiple of dp_size=1 x microbatches=3"),
    (dict(dp_size=2, microbatches=8), "batch_size=8 must be a multiple of dp_size=2 x microbatches=8"),
])
def test_microbatches_that_do_not_divide_the_batch_are_refused(changes, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        tiny_run(tmp_path, **changes)
