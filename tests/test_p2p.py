"""Point-to-point sends (``LossyNetwork.send``): one message from one rank to another over their link,
as pipeline stages send activations and their gradients.

What a receiver holds is checked against the masks the loss model drew (read back by wrapping its
draws, the network's only source of randomness) and the Hadamard signs the policy drew, worked out
by hand; time against NCCL's p2p formula written out in numbers.
"""
from __future__ import annotations

import io
import math
import re
from collections import defaultdict, deque

import pytest
import scipy.linalg
import torch
from scipy import stats

from lossysim.net import LossyNetwork, recovery
from lossysim.timing import nccl
from lossysim.timing.links import LINK_PRESETS, parse_link

ALPHA = 1e-5  # p-value threshold of the statistical checks
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def masks(monkeypatch):
    """``masks(net)`` -> list receiving every [links, packets] mask the network's loss model draws, in
    order (as positions or as a mask: the same fates either way)."""
    def attach(net):
        seen = []
        model = net.loss_model
        sample, positions = model.sample_with_states, getattr(model, "lost_positions", None)

        def sampled(n, generator, state=None, used=None):
            lost, in_bad, after = sample(n, generator, state, used=used)
            if lost.shape[-1]:   # not the zero-length draw that starts every chain
                seen.append(lost.clone())
            return lost, in_bad, after

        def positioned(rows, width, generator, state=None, used=None):
            flat, after = positions(rows, width, generator, state, used)
            if width:
                lost = torch.zeros(rows * width, dtype=torch.bool)
                lost[torch.from_numpy(flat)] = True
                seen.append(lost.view(rows, width))
            return flat, after

        monkeypatch.setattr(model, "sample_with_states", sampled)
        if positions is not None:
            monkeypatch.setattr(model, "lost_positions", positioned)
        return seen
    return attach


def elements(lost_packets: torch.Tensor, per: int, numel: int) -> torch.Tensor:
    """Each packet's fate over its elements (the last packet may be short)."""
    return lost_packets.repeat_interleave(per)[:numel]


def counting(n: int, offset: float = 1.0) -> torch.Tensor:
    """offset, offset + 1, ...: every element nonzero and different, exact in float64."""
    return torch.arange(n, dtype=torch.float64) + offset


# -- time ---------------------------------------------------------------------------------------------
def test_p2p_time_is_one_ring_step_of_nccl_on_the_link_written_out():
    """LL up to 16 KiB (NCCL_P2P_LL_THRESHOLD), Simple above; base + one hop's latency of the link's
    hardware and the link's own one-way latency, then the wire bytes (payload and a header per packet) at
    the protocol's share of the link's bandwidth."""
    roce, nvlink = LINK_PRESETS["roce-200g"], LINK_PRESETS["nvlink4"]
    # 1 MiB across nodes, Simple: 8.4 us base + 14 us network hop + 5 us alpha; 724 packets of 82 header bytes
    assert nccl.p2p_time(1 << 20, 1450, roce) == pytest.approx(27.4e-6 + ((1 << 20) + 724 * 82) / 25e9, rel=1e-12)
    # 16 KiB inside a node, LL: 6.6 + 0.6 us + 1 us alpha, half the bandwidth; NVLink adds no headers
    assert nccl.p2p_time(16384, 1450, nvlink) == pytest.approx(8.2e-6 + 16384 / (370e9 / 2), rel=1e-12)
    assert nccl.p2p_estimate(16384, 16384, nvlink).protocol == "LL"
    assert nccl.p2p_estimate(16385, 16385, nvlink).protocol == "Simple"
    assert nccl.p2p_time(0, 1450, roce) == 0.0


