"""Transports and simulated time: loss-free times equal the alpha-beta formulas, retransmissions
cost what their formulas say, deadlines hold, and retransmitted training is loss-free training."""
from __future__ import annotations


import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

from _tp_common import build, lossy_network, lossy_run, make_batch, parallelize
from lossysim import timing
from lossysim.timing import nccl as nccl_model
from lossysim.net.network import LossyNetwork

ALPHA = 1e-5
pytestmark = pytest.mark.usefixtures("one_torch_thread")

LINK = "alpha=3us,bw=100Gbps,header=82"


def fresh_clock(net: LossyNetwork, x: torch.Tensor, collective: str = "all_reduce") -> dict:
    net.reset_stats()
    getattr(net, collective)("s", "fwd", x, range(net.ranks))
    return net.clock()


@pytest.mark.parametrize("tp", range(1, 9))
def test_loss_free_times_do_not_depend_on_loss_under_drop(tp):
    link = timing.parse_link(LINK)
    payload = 1448  # 362 fp32 elements
    elements = 362 * 6 * tp * 5  # whole packets in every ring chunk
    x = torch.zeros(tp, elements)
    M = elements * 4
    nccl = lambda algorithm: nccl_model.collective_time(  # noqa: E731
        "all_reduce", algorithm, tp, 1, M, payload, link, link, link.bandwidth_Bps)
    expected = {"ring": nccl("ring"), "tree": nccl("tree"),
                "direct": timing.direct_all_reduce_time(tp, M, link, payload)}
    for algorithm, formula in expected.items():
        net = LossyNetwork(tp, "bernoulli:0.3", payload_bytes=payload, algorithm=algorithm, link_intra=LINK)
        clock = fresh_clock(net, x)
        assert clock["ideal_comm_s"] == pytest.approx(formula, rel=1e-12, abs=1e-15), algorithm
        assert clock["comm_s"] == pytest.approx(formula, rel=1e-12, abs=1e-15)  # drop: loss costs no time


def transmissions_per_packet(net: LossyNetwork, calls: int, elements: int) -> np.ndarray:
    ratios = []
    for _ in range(calls):
        net.reset_stats()
        net.all_reduce("s", "fwd", torch.zeros(net.ranks, elements), range(net.ranks))
        df = pd.DataFrame(net.stats())
        ratios.append(df.sent.sum() / (df.sent.sum() - df.resent.sum()))
    return np.array(ratios)


def test_selective_repeat_sends_one_over_one_minus_p():
    p = 0.2
    net = LossyNetwork(2, f"bernoulli:{p}", payload_bytes=16, transport="retransmit")
    ratios = transmissions_per_packet(net, 40, 4 * 500)
    assert stats.ttest_1samp(ratios, timing.selective_repeat_transmissions(p)).pvalue > ALPHA
    assert stats.ttest_1samp(ratios, timing.selective_repeat_transmissions(0.8 * p)).pvalue < ALPHA
    df = pd.DataFrame(net.stats())
    assert df.missing.sum() == 0 and (df.resent == df.lost).all()  # every lost transmission is resent


def test_go_back_n_costs_its_formula():
    """Each loss also wastes the window of packets in flight: (1 + p W) / (1 - p) per packet."""
    p, link = 0.02, "alpha=1us,bw=20Gbps,header=0"
    net = LossyNetwork(2, f"bernoulli:{p}", payload_bytes=1448, transport="retransmit", retransmit="go_back_n",
                       link_intra=link)
    window = timing.window_packets(timing.parse_link(link), 1448)
    assert window > 1
    ratios = transmissions_per_packet(net, 30, 362 * 4000)
    expected = timing.go_back_n_transmissions(p, window)
    assert expected > timing.selective_repeat_transmissions(p)
    # a loss near a message's end wastes fewer than W packets: the mean sits just below the formula
    assert abs(ratios.mean() / expected - 1) < 0.01
    assert stats.ttest_1samp(ratios, timing.selective_repeat_transmissions(p)).pvalue < ALPHA


def reference_selective_repeat(p_gb, p_bg, packets, calls, seed):
    """Selective repeat on one simple-Gilbert link, one packet at a time (numpy), for comparison."""
    rng = np.random.default_rng(seed)
    bad = rng.random() < p_gb / (p_gb + p_bg)
    totals = []
    for _ in range(calls):
        pending, sent = packets, 0
        while pending:
            lost = 0
            for _ in range(pending):
                lost += bad
                bad = rng.random() < (1 - p_bg if bad else p_gb)
            sent += pending
            pending = lost
        totals.append(sent)
    return np.array(totals)


