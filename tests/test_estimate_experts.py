"""lossysim estimate of mixtures of experts: the dispatch and combine all-to-alls per MoE block in closed form
at zero loss (their sizes the routing assumed, their time NCCL's grouped sends), lost at the configured rate,
the routing's skew as a stated knob that slows the step, and one-line errors."""
import pytest
from scipy import stats

from lossysim.cli import main
from lossysim.ep import routing
from lossysim.estimate import Workload, estimate, job_config, load
from lossysim.net import NetworkSpec, exchange

pytestmark = pytest.mark.usefixtures("private_cache", "one_torch_thread")


def _call_seconds(spec: NetworkSpec, counts: tuple, itemsize: int) -> tuple[float, int]:
    """One all-to-all's loss-free seconds and packets (``exchange``'s schedule and time model)."""
    transfer = exchange.build(spec, counts, {2: __import__("torch").bfloat16}[itemsize], "cpu")
    return transfer.ideal, int(transfer.sent.sum())


def test_zero_loss_experts_are_their_all_to_alls_in_closed_form():
    """tiny-moe, dp 4 with ep 2 (two ep groups), 2 micro-batches: per micro-batch and MoE block a dispatch and
    a combine forward and their gradients backward, each of uniform routing's sizes (every rank's tokens x
    top-k rows spread evenly over the experts); the step is compute, those calls and the buckets."""
    shape = load("tiny-moe")
    config = job_config("tiny-moe", micro_batch=2, microbatches=2, tp_size=1, dp_size=4, ep_size=2,
                        ranks_per_node=2, link_inter="roce-400g")
    row = estimate(shape, config, Workload(seq=16), steps=2)
    tokens, k, hidden = 2 * 16, 2, 64
    per = routing.rows(tokens, k, 8, 2)
    assert per == [[tokens * k // 2] * 2] * 2
    counts = (0, per[0][1] * hidden, per[1][0] * hidden, 0)
    spec = config.mesh().network_spec("ep", 0, config.network_settings(), ("fwd", "bwd"), "ep_dispatch")
    seconds, sent = _call_seconds(spec, counts, 2)
    calls = 2 * len(shape.experts.blocks) * 2                 # micro-batches x blocks x (forward, backward)
    for cls in ("ep_dispatch", "ep_combine"):
        assert row[f"{cls}_packets_sent"] == calls * sent * 2     # both ep groups
        assert row[f"{cls}_loss_free_s"] == pytest.approx(calls * seconds, rel=1e-9)
        assert row[f"stack_{cls}_s"] == pytest.approx(calls * seconds, rel=1e-9)
    assert row["slowdown"] == pytest.approx(1.0) and row["routing_imbalance"] == 1.0
    assert row["ep_size"] == 2 and row["active_parameters"] < row["parameters"]


def test_dispatch_and_combine_lose_at_the_configured_rate():
    config = job_config("tiny-moe", micro_batch=4, tp_size=1, dp_size=2, ep_size=2, ranks_per_node=1,
                        loss="bernoulli:0.05", lossy_traffic="ep_dispatch,ep_combine_backward")
    row = estimate("tiny-moe", config, Workload(seq=64), steps=4)
    for cls in ("ep_dispatch", "ep_combine"):
        sent, lost = row[f"{cls}_packets_sent"] * 4, row[f"{cls}_packets_lost"] * 4
        assert sent > 300 and stats.binomtest(int(lost), int(sent) // 2, 0.05).pvalue > 1e-3, cls  # half: one way
        assert 0 < row[f"{cls}_elements_lost"] < 0.05
    assert row["dp_packets_lost"] == 0


def test_a_skewed_routing_is_a_knob_and_slows_the_step():
    """Zipf-skewed popularity: the shares sum to one, none above 1 / top-k (a token's experts are distinct),
    the busiest rank takes more, and its all-to-alls and experts lengthen the step."""
    shares = routing.expert_shares(128, 8, skew=1.2, seed=3)
    assert shares.sum() == pytest.approx(1.0) and shares.max() <= 1 / 8 + 1e-12
    assert routing.imbalance(8, 128, 8, skew=1.2, seed=3) > 1.5 and routing.imbalance(8, 128, 8) == 1.0
    assert sum(routing.rows(100, 8, 128, 8, skew=1.2, seed=3)[0]) == 800
    # Mixtral-8x7B's 8 experts over 8 ranks of a node, short sequences: the busiest rank's expert FLOPs show
    config = job_config("mixtral-8x7b", micro_batch=1, tp_size=1, dp_size=8, ep_size=8, ranks_per_node=8)
    uniform, skewed = (estimate("mixtral-8x7b", config, Workload(seq=64, routing_skew=z), steps=1) for z in (0.0, 1.0))
    assert skewed["routing_imbalance"] > 1.2 and skewed["routing_skew"] == 1.0
    assert skewed["ep_dispatch_loss_free_s"] > uniform["ep_dispatch_loss_free_s"]
    assert skewed["compute_s"] > uniform["compute_s"] and skewed["step_mean_s"] > uniform["step_mean_s"]


@pytest.mark.parametrize("args, message", [
    (["tiny", "--dp-size", "2", "--ep-size", "2"], "ep_size=2 needs a mixture-of-experts model, not tiny"),
    (["tiny-moe", "--dp-size", "2", "--ep-size", "3"], "ep_size=3 must divide dp_size x cp_size = 2"),
    (["tiny-moe", "--dp-size", "16", "--ep-size", "16"], "ep_size=16 does not divide the 8 experts of tiny-moe"),
    (["tiny-moe", "--dp-size", "2", "--ep-size", "2", "--routing-skew", "-1"], "routing_skew=-1.0 must be"),
])
def test_bad_expert_estimates_are_one_line_errors(args, message, capsys):
    code = main(["estimate", *args, "--tp-size", "1", "--seq", "8", "--steps", "1", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_the_command_estimates_an_expert_parallel_job(capsys):
    code = main(["estimate", "tiny-moe", "--tp-size", "1", "--dp-size", "2", "--ep-size", "2", "--seq", "16",
                 "--loss", "bernoulli:0.01", "--ranks-per-node", "1", "--steps", "2", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0 and "ep2" in err and "bernoulli:0.01" in out


def test_sampled_ep_groups_stand_for_every_group():
    """Beyond 64 GPUs two ep groups of one stage are simulated (one micro-batch each) and every other block's
    calls drawn from theirs: the packets sent count exactly what every group sends (16 of them, 2 steps of 2
    micro-batches of 2 blocks: 32 times the simulated ones), the simulated ones lose at the configured rate,
    and the loss-free step is every group's."""
    config = job_config("tiny-moe", micro_batch=2, microbatches=2, tp_size=1, dp_size=128, ep_size=8,
                        ranks_per_node=8, loss="bernoulli:0.05", lossy_traffic="ep_dispatch,ep_combine")
    sampled, full = (estimate("tiny-moe", config, Workload(seq=64, sampled_groups=k), steps=2) for k in (None, 0))
    assert sampled["sampled_groups"] == 2 and full["sampled_groups"] == 0
    for cls in ("ep_dispatch", "ep_combine"):
        assert sampled[f"{cls}_packets_sent"] == pytest.approx(full[f"{cls}_packets_sent"], rel=1e-12)
        simulated = [round(sampled[f"{cls}_packets_{name}"] * 2 / 32) for name in ("sent", "lost")]
        assert stats.binomtest(simulated[1], simulated[0] // 2, 0.05).pvalue > 1e-3, cls   # forward lossy only
    assert sampled["loss_free_step_s"] == pytest.approx(full["loss_free_step_s"], rel=1e-12)
    assert full["step_mean_s"] == full["loss_free_step_s"] == pytest.approx(sampled["step_mean_s"])   # drop: no repair


def test_deepseek_v3_with_tp_is_sharded_by_heads_and_all_reduces_twice_a_block():
    """DeepSeek-V3's plan at tp 2 (the tiny shape): MLA's q_b/kv_b column-parallel by heads and o_proj
    row-parallel, the first block's dense MLP and the others' shared expert a Llama MLP: two all-reduces a
    block each way, as a Llama block."""
    from lossysim.estimate.workload import step_calls
    shape = load("tiny-deepseek-v3")
    calls = step_calls(shape, checkpointing=False)
    assert len(calls) == 4 * shape.layers and {c.site.split(".", 2)[2] for c in calls} == \
        {"self_attn.reduce", "mlp.reduce", "self_attn.copy", "mlp.copy"}
    row = estimate(shape, job_config("tiny-deepseek-v3", micro_batch=2, tp_size=2, dp_size=2, ep_size=2,
                                     ranks_per_node=2), Workload(seq=16), steps=1)
    assert row["tp_packets_sent"] > 0 and row["ep_dispatch_packets_sent"] > 0