def test_a_sends_loss_free_time_counts_the_links_latency():
    """An explicit link, alpha = 50 ms, 10 Gb/s, no headers: a 64 MiB send crosses the wire once, 50 ms, and
    its 67,108,864 bytes take 53.687 ms: 103.7 ms with NCCL's 22.4 us (it was charged 53.7 ms, alpha left
    out, while its repairs' round trips were 2 alpha). The network charges exactly that."""
    link = "alpha=50ms,bw=10Gbps"
    want = 50e-3 + 22.4e-6 + (64 << 20) * 8 / 10e9
    assert want == pytest.approx(0.1037, abs=1e-4)
    assert nccl.p2p_time(64 << 20, 1450, parse_link(link)) == pytest.approx(want, rel=1e-12)
    net = LossyNetwork(2, "none", ranks_per_node=1, link_inter=link)
    net.simulate("s", "fwd", 16 << 20, torch.float32, "send", pair=(0, 1))
    assert net.clock()["comm_s"] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("numel,dtype", [(1, torch.float32), (4096, torch.float32), (300_001, torch.bfloat16)])
def test_a_loss_free_send_arrives_exact_and_takes_the_p2p_time(numel, dtype):
    """The message itself arrives; the clock moves by p2p_time of the link between the two ranks:
    inter-node between nodes, intra-node inside one (and never the other pair's)."""
    net = LossyNetwork(4, "none", ranks_per_node=2, payload_bytes=1024)
    x = torch.randn(numel).to(dtype)
    nbytes = numel * dtype.itemsize
    for src, dst, link in ((0, 2, net.spec.link_inter), (3, 2, net.spec.link_intra), (2, 1, net.spec.link_inter)):
        before = net.clock()["comm_s"]
        assert net.send("s", "fwd", x, src, dst) is x
        took = net.clock()["comm_s"] - before
        assert took == pytest.approx(nccl.p2p_time(nbytes, 1024, link), rel=1e-12)
    assert net.clock()["ideal_comm_s"] == net.clock()["comm_s"]
    rows = net.stats()
    assert {(r["src"], r["dst"], r["phase"], r["link_class"]) for r in rows} == {
        (0, 2, "send", "inter"), (3, 2, "send", "intra"), (2, 1, "send", "inter")}
    assert all(r["sent"] == -(-nbytes // 1024) and r["lost"] == 0 for r in rows)


def test_any_shape_arrives_in_its_shape_and_dtype():
    net = LossyNetwork(2, "bernoulli:0.3", seed=1, payload_bytes=16)
    for x in (torch.randn(3, 5, 7), torch.randn(11).half(), torch.randn(2, 9).t()):   # the last not contiguous
        held = net.send("s", "fwd", x, 1, 0)
        assert held.shape == x.shape and held.dtype == x.dtype
        assert ((held == x) | (held == 0)).all()


# -- loss ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_zero_holes_are_exactly_the_lost_packets(masks, dtype):
    """Element by element: a lost packet's elements are 0, every other element is the message's; the
    counters say as many packets lost as the drawn masks."""
    payload = 40
    net = LossyNetwork(4, "bernoulli:0.25", seed=3, payload_bytes=payload, ranks_per_node=2)
    drawn = masks(net)
    per = payload // dtype.itemsize
    n = per * 17 + 3                                   # a short last packet
    lost_total = 0
    for call in range(5):
        x = (counting(n) + call).to(dtype)
        src, dst = (0, 2) if call % 2 else (3, 1)
        held = net.send("s", "fwd", x, src, dst)
        lost = drawn[-1][0, :-(-n // per)]
        hole = elements(lost, per, n)
        assert torch.equal(held, torch.where(hole, torch.zeros_like(x), x))
        lost_total += int(lost.sum())
    assert lost_total > 0
    assert net.totals()["lost"] == lost_total


def test_observed_loss_rate_of_sends_matches_the_configured_rate():
    """Binomial test on every link that carries sends; links inside a node lose nothing with
    lossy_links=inter_node, and the summary says so (configured 0)."""
    p = 0.05
    net = LossyNetwork(4, f"bernoulli:{p}", seed=7, payload_bytes=64, ranks_per_node=2, lossy_links="inter_node")
    x = torch.randn(64 * 25)
    for _ in range(60):
        for src, dst in ((0, 2), (1, 3), (2, 0), (0, 1)):
            net.send("act", "fwd", x, src, dst)
    rows = {(r["src"], r["dst"]): r for r in net.summary(by=("src", "dst"))}
    for pair in ((0, 2), (1, 3), (2, 0)):
        row = rows[pair]
        assert row["configured_loss_rate"] == p
        assert stats.binomtest(row["lost"], row["sent"], p).pvalue > ALPHA
    assert rows[(0, 1)]["lost"] == 0 and rows[(0, 1)]["configured_loss_rate"] == 0.0


def test_the_same_seed_draws_the_same_masks_and_a_site_its_own():
    def run(seed, sites=("a",)):
        net = LossyNetwork(2, "ge:rate=0.2,burst=2", seed=seed, payload_bytes=32)
        out = [net.send(site, "bwd", counting(500), 0, 1) for _ in range(3) for site in sites]
        return out, net.stats()
    first, again, other = run(1), run(1), run(2)
    assert all(torch.equal(a, b) for a, b in zip(first[0], again[0])) and first[1] == again[1]
    assert any(not torch.equal(a, b) for a, b in zip(first[0], other[0]))
    # another site's sends in between leave this site's masks as they were
    mixed = run(1, sites=("a", "b"))
    assert all(torch.equal(a, b) for a, b in zip(first[0], mixed[0][0::2]))


@pytest.mark.parametrize("nic", ["irn", "roce-gbn"])
def test_retransmitted_sends_arrive_exact_and_take_longer(nic):
    """Every packet is repaired: the message arrives; the clock charges p2p_time per call plus the
    repairs, and the counters say as many resends as losses (selective repeat)."""
    net = LossyNetwork(2, "bernoulli:0.05", seed=2, payload_bytes=256, ranks_per_node=1, transport="retransmit",
                       nic=nic)
    x = torch.randn(256 * 40)
    calls = 20
    for _ in range(calls):
        assert torch.equal(net.send("s", "bwd", x, 0, 1), x)
    clock, totals = net.clock(), net.totals()
    ideal = nccl.p2p_time(x.numel() * 4, 256, net.spec.link_inter)
    assert clock["ideal_comm_s"] == pytest.approx(calls * ideal, rel=1e-12)
    assert totals["lost"] > 0 and clock["retransmit_s"] > 0
    assert clock["comm_s"] == pytest.approx(clock["ideal_comm_s"] + clock["retransmit_s"], rel=1e-12)
    if nic == "irn":
        assert totals["resent"] == totals["lost"]
    assert totals["missing"] == 0


def test_the_seconds_of_one_call_are_the_clocks_difference():
    """Deadline: each call's difference is its loss-free time plus its own repairs, at most the budget."""
    net = LossyNetwork(2, "bernoulli:0.1", seed=4, payload_bytes=128, ranks_per_node=1, transport="deadline",
                       deadline=2.0)
    x = torch.randn(32 * 100)
    ideal = nccl.p2p_time(x.numel() * 4, 128, net.spec.link_inter)
    took = []
    for _ in range(10):
        before = net.clock()["comm_s"]
        net.send("s", "fwd", x, 0, 1)
        took.append(net.clock()["comm_s"] - before)
    assert all(ideal * (1 - 1e-12) <= t <= 2.0 * ideal * (1 + 1e-12) for t in took)
    assert any(t > ideal * (1 + 1e-9) for t in took)
    assert sum(took) == pytest.approx(net.clock()["comm_s"], rel=1e-12)


# -- recovery policies -----------------------------------------------------------------------------------
def test_rescale_divides_what_arrives_by_its_probability():
    """Delivered packets carry x / (1 - p), lost ones 0; a link that cannot lose carries x as it is."""
    p, per = 0.3, 8
    net = LossyNetwork(4, f"bernoulli:{p}", seed=5, payload_bytes=per * 8, recovery="rescale", ranks_per_node=2,
                       lossy_links="inter_node")
    zero = LossyNetwork(4, f"bernoulli:{p}", seed=5, payload_bytes=per * 8, ranks_per_node=2,
                        lossy_links="inter_node")
    x = counting(per * 20)
    for _ in range(3):
        held, holes = net.send("s", "fwd", x, 1, 3), zero.send("s", "fwd", x, 1, 3) == 0
        assert holes.any() and not holes.all()
        torch.testing.assert_close(held, torch.where(holes, 0.0, x / (1 - p)), rtol=1e-15, atol=0)
    assert torch.equal(net.send("s", "fwd", x, 0, 1), x)


@pytest.mark.parametrize("inner", ["hadamard", "hadamard+rescale"])
def test_hadamard_on_a_send_by_hand(masks, monkeypatch, inner):
    """Block 4, two float64 elements to a packet: the receiver holds D H (kept * w * H D x), H the
    4 x 4 Sylvester matrix / 2, D the call's signs, kept the drawn packets, w 1 or 1 / (1 - p)."""
    bits = []
    draw_signs = recovery.Memory.signs
    monkeypatch.setattr(recovery.Memory, "signs", lambda self, n: bits.append(draw_signs(self, n)) or bits[-1])
    p = 0.4
    net = LossyNetwork(2, f"bernoulli:{p}", seed=8, payload_bytes=16, recovery=inner, hadamard_block=4)
    drawn = masks(net)
    h = torch.tensor(scipy.linalg.hadamard(4), dtype=torch.float64) / 2
    hit = 0
    for call in range(6):
        x = counting(12, offset=call)
        held = net.send("s", "bwd", x, 0, 1)
        d = 1 - 2 * bits[-1].to(torch.float64)
        coefficients = ((x * d).view(3, 4) @ h.T).flatten()         # H D x, block by block
        kept = ~elements(drawn[-1][0], 2, 12)
        scale = 1 / (1 - p) if inner.endswith("rescale") else 1.0
        expected = ((coefficients * kept * scale).view(3, 4) @ h.T).flatten() * d
        torch.testing.assert_close(held, expected, rtol=1e-12, atol=1e-12)
        hit += int((~kept).any())
    assert hit > 2
    assert net.clock()["recovery_s"] > 0


def test_stale_keeps_what_last_arrived_on_each_link():
    """Call c sends c everywhere (offset 100 on the second link): a receiver holds c where its packet
    arrived, else what last arrived at that place on the same link (a zero twin's holes say which
    packets were lost), 0 before anything did; the other link's values never leak in."""
    spec = dict(seed=9, payload_bytes=32, ranks_per_node=2)
    net = LossyNetwork(4, "bernoulli:0.5", recovery="stale", **spec)
    zero = LossyNetwork(4, "bernoulli:0.5", **spec)
    n = 4 * 12 + 1
    last = {(0, 2): torch.zeros(n, dtype=torch.float64), (1, 3): torch.zeros(n, dtype=torch.float64)}
    filled = 0
    for c in range(1, 9):
        for (src, dst), offset in (((0, 2), 0.0), ((1, 3), 100.0)):
            x = torch.full((n,), c + offset, dtype=torch.float64)
            held = net.send("s", "fwd", x, src, dst)
            arrived = zero.send("s", "fwd", x, src, dst) != 0
            expected = torch.where(arrived, x, last[(src, dst)])
            assert torch.equal(held, expected)
            filled += int(((~arrived) & (expected != 0)).sum())
            last[(src, dst)] = expected
    assert filled > 20


def test_error_feedback_sends_what_was_lost_with_the_next_message():
    """Gradients: the receiver holds (x + owed) where its packet arrived and 0 where not, and what was
    lost is owed to the next call; so delivered + still owed = everything sent, exactly (integers).
    On activations it is zero's."""
    spec = dict(seed=10, payload_bytes=32, ranks_per_node=1)
    net = LossyNetwork(2, "bernoulli:0.3", recovery="error_feedback", **spec)
    zero = LossyNetwork(2, "bernoulli:0.3", **spec)
    n = 4 * 15
    owed = torch.zeros(n, dtype=torch.float64)
    delivered = torch.zeros(n, dtype=torch.float64)
    for c in range(10):
        x = counting(n, offset=c)
        held = net.send("g", "bwd", x, 1, 0)
        arrived = zero.send("g", "bwd", x, 1, 0) != 0
        carried = x + owed
        assert torch.equal(held, torch.where(arrived, carried, 0.0))
        owed = torch.where(arrived, 0.0, carried)
        delivered += held
    assert owed.any()
    assert torch.equal(delivered + owed, sum(counting(n, offset=c) for c in range(10)))
    x = counting(n)
    assert torch.equal(net.send("a", "fwd", x, 1, 0), zero.send("a", "fwd", x, 1, 0))


@pytest.mark.parametrize("policy", recovery.RECOVERY_POLICIES)
def test_policies_that_cannot_act_on_a_send_are_refused(policy):
    """outliers' side path is an all-gather beside an all-reduce: refused by name, the others listed."""
    net = LossyNetwork(2, "bernoulli:0.1", recovery=policy)
    assert (policy in recovery.SEND_POLICIES) == net.recovery.acts_on_sends
    if net.recovery.acts_on_sends:
        assert net.send("s", "bwd", torch.ones(10), 0, 1).shape == (10,)
    else:
        message = (f"recovery={policy} does not act on point-to-point sends: use one of "
                   f"{', '.join(recovery.SEND_POLICIES)}")
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            net.send("s", "bwd", torch.ones(10), 0, 1)
    assert {"outliers", "outliers+hadamard"} == set(recovery.RECOVERY_POLICIES) - set(recovery.SEND_POLICIES)


@pytest.mark.parametrize("src,dst", [(0, 0), (0, 2), (-1, 1)])
def test_a_send_needs_two_distinct_ranks_of_the_network(src, dst):
    with pytest.raises(ValueError, match="need two distinct ranks of 0..1"):
        LossyNetwork(2, "bernoulli:0.1").send("s", "fwd", torch.ones(3), src, dst)


# -- the watch, replays, saved state --------------------------------------------------------------------
def test_a_non_finite_message_is_seen_at_its_site():
    net = LossyNetwork(2, "none")
    net.send("fine", "fwd", torch.ones(4), 0, 1)
    net.send("bad", "bwd", torch.tensor([1.0, math.inf]), 1, 0)
    net.send("fine", "fwd", torch.tensor([math.nan]), 0, 1)
    assert net.channels.first_nonfinite() == {"site": "bad", "direction": "bwd"}


@pytest.mark.parametrize("policy", ["zero", "hadamard", "stale", "error_feedback"])
def test_a_replayed_send_repeats_itself_and_draws_nothing(policy):
    """A recomputed forward replays its sends: the same output, no draws, no counts, the policy's
    memory left as the call left it; the clock charges the replay again."""
    spec = dict(seed=12, payload_bytes=32, recovery=policy, hadamard_block=16)
    net, plain = LossyNetwork(2, "bernoulli:0.3", **spec), LossyNetwork(2, "bernoulli:0.3", **spec)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(100, generator=g, dtype=torch.float64) for _ in range(4)]
    record = defaultdict(deque)
    for x in xs[:2]:
        with net.recording(record):
            first = net.send("s", "bwd", x, 0, 1)
        with net.replaying(record):
            assert torch.equal(net.send("s", "bwd", x, 0, 1), first)
        assert torch.equal(plain.send("s", "bwd", x, 0, 1), first)
    for x in xs[2:]:
        assert torch.equal(net.send("s", "bwd", x, 0, 1), plain.send("s", "bwd", x, 0, 1))
    assert net.stats() == plain.stats()
    assert net.clock()["ideal_comm_s"] == pytest.approx(plain.clock()["ideal_comm_s"] * 6 / 4, rel=1e-12)


@pytest.mark.parametrize("policy", ["zero", "hadamard", "stale", "error_feedback"])
def test_a_saved_network_resumes_the_same_fates(policy):
    """state_dict / load_state_dict between sends: the restored network delivers, counts and charges
    exactly what the original does next."""
    spec = dict(seed=13, payload_bytes=32, recovery=policy, hadamard_block=16, ranks_per_node=2,
                transport="deadline", deadline=3.0)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(150, generator=g) for _ in range(8)]
    pairs = [(0, 2), (1, 3), (2, 0), (3, 1)]
    net = LossyNetwork(4, "ge:rate=0.2,burst=3", **spec)
    for x, pair in zip(xs[:4], pairs):
        net.send("s", "bwd", x, *pair)
    buffer = io.BytesIO()
    torch.save(net.state_dict(), buffer)
    restored = LossyNetwork(4, "ge:rate=0.2,burst=3", **spec)
    restored.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
    for x, pair in zip(xs[4:], pairs):
        assert torch.equal(restored.send("s", "bwd", x, *pair), net.send("s", "bwd", x, *pair))
    assert restored.stats() == net.stats() and restored.clock() == net.clock()


def test_a_state_saved_before_sends_had_a_phase_still_loads():
    """Counters saved with five phases (no ``send``) load as they were, the sends' phase empty."""
    net = LossyNetwork(3, "bernoulli:0.2", seed=1, payload_bytes=32)
    net.all_reduce("s", "bwd", torch.randn(3, 100), range(3))
    state = net.state_dict()
    for entry in state["channels"].values():
        entry["counts"] = entry["counts"][:, :5].clone()
    old = LossyNetwork(3, "bernoulli:0.2", seed=1, payload_bytes=32)
    old.load_state_dict(state)
    assert old.stats() == net.stats()
    x = torch.randn(3, 100)
    assert torch.equal(old.all_reduce("s", "bwd", x, range(3)), net.all_reduce("s", "bwd", x, range(3)))
    old.send("s", "bwd", torch.randn(40), 0, 2)
    assert [r["phase"] for r in old.stats()].count("send") == 1


def test_the_docs_p2p_table_is_the_model():
    """docs/time_model.md's p2p table, cell by cell, to its printed rounding."""
    from pathlib import Path
    text = (Path(__file__).parent.parent / "docs" / "time_model.md").read_text()
    header = "| link | 16 KiB | 1 MiB | 8 MiB |"
    lines = text[text.index(header):].splitlines()[2:5]
    assert len(lines) == 3
    for line in lines:
        name, *cells = [cell.strip().strip("`") for cell in line.strip("|").split("|")]
        for nbytes, cell in zip((16384, 1 << 20, 8 << 20), cells):
            assert cell == f"{nccl.p2p_time(nbytes, 1450, LINK_PRESETS[name]) * 1e6:.2f} us", (name, nbytes)


def test_a_process_that_holds_one_link_draws_the_others_without_data():
    """A call site's links share one stream in call order: drawing another link's send with
    ``simulate(pair=...)`` leaves this link's fates, counters and clock as a process running every
    send gets them (dist: each process moves its own message and draws the rest)."""
    spec = dict(seed=14, payload_bytes=32, ranks_per_node=2)
    every, mine = LossyNetwork(4, "bernoulli:0.3", **spec), LossyNetwork(4, "bernoulli:0.3", **spec)
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        theirs, x = torch.randn(70, generator=g), torch.randn(70, generator=g)
        every.send("act", "fwd", theirs, 0, 2)
        mine.simulate("act", "fwd", theirs.numel(), theirs.dtype, "send", pair=(0, 2))
        assert torch.equal(mine.send("act", "fwd", x, 1, 3), every.send("act", "fwd", x, 1, 3))
    assert mine.stats() == every.stats() and mine.clock() == every.clock()


def test_a_send_a_library_moved_is_counted_and_timed():
    """dist's loss-free or retransmitted messages: ``account`` counts and charges them as ``send`` would;
    traffic that can lose packets must go through the network."""
    net = LossyNetwork(2, "bernoulli:0.2", seed=1, payload_bytes=64, ranks_per_node=1, lossy="fwd")
    x = torch.randn(160)
    net.account("g", "bwd", x, "send", pair=(1, 0))
    assert net.clock()["comm_s"] == pytest.approx(nccl.p2p_time(640, 64, net.spec.link_inter), rel=1e-12)
    assert [(r["src"], r["dst"], r["phase"], r["sent"]) for r in net.stats()] == [(1, 0, "send", 10)]
    with pytest.raises(RuntimeError, match="traffic is lossy"):
        net.account("a", "fwd", x, "send", pair=(0, 1))


@pytest.mark.parametrize("transport", ["drop", "retransmit", "deadline"])
def test_an_empty_message_arrives_empty_and_takes_no_time(transport):
    """Nothing to packetise, nothing to lose (a collective's empty message likewise)."""
    net = LossyNetwork(2, "bernoulli:0.2", recovery="stale", transport=transport)
    assert net.send("s", "bwd", torch.zeros(0, 4), 0, 1).shape == (0, 4)
    assert net.all_reduce("s", "bwd", torch.zeros(2, 0), range(2)).shape == (2, 0)
    assert net.clock()["comm_s"] == 0.0 and net.totals()["sent"] == 0