def test_gilbert_elliott_retransmissions_cluster_as_the_chain_says():
    """Bursty loss: resends meet the same bursts; the network's count follows an independent reference."""
    spec = "ge:rate=0.1,burst=6"
    net = LossyNetwork(2, spec, payload_bytes=16, transport="retransmit")
    model = net.loss_model
    sent = []
    for _ in range(150):
        net.reset_stats()
        net.all_reduce("s", "fwd", torch.zeros(2, 4 * 40), range(2))  # one 20-packet chunk per send
        sent.append(sum(r["sent"] for r in net.stats() if r["src"] == 0 and r["phase"] == "reduce_scatter"))
    reference = reference_selective_repeat(model.p_gb, model.p_bg, 20, 3000, seed=0)
    assert stats.ttest_ind(sent, reference, equal_var=False).pvalue > 1e-4
    bernoulli = 20 / (1 - model.loss_rate)
    assert np.var(sent) > 2 * 20 * model.loss_rate / (1 - model.loss_rate) ** 2  # burstier than Bernoulli
    assert abs(np.mean(sent) - bernoulli) < 3  # same mean cost per packet


def test_deadline_holds_its_budget_and_delivers_more_than_drop():
    p, tp = 0.1, 4
    dropped = LossyNetwork(tp, f"bernoulli:{p}", payload_bytes=16, seed=1)
    net = LossyNetwork(tp, f"bernoulli:{p}", payload_bytes=16, seed=1, transport="deadline",
                       deadline=1.5, link_intra="alpha=0.1us,bw=10Gbps,header=0", rto_s=1e-6)
    x = torch.randn(tp, 4 * 300)
    missing = []
    for _ in range(20):
        clock = fresh_clock(net, x)
        assert clock["comm_s"] <= 1.5 * clock["ideal_comm_s"] * (1 + 1e-12)
        df = pd.DataFrame(net.stats())
        missing.append(df.missing.sum() / (df.sent.sum() - df.resent.sum()))
    assert np.mean(missing) < p / 2  # repairs within the budget deliver most of what drop loses
    out_deadline = net.all_reduce("s", "fwd", x, range(tp))
    out_drop = dropped.all_reduce("s", "fwd", x, range(tp))
    exact = x.sum(0)
    err = lambda out: (out - exact).abs().sum().item()  # noqa: E731
    assert err(out_deadline) < err(out_drop)


def test_retransmit_trains_exactly_as_loss_free():
    """Only time differs: logits, losses and every gradient are bitwise the loss-free run's."""
    clean = lossy_run(parallelize(build("cls"), 2, lossy_network("none", 2)), make_batch("cls"))
    network = lossy_network("ge:rate=0.2,burst=3", 2, transport="retransmit")
    repaired = lossy_run(parallelize(build("cls"), 2, network), make_batch("cls"))
    for a, b in zip(clean, repaired):
        assert torch.equal(a["logits"], b["logits"]) and torch.equal(a["losses"], b["losses"])
        assert all(torch.equal(a["grads"][k], b["grads"][k]) for k in a["grads"])
    clock = network.clock()
    assert sum(r["lost"] for r in network.stats()) > 0 and clock["comm_s"] > clock["ideal_comm_s"] > 0


def test_bad_transport_settings_are_one_line_errors():
    for kwargs, field in [(dict(transport="tcp"), "transport"), (dict(retransmit="sack"), "retransmit"),
                          (dict(deadline=0.5), "deadline"), (dict(algorithm="butterfly"), "algorithm"),
                          (dict(ranks_per_node=3), "ranks_per_node"), (dict(lossy_links="some"), "lossy_links"),
                          (dict(transport="deadline", recovery="rescale"), "rescale"),
                          (dict(transport="deadline", retransmit="go_back_n"), "go_back_n"),
                          (dict(link_inter="roce-300g"), "roce-300g")]:
        with pytest.raises(ValueError, match=field) as err:
            LossyNetwork(4, "bernoulli:0.1", **kwargs)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="never finishes"):
        LossyNetwork(2, "bernoulli:1", transport="retransmit")


@pytest.mark.parametrize("spec", ["bernoulli:0.3", "ge:rate=0.3,burst=4", "ge:p_gb=0.1,p_bg=0.3,loss_bad=0.7,loss_good=0.02"])
def test_rewinding_a_draw_equals_drawing_fewer_packets(spec):
    """What go-back-N relies on: state_after(draw, used) is the state a draw of `used` packets leaves."""
    from lossysim.loss import parse_loss_model
    model = parse_loss_model(spec)
    used = torch.tensor([0, 1, 40, 99, 100])
    state = model.sample_with_states((5, 0), torch.Generator().manual_seed(1))[2]
    full = model.sample_with_states((5, 100), torch.Generator().manual_seed(2), state)
    known = model.sample_with_states((5, 100), torch.Generator().manual_seed(2), state, used=used)
    assert torch.equal(full[0], known[0])
    rewound = model.state_after(full[1], full[2], used)
    assert (rewound is None and known[2] is None) or torch.equal(rewound, known[2])


def test_go_back_n_refuses_a_model_it_cannot_rewind():
    with pytest.raises(ValueError, match="go_back_n"):
        LossyNetwork(2, "netem:loss state 1% 30% 2% 80% 0.5%", transport="retransmit", retransmit="go_back_n")
