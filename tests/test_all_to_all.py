"""All-to-all (``LossyNetwork.all_to_all``): every rank's messages to every other, each its own size, as
NCCL's grouped sends over the same links, chains, transports, statistics, saved state and clock as every
other call.

What a receiver holds is checked against the masks the loss model drew (read back by wrapping its
draws), the time against NCCL's p2p formula per port written out by hand.
"""
from __future__ import annotations

import pytest
import torch
from scipy import stats

from lossysim.net import LossyNetwork, exchange
from lossysim.timing import nccl
from test_p2p import ALPHA, elements, masks  # noqa: F401  (masks: the fixture reading the drawn masks)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
R, WIDTH = 4, 24


def routed(seed: int, ranks: int = R, most: int = 40) -> list[list[torch.Tensor]]:
    """``messages[src][dst]``: rows of WIDTH floats, a random number of rows per pair (some empty)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(int(torch.randint(0, most, (1,), generator=g)), WIDTH, generator=g) + 3.0
             for _ in range(ranks)] for _ in range(ranks)]


def test_loss_free_is_a_plain_all_to_all_timed_per_port():
    net = LossyNetwork(R, "none", ranks_per_node=2)
    messages = routed(0)
    held = net.all_to_all("ep", "fwd", messages)
    assert all(held[d][s] is messages[s][d] for d in range(R) for s in range(R))
    # The slowest port: every rank's sends (and receives) of one link class share its port, the port's
    # sends run at once: their largest latency plus all their wire bytes at the protocol's bandwidth.
    spec = net.spec
    busy = {}
    for s in range(R):
        for d in range(R):
            n = messages[s][d].numel() * 4
            if s == d or not n:
                continue
            cls = spec.topology.link_class(s, d)
            link = spec.link(cls)
            packets = -(-n // (spec.payload_bytes // 4 * 4))
            protocol = "LL" if n <= nccl.P2P_LL_THRESHOLD else "Simple"
            latency = (nccl.BASE_LATENCY_US["ring"][nccl.PROTOCOLS.index(protocol)]
                       + nccl.HW_LATENCY_US[link.hw]["ring"][nccl.PROTOCOLS.index(protocol)]) * 1e-6 \
                + link.latency_s   # the link's own one-way latency: the message crosses the wire once
            seconds = link.wire_bytes(n, packets) / (link.bandwidth_Bps * nccl.P2P_EFFICIENCY[protocol])
            for port in ((s, "out", cls), (d, "in", cls)):
                lat, sec = busy.get(port, (0.0, 0.0))
                busy[port] = (max(lat, latency), sec + seconds)
    assert net.clock()["comm_s"] == pytest.approx(max(a + b for a, b in busy.values()), rel=1e-12)
    # more rows to one rank make the call longer: the slowest rank sets its end
    skewed = [[torch.cat([m] * 4) if d == 0 else m for d, m in enumerate(row)] for row in messages]
    other = LossyNetwork(R, "none", ranks_per_node=2)
    other.all_to_all("ep", "fwd", skewed)
    assert other.clock()["comm_s"] > net.clock()["comm_s"]


def test_holes_are_the_drawn_masks_and_drop_token_loses_whole_rows(masks):
    for recovery in ("zero", "drop_token"):
        net = LossyNetwork(R, "bernoulli:0.2", seed=3, recovery=recovery)
        seen = masks(net)
        messages = routed(1)
        held = net.all_to_all("ep", "fwd", messages)
        (drawn,) = seen
        sched = exchange.Exchange(R, [-(-messages[s][d].numel() // 362) if s != d else 0
                                      for s in range(R) for d in range(R)])
        for d in range(R):
            for s in range(R):
                sent = messages[s][d]
                if s == d or not sent.numel():
                    assert held[d][s] is sent
                    continue
                row = sched.links.index((s, d))
                lost = elements(drawn[row], 362, sent.numel()).view(sent.shape)
                if recovery == "drop_token":
                    lost = lost.any(-1, keepdim=True).expand_as(lost)
                torch.testing.assert_close(held[d][s], torch.where(lost, 0.0, sent), rtol=0, atol=0)
        assert sum(int(m.sum()) for m in seen) > 0


def test_packets_are_lost_at_the_configured_rate_on_lossy_links_only():
    p = 0.05
    net = LossyNetwork(R, f"bernoulli:{p}", seed=5, ranks_per_node=2, lossy_links="inter_node")
    for call in range(30):
        net.all_to_all(f"layers.{call % 3}.ep_dispatch", "fwd", routed(100 + call, most=120))
    totals = {row["link_class"]: row for row in net.summary(by=("link_class",))}
    assert totals["intra"]["lost"] == 0 and totals["intra"]["sent"] > 0
    inter = totals["inter"]
    assert inter["sent"] > 1000
    assert stats.binomtest(inter["lost"], inter["sent"], p).pvalue > ALPHA


def test_same_seed_same_masks_and_saved_state_resumes_exactly():
    def run(net, first, calls):
        return [net.all_to_all(f"l{c % 2}.ep_combine", "bwd", routed(first + c)) for c in range(calls)]

    spec = dict(loss_model="ge:rate=0.1,burst=3", seed=11, ranks_per_node=2)   # a chain carried on
    a, b = LossyNetwork(R, **spec), LossyNetwork(R, **spec)
    assert _same(run(a, 0, 3), run(b, 0, 3))
    other = LossyNetwork(R, **{**spec, "seed": 12})
    assert not _same(run(LossyNetwork(R, **spec), 0, 3), run(other, 0, 3))
    saved = a.state_dict()
    after = run(a, 3, 3)
    resumed = LossyNetwork(R, **spec)
    resumed.load_state_dict(saved)
    assert _same(after, run(resumed, 3, 3))
    assert resumed.stats() == a.stats() and resumed.clock() == a.clock()


def test_retransmission_delivers_exactly_and_charges_time_deadline_gives_up():
    messages = routed(7, most=200)
    exact = LossyNetwork(R, "bernoulli:0.1", seed=2, transport="retransmit", ranks_per_node=2)
    held = exact.all_to_all("ep", "fwd", messages)
    assert all(torch.equal(held[d][s], messages[s][d]) for d in range(R) for s in range(R))
    clock, totals = exact.clock(), exact.totals()
    assert totals["resent"] >= totals["lost"] > 0 and clock["comm_s"] > clock["ideal_comm_s"]
    bounded = LossyNetwork(R, "bernoulli:0.1", seed=2, transport="deadline", deadline=1.2, rto_s=1.0,
                           ranks_per_node=2)
    bounded.all_to_all("ep", "fwd", messages)
    clock = bounded.clock()
    assert clock["comm_s"] <= 1.2 * clock["ideal_comm_s"] * (1 + 1e-9) and bounded.totals()["missing"] > 0


def test_a_receiver_needs_only_its_own_messages():
    """dist: a process holds the messages to itself; the others' sizes (meta tensors) move the streams."""
    messages = routed(9)
    full = LossyNetwork(R, "bernoulli:0.2", seed=4).all_to_all("ep", "fwd", messages)
    for d in range(R):
        mine = [[m if dst == d else torch.empty(m.shape, device="meta") for dst, m in enumerate(row)]
                for row in messages]
        (held,) = LossyNetwork(R, "bernoulli:0.2", seed=4).all_to_all("ep", "fwd", mine, receivers=[d])
        assert all(torch.equal(held[s], full[d][s]) for s in range(R))


def test_refuses_a_policy_that_does_not_act_on_it():
    with pytest.raises(ValueError, match="recovery=rescale does not act on all-to-alls: use one of zero, drop_token"):
        LossyNetwork(2, "bernoulli:0.1", recovery="rescale").all_to_all("ep", "fwd", routed(0, ranks=2))


def test_drop_token_acts_on_all_to_alls_alone_and_needs_one():
    """The one rule (``recovery.require``): drop_token is zero on every other collective, so a run without an
    all-to-all is refused it; a run with one may carry its sends and reduce-scatters too."""
    from lossysim.net.recovery import require
    for collective in ("send", "reduce_scatter", "all_to_all"):
        require("drop_token", collective)
    for collective in ("send", "reduce_scatter"):
        require("drop_token", collective, used=False)
    with pytest.raises(ValueError, match="recovery=drop_token acts on all-to-alls only"):
        require("drop_token", "all_to_all", used=False)
    require("zero", "all_to_all", used=False)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for call_a, call_b in zip(a, b, strict=True)
               for row_a, row_b in zip(call_a, call_b, strict=True) for x, y in zip(row_a, row_b, strict=True))
