"""Time model: closed forms against step lists built here and against the network's own clock,
nccl-tests bus bandwidth, specs, compute arithmetic, and retransmission expectations against
simulated transports.

Step lists are built in this file from the textbook descriptions (not from the network's
schedules), then timed with ``step_time``; the network's schedules are checked against them, and
its clock against the closed forms. Statistical checks use a p-value threshold of 1e-5 and
assert that a wrong formula fails.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from lossysim.timing import (DEFAULT_MFU, GPU_PRESETS, LINK_PRESETS, MEASURED, NIC_PRESETS, Compute, Link, algbw,
                             busbw, direct_all_gather_time, direct_all_reduce_time, expected_repair_s,
                             go_back_n_transmissions, ib_timeout_s,
                             packet_count, parse_compute, parse_link, ring_all_gather_time, ring_all_reduce_time,
                             selective_repeat_transmissions, send_times, step_time, tree_all_reduce_time,
                             window_packets)
from lossysim.models.cost import step_flops
from lossysim.net import LossyNetwork
from lossysim.timing import nccl
from lossysim.net.algorithms import schedule

ALGORITHMS = ("ring_all_reduce", "ring_all_gather", "tree_all_reduce", "direct_all_reduce", "direct_all_gather")

ALPHA = 1e-5
PP = 1450
BARE = Link("bare", 2e-6, 1e9, 0)               # no headers: the textbook formulas hold exactly
ROCE = LINK_PRESETS["roce-200g"]
LINKS = {"bare": BARE, "roce-200g": ROCE, "nvlink4": LINK_PRESETS["nvlink4"],
         "tiny-packets": Link("tiny", 1e-6, 3e8, 40)}
SIZES = [0, 1, 7, 1000, 4096, 12345, 8 * 1024 * 768 * 2]   # bytes; last: GPT-2 small activations, bf16


# ---------------------------------------------------------------------------- step lists built here

def ring_all_reduce_steps(R, M, pp=PP):
    """Reduce-scatter then all-gather: in every one of 2(R-1) steps each rank passes one chunk on.
    Chunk c is rank c's: a run of whole packets, the first P % R chunks one packet longer. In
    reduce-scatter step s rank r passes chunk r - 1 - s (a partial sum that ends at its owner), in
    all-gather step s chunk r - s (finished, travelling on)."""
    P = -(-M // pp)
    counts = [P // R + (i < P % R) for i in range(R)]
    starts = [sum(counts[:i]) for i in range(R)]
    sizes = [min(M, (starts[i] + counts[i]) * pp) - starts[i] * pp if counts[i] else 0 for i in range(R)]
    steps = [[(r, (r + 1) % R, sizes[(r - 1 - s) % R]) for r in range(R)] for s in range(R - 1)]
    steps += [[(r, (r + 1) % R, sizes[(r - s) % R]) for r in range(R)] for s in range(R - 1)]
    return steps


def ring_all_gather_steps(R, S, pp=PP):
    return [[(r, (r + 1) % R, S) for r in range(R)] for _ in range(R - 1)]


def depth(rank):
    d = 0
    while rank > 0:
        rank, d = (rank - 1) // 2, d + 1
    return d


def tree_all_reduce_steps(R, M, pp=PP):
    """Binary heap tree: reduce level by level from the leaves, then broadcast back down."""
    by_depth = {}
    for r in range(1, R):
        by_depth.setdefault(depth(r), []).append(r)
    reduce = [[(r, (r - 1) // 2, M) for r in by_depth[d]] for d in sorted(by_depth, reverse=True)]
    broadcast = [[((r - 1) // 2, r, M) for r in by_depth[d]] for d in sorted(by_depth)]
    return reduce + broadcast


def direct_steps(R, M, pp=PP):
    return [[(src, dst, M) for src in range(R) for dst in range(R) if src != dst]] if R > 1 else []


BUILT = {"ring_all_reduce": ring_all_reduce_steps, "ring_all_gather": ring_all_gather_steps,
         "tree_all_reduce": tree_all_reduce_steps, "direct_all_reduce": direct_steps,
         "direct_all_gather": direct_steps}
CLOSED = {"ring_all_reduce": ring_all_reduce_time, "ring_all_gather": ring_all_gather_time,
          "tree_all_reduce": tree_all_reduce_time, "direct_all_reduce": direct_all_reduce_time,
          "direct_all_gather": direct_all_gather_time}


def timed(steps, link, pp=PP):
    """Sum over steps of step_time, empty sends dropped (they carry nothing)."""
    return sum(step_time([(s, d, b, packet_count(b, pp), link) for s, d, b in step if b > 0])
               for step in steps)


# ---------------------------------------------------------------------------- closed forms

@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("link", LINKS.values(), ids=LINKS.keys())
def test_closed_forms_equal_step_lists(algorithm, link):
    for R in range(1, 9):
        for M in SIZES:
            for pp in (PP, 64):
                expected = timed(BUILT[algorithm](R, M, pp), link, pp)
                got = CLOSED[algorithm](R, M, link, pp)
                assert got == pytest.approx(expected, rel=1e-12, abs=0), (R, M, pp)
                if R == 1 or M == 0:
                    assert got == 0.0
                else:
                    assert got > link.latency_s


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_networks_schedules_are_the_step_lists(algorithm):
    """The sends the network makes, in bytes, step by step, are the textbook's."""
    kind, collective = algorithm.split("_", 1)
    for R in range(2, 9):
        for M in [m for m in SIZES if m % 4 == 0 and m]:
            P = -(-M // PP)
            sched = schedule(kind, collective, R, P)
            sent = [[] for _ in range(sched.steps)]
            for s in sched.sends:
                if s.packets:
                    sent[s.step].append((s.src, s.dst, min(M, (s.first + s.packets) * PP) - s.first * PP))
            built = [sorted(step) for step in (sorted(x for x in st if x[2] > 0) for st in BUILT[algorithm](R, M))
                     if step]
            assert [sorted(step) for step in sent if step] == built, (R, M)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
def test_the_networks_clock_is_the_closed_form(algorithm):
    """What the network charges a loss-free collective, for any size: NCCL's model for ring and tree
    (the wire bytes of its packets over the link's bus bandwidth), the alpha-beta form for direct."""
    spec = "alpha=2us,bw=100Gbps,header=40"
    link = parse_link(spec)

    def form(collective, R, M):
        if algorithm == "direct":
            return (direct_all_reduce_time if collective == "all_reduce" else direct_all_gather_time)(R, M, link, 1448)
        return nccl.collective_time(collective, algorithm, R, 1, M, 1448, link, link, link.bandwidth_Bps)
    for R in range(2, 9):
        for M in [4, 40, 1448, 1452, 4 * 362 * 7 * R + 8, 123452]:
            net = LossyNetwork(R, "none", payload_bytes=1448, algorithm=algorithm, link_intra=spec)
            net.all_reduce("s", "fwd", torch.zeros(R, M // 4), range(R))
            assert net.clock()["comm_s"] == pytest.approx(form("all_reduce", R, M), rel=1e-12), (R, M)
            if algorithm != "tree":
                net.reset_stats()
                net.all_gather("g", "fwd", torch.zeros(R, M // 4), range(R))
                assert net.clock()["comm_s"] == pytest.approx(form("all_gather", R, M), rel=1e-12)


def test_textbook_alpha_beta_formulas_without_headers():
    a, B = BARE.latency_s, BARE.bandwidth_Bps
    for R in range(2, 9):
        M = R * 1450 * 3                     # chunks and shards fill whole packets
        assert ring_all_reduce_time(R, M, BARE) == pytest.approx(2 * (R - 1) * (a + M / (R * B)), rel=1e-12)
        assert ring_all_gather_time(R, M, BARE) == pytest.approx((R - 1) * (a + M / B), rel=1e-12)
        assert direct_all_reduce_time(R, M, BARE) == pytest.approx(a + (R - 1) * M / B, rel=1e-12)
    # R = 8: depths {1,2} {3..6} {7}; the lone leaf 7 has its parent's ingress to itself.
    M = 10_000
    assert tree_all_reduce_time(8, M, BARE) == pytest.approx(2 * (3 * a + 5 * M / B), rel=1e-12)
    # R = 2: one child, no sharing: reduce plus broadcast, one hop each.
    assert tree_all_reduce_time(2, M, BARE) == pytest.approx(2 * (a + M / B), rel=1e-12)


def test_headers_count_once_per_packet():
    M = 8 * 1450 * 10 + 8                    # 81 packets, the last of 8 bytes: the first chunk holds 11
    chunk = 11 * 1450
    wire = chunk + 11 * ROCE.header_bytes
    assert ring_all_reduce_time(8, M, ROCE) == pytest.approx(
        14 * (ROCE.latency_s + wire / ROCE.bandwidth_Bps), rel=1e-12)
    assert ROCE.wire_bytes(chunk, 11) == wire
    assert ROCE.header_bytes == 14 + 20 + 8 + 12 + 4 + 4 + 20


# ---------------------------------------------------------------------------- port sharing

def test_sends_share_the_egress_and_ingress_ports_of_their_class():
    intra, inter = Link("intra", 1e-6, 1e9, 0), Link("inter", 1e-6, 1e9, 0)
    w = 1000
    one = 1e-6 + w / 1e9
    assert step_time([]) == 0.0
    assert step_time([(0, 1, w, 1, intra)]) == pytest.approx(one)
    # rank 0 sends to three peers: its egress is shared three ways, every send takes 3w/B
    fan_out = [(0, d, w, 1, intra) for d in (1, 2, 3)]
    assert step_time(fan_out) == pytest.approx(1e-6 + 3 * w / 1e9)
    # two senders into rank 0: its ingress is shared
    assert step_time([(1, 0, w, 1, intra), (2, 0, w, 1, intra)]) == pytest.approx(1e-6 + 2 * w / 1e9)
    # the same pattern split across two classes: separate ports, no sharing
    assert step_time([(0, 1, w, 1, intra), (0, 2, w, 1, inter)]) == pytest.approx(one)
    # the slowest send ends the step
    assert step_time([(0, 1, w, 1, intra), (2, 3, 5 * w, 1, inter)]) == pytest.approx(1e-6 + 5 * w / 1e9)
    # a port class may be named: equal links on different ports do not share
    assert step_time([(0, 1, w, 1, intra, "intra"), (0, 2, w, 1, intra, "inter")]) == pytest.approx(one)
    assert step_time([(0, 1, w, 1, intra, "a"), (0, 2, w, 1, inter, "a")]) == pytest.approx(1e-6 + 2 * w / 1e9)
    # per send: alpha, the wire time of one packet on its shared port, and the whole
    (first, second), = [send_times([(0, 1, w, 4, intra), (0, 2, w, 4, intra)])]
    assert first.alpha == 1e-6 and first.tau == pytest.approx(2 * w / 1e9 / 4)
    assert first.seconds == pytest.approx(first.alpha + 4 * first.tau) and second == first
    with pytest.raises(ValueError, match="itself"):
        step_time([(2, 2, w, 1, intra)])
    with pytest.raises(ValueError, match="send="):
        step_time([(0, 1, w, intra)])


def test_two_nodes_spread_their_traffic_over_their_nics():
    """Across nodes a rank's traffic shares the node's NICs (NCCL spreads its channels over them):
    bus bandwidth is the slower of NVLink and the NICs together; one NIC per node is the bottleneck."""
    M = 8 * 1024 * 768 * 2
    x = torch.zeros(8, M // 2, dtype=torch.bfloat16)
    times = {}
    for nics in (4, 1):
        net = LossyNetwork(8, "none", ranks_per_node=4, link_intra="nvlink4", link_inter="roce-200g",
                           nics_per_node=nics)
        net.all_reduce("s", "fwd", x, range(8))
        fast = LINK_PRESETS["nvlink4"]
        expected = nccl.collective_time("all_reduce", "ring", 8, 2, M, net.spec.payload_bytes, fast, ROCE,
                                        min(fast.bandwidth_Bps, nics * ROCE.bandwidth_Bps))
        times[nics] = net.clock()["comm_s"]
        assert times[nics] == pytest.approx(expected, rel=1e-12)
    assert 3 < times[1] / times[4] < 4


# ---------------------------------------------------------------------------- bus bandwidth

@pytest.mark.parametrize("R", range(2, 9))
def test_busbw_of_the_ring_recovers_the_link_bandwidth(R):
    B = 37.5e9
    link = Link("ideal", 0.0, B, 0)
    M = R * 1450 * 17
    assert busbw("all_reduce", R, M, ring_all_reduce_time(R, M, link)) == pytest.approx(B, rel=1e-12)
    # nccl-tests sizes an all-gather by its whole output, R shards
    assert busbw("all_gather", R, M, ring_all_gather_time(R, M // R, link)) == pytest.approx(B, rel=1e-12)
    assert algbw(M, ring_all_reduce_time(R, M, link)) == pytest.approx(B * R / (2 * (R - 1)), rel=1e-12)
    # headers take their share: busbw = B * payload / (payload + header) per full packet
    framed = Link("framed", 0.0, B, 82)
    assert busbw("all_reduce", R, M, ring_all_reduce_time(R, M, framed)) == pytest.approx(
        B * 1450 / (1450 + 82), rel=1e-12)
    # latency and the direct exchange's shared ports both push busbw below B
    assert busbw("all_reduce", R, M, ring_all_reduce_time(R, M, BARE)) < BARE.bandwidth_Bps
    assert busbw("all_reduce", R, M, direct_all_reduce_time(R, M, link)) == pytest.approx(2 * B / R, rel=1e-12)


@pytest.mark.parametrize("R", [2, 4, 8])
def test_nccls_bus_bandwidth_approaches_the_links_at_large_sizes(R):
    """Latency fades, headers stay: the ring's busbw(1 GiB) is B x payload / (payload + header) to within
    2%; NCCL's pipelined double binary tree moves 2M at B/2 x 0.92 (Simple), whatever R: busbw = that
    algbw x 2(R-1)/R. Small messages pay latency."""
    for link in (LINK_PRESETS["nvlink4"], ROCE):
        net = link.hw == "net"
        nodes = R if net else 1
        ceiling = link.bandwidth_Bps * PP / (PP + link.header_bytes)
        for algorithm in ("ring", "tree"):
            t = nccl.collective_time("all_reduce", algorithm, R, nodes, 2 ** 30, PP, link, link, link.bandwidth_Bps)
            efficiency = 1.0 if algorithm == "ring" else 0.92 * (R - 1) / R
            assert busbw("all_reduce", R, 2 ** 30, t) == pytest.approx(ceiling * efficiency, rel=0.02)
            small = nccl.collective_time("all_reduce", algorithm, R, nodes, 2 ** 16, PP, link, link, link.bandwidth_Bps)
            assert busbw("all_reduce", R, 2 ** 16, small) < 0.5 * ceiling
        t = nccl.collective_time("all_gather", "ring", R, nodes, 2 ** 30 // R, PP, link, link, link.bandwidth_Bps)
        assert busbw("all_gather", R, 2 ** 30, t) == pytest.approx(ceiling, rel=0.02)


def test_busbw_factors():
    assert busbw("reduce_scatter", 4, 100.0, 1.0) == pytest.approx(75.0)
    assert busbw("broadcast", 4, 100.0, 1.0) == busbw("reduce", 4, 100.0, 1.0) == 100.0
    with pytest.raises(ValueError, match="kind='alltoall'"):
        busbw("alltoall", 4, 100.0, 1.0)


# ---------------------------------------------------------------------------- link specs

def test_presets_parse_and_round_trip():
    for name, link in LINK_PRESETS.items():
        assert parse_link(name) == link and link.spec == name and link.name == name
    assert LINK_PRESETS["nvlink4-line"].bandwidth_Bps == 450e9 > LINK_PRESETS["nvlink4"].bandwidth_Bps
    assert LINK_PRESETS["ib-ndr400"].bandwidth_Bps == LINK_PRESETS["roce-400g"].bandwidth_Bps == 50e9
    assert LINK_PRESETS["roce-100g"].bandwidth_Bps * 4 == LINK_PRESETS["roce-400g"].bandwidth_Bps
    modified = parse_link("roce-200g,alpha=10us")
    assert modified.latency_s == 1e-5 and modified.bandwidth_Bps == ROCE.bandwidth_Bps
    assert modified.spec == "roce-200g,alpha=10us" and parse_link(modified.spec) == modified
    explicit = parse_link("alpha=2us,bw=200Gbps,header=82")
    assert explicit == Link("custom", 2e-6, 25e9, 82) and parse_link(explicit.spec) == explicit
    assert parse_link(ROCE) is ROCE


@pytest.mark.parametrize("a,b", [("alpha=1500ns,bw=400Gbps", "alpha=1.5us,bw=50GB/s"),
                                 ("alpha=0.002ms,bw=50000MB/s", "alpha=2e-6s,bw=400000Mbps"),
                                 ("alpha=1s,bw=8Kbps", "alpha=1000ms,bw=1KB/s"),
                                 ("alpha=1us,bw=1Tbps,header=0", "alpha=1us,bw=125GB/s"),
                                 ("alpha=1us,bw=8bps", "alpha=1us,bw=1B/s")])
def test_units_agree(a, b):
    assert parse_link(a) == parse_link(b)


@settings(max_examples=200, deadline=None)
@given(alpha=st.floats(0, 1, allow_nan=False), bw=st.floats(1, 1e15, allow_nan=False),
       header=st.integers(0, 200), name=st.sampled_from(["custom", "x-1", "roce-200g", "nvlink4"]))
def test_any_link_round_trips_through_its_spec(alpha, bw, header, name):
    link = Link(name, alpha, bw, header)
    assert parse_link(link.spec) == link


@pytest.mark.parametrize("spec,field", [
    ("roce-300g", "roce-300g"), ("alpha=2us", "bw"), ("bw=1Gbps", "alpha"),
    ("alpha=2,bw=1Gbps", "alpha"), ("alpha=2 weeks,bw=1Gbps", "alpha"), ("alpha=2us,bw=5", "bw"),
    ("alpha=2us,bw=5Gbits", "bw"), ("alpha=2us,bw=0Gbps", "bw"), ("nvlink4,alpha=-1us", "alpha"),
    ("nvlink4,header=-1", "header"), ("nvlink4,header=1.5", "header"), ("nvlink4,colour=red", "colour"),
    ("nvlink4,alpha", "alpha"), ("nvlink4,alpha=1us,alpha=2us", "alpha"), ("nvlink4,name=a b", "name"),
    ("", "empty")])
def test_bad_link_specs_give_one_line_errors_naming_the_field(spec, field):
    with pytest.raises(ValueError) as err:
        parse_link(spec)
    message = str(err.value)
    assert "\n" not in message and message.startswith("bad link spec") and field in message


# ---------------------------------------------------------------------------- compute

def test_compute_model_arithmetic():
    h100 = parse_compute("h100")
    assert h100 == Compute("h100", GPU_PRESETS["h100"], DEFAULT_MFU) and h100.spec == "h100"
    N, T = 124_439_808, 8 * 1024            # GPT-2 small parameters, tokens of an 8 x 1024 batch
    t1 = h100.step_time(N, T, 1)
    assert t1 == pytest.approx(6 * N * T / (989.4e12 * 0.4), rel=1e-12)
    assert h100.step_time(N, T, 8) == pytest.approx(t1 / 8, rel=1e-12)
    assert parse_compute("h100,mfu=0.2").step_time(N, T, 1) == pytest.approx(2 * t1, rel=1e-12)
    custom = parse_compute("flops=1e15,mfu=0.5")
    assert custom.step_time(1e9, 1e3) == pytest.approx(6e12 / 5e14, rel=1e-12)
    assert parse_compute("flops=1PFLOPS,mfu=0.5") == parse_compute("flops=1000TFLOP/s,mfu=0.5") == custom
    for compute in (h100, custom, parse_compute("h100,mfu=0.35"), parse_compute("a100,flops=1e14"),
                    parse_compute("name=mine,flops=3e14,mfu=0.25")):
        assert parse_compute(compute.spec) == compute
    assert parse_compute("measured") is MEASURED and MEASURED.spec == "measured"
    # dense peaks are half the vendors' 2:4-sparsity headline figures, never above them
    assert GPU_PRESETS["h200"] == GPU_PRESETS["h100"] > GPU_PRESETS["a100"] > GPU_PRESETS["l4"]
    assert GPU_PRESETS["b200"] > GPU_PRESETS["mi300x"] > GPU_PRESETS["h100"]


def test_a_small_models_step_is_bound_by_its_kernel_launches():
    h100 = parse_compute("h100")
    assert h100.launch_s == 5e-6 and parse_compute("h100,launch=8us").launch_s == 8e-6
    tiny = h100.step_time(1e5, 512, 2, kernels=400)
    assert tiny == pytest.approx(400 * 5e-6, rel=1e-12)      # the FLOPs would take nanoseconds
    N, T = 8.03e9, 8 * 8192                                 # Llama-3.1-8B, 8 sequences of 8192
    attention = step_flops(0, T, 32, 4096, 8192)
    assert attention == pytest.approx(12 * 32 * 8192 ** 2 * 4096 * 8, rel=1e-12)
    big = h100.step_time(N, T, 8, attention_flops=attention, kernels=3000)
    assert big == pytest.approx((6 * N * T + attention) / 8 / (989.4e12 * 0.4), rel=1e-12)
    assert big > 3000 * 5e-6
    assert step_flops(N, T, 32, 4096, 8192) == pytest.approx(6 * N * T + attention, rel=1e-12)


def test_kernels_are_counted_per_layer_without_moving_the_runs_random_streams():
    from transformers import GPT2Config, GPT2ForSequenceClassification
    from lossysim.models.cost import kernels_per_step
    counts = {}
    for layers in (1, 2, 3):
        config = GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=100, n_positions=32, pad_token_id=0)
        model = GPT2ForSequenceClassification(config)
        state = torch.get_rng_state()
        counts[layers] = kernels_per_step(model)
        assert torch.equal(state, torch.get_rng_state())
    per_layer = counts[2] - counts[1]
    assert per_layer > 20 and counts[3] - counts[2] == per_layer    # every block launches the same kernels
    wide = GPT2ForSequenceClassification(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500,
                                                    n_positions=32, pad_token_id=0))
    assert kernels_per_step(wide) == counts[2]                       # widths change no count


@pytest.mark.parametrize("spec,field", [("h1000", "h1000"), ("mfu=0.3", "flops"), ("h100,mfu=1.5", "mfu"),
                                        ("h100,mfu=0", "mfu"), ("h100,mfu=x", "mfu"),
                                        ("flops=abc", "flops"), ("flops=-1", "flops"),
                                        ("h100,speed=3", "speed")])
def test_bad_compute_specs_give_one_line_errors_naming_the_field(spec, field):
    with pytest.raises(ValueError) as err:
        parse_compute(spec)
    message = str(err.value)
    assert "\n" not in message and message.startswith("bad compute spec") and field in message


# ---------------------------------------------------------------------------- retransmission

def simulate_selective_repeat(p, packets, rng):
    """Rounds: send every outstanding packet, resend only the lost ones. Returns transmissions."""
    sent, outstanding = 0, packets
    while outstanding:
        sent += outstanding
        outstanding = int((rng.random(outstanding) < p).sum())
    return sent


def simulate_go_back_n(p, window, packets, rng):
    """A sender streaming packets in order; the receiver accepts only the next expected one.

    A loss is noticed a round trip (``window`` transmissions) later; meanwhile the packets behind
    it arrive and are discarded; then the sender goes back to the lost one. Returns transmissions.
    """
    draws = iter(rng.random(packets * (2 + window) * 4))
    expected = cursor = sent = 0
    go_back_at = None
    while expected < packets:
        if sent == go_back_at:
            cursor, go_back_at = expected, None
        seq, cursor, sent = cursor, cursor + 1, sent + 1
        lost = next(draws) < p
        if seq == expected and not lost:
            expected += 1
        elif seq == expected and go_back_at is None:
            go_back_at = sent + window
    return sent


def per_packet_means(simulate, replicates=300, packets=200, seed=0):
    rng = np.random.default_rng(seed)
    return np.array([simulate(packets, rng) / packets for _ in range(replicates)])


@pytest.mark.parametrize("p", [0.01, 0.1, 0.3])
def test_selective_repeat_transmissions_match_a_simulation(p):
    means = per_packet_means(lambda n, rng: simulate_selective_repeat(p, n, rng), packets=2000)
    assert stats.ttest_1samp(means, selective_repeat_transmissions(p)).pvalue > ALPHA
    assert stats.ttest_1samp(means, selective_repeat_transmissions(1.2 * p)).pvalue < ALPHA


@pytest.mark.parametrize("p,window", [(0.01, 16), (0.05, 8), (0.2, 3), (0.1, 0)])
def test_go_back_n_transmissions_match_a_simulation(p, window):
    means = per_packet_means(lambda n, rng: simulate_go_back_n(p, window, n, rng))
    assert stats.ttest_1samp(means, go_back_n_transmissions(p, window)).pvalue > ALPHA
    if window:
        assert stats.ttest_1samp(means, selective_repeat_transmissions(p)).pvalue < ALPHA
    else:
        assert go_back_n_transmissions(p, 0) == selective_repeat_transmissions(p)


def test_window_is_the_bandwidth_delay_product_in_packets():
    for link in LINK_PRESETS.values():
        W = window_packets(link, PP)
        bdp = 2 * link.latency_s * link.bandwidth_Bps
        per_packet = PP + link.header_bytes
        assert (W - 1) * per_packet < bdp <= W * per_packet
    assert window_packets(Link("zero", 0.0, 1e9, 0)) == 0


def test_timeouts():
    assert ib_timeout_s(18) == pytest.approx(1.073741824)
    assert ib_timeout_s(20) == pytest.approx(4 * ib_timeout_s(18))
    assert ib_timeout_s() == ib_timeout_s(20)
    for bad in (-1, 32, 1.5):
        with pytest.raises(ValueError, match="t="):
            ib_timeout_s(bad)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="p="):
            selective_repeat_transmissions(bad)


# ---------------------------------------------------------------------------- the documented example

def _doc() -> str:
    from pathlib import Path
    return (Path(__file__).resolve().parents[1] / "docs" / "time_model.md").read_text()


def _show(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def _loss_free(collective, algorithm, tp, per_node, inter, message_bytes):
    from lossysim.net.spec import NetworkSpec
    from lossysim.net.transfer import loss_free_time
    spec = NetworkSpec(tp, "none", ranks_per_node=per_node, link_intra="nvlink4", link_inter=inter,
                       algorithm=algorithm)
    packets = -(-message_bytes // spec.payload_bytes)
    return loss_free_time(spec, schedule(algorithm, collective, tp, packets), message_bytes, spec.payload_bytes)


def test_worked_example_in_the_docs_matches_the_model():
    """docs/time_model.md quotes these figures; a change to a preset or formula must update them."""
    doc = _doc()
    M = 8 * 1024 * 768 * 2
    for name in ("nvlink4", "ib-ndr400", "roce-200g", "roce-400g"):
        per_node = None if name == "nvlink4" else 1
        ring, tree, direct = (_loss_free("all_reduce", a, 8, per_node, name, M) for a in ("ring", "tree", "direct"))
        row = (f"| `{name}` | {_show(ring)} | {_show(tree)} | {_show(direct)} | "
               f"{busbw('all_reduce', 8, M, ring) / 1e9:.1f} GB/s |")
        assert row in doc, row
    compute = parse_compute("h100").step_time(124_439_808, 8 * 1024, 8)
    assert f"= {compute * 1e3:.2f} ms` per rank" in doc
    link = LINK_PRESETS["roce-400g"]
    tau, window = link.wire_bytes(PP, 1) / link.bandwidth_Bps, window_packets(link, PP)
    row = "| 1.0% | " + " | ".join(f"{expected_repair_s(nic, 1085, 0.01, tau, 2 * link.latency_s, window) * 1e6:.1f}"
                                   for nic in NIC_PRESETS.values() if not nic.rack) + " |"
    assert row in doc, row


def test_the_docs_nccl_table_is_what_the_network_charges():
    """The comparison table in docs/time_model.md, cell by cell: the network's loss-free time (NCCL's
    model on the wire bytes) and its bus bandwidth; NCCL's model on payload bytes alone is at most
    1.8% faster (the InfiniBand headers), never slower."""
    doc = _doc()
    sizes = [2 ** 16, 2 ** 20, 2 ** 24, 2 ** 28, 2 ** 30]
    for collective, algorithm in (("all_reduce", "ring"), ("all_reduce", "tree"), ("all_gather", "ring")):
        for inter, per_node in (("nvlink4", None), ("ib-ndr400", 1)):
            for tp in (2, 8):
                cells = []
                for size in sizes:
                    message = size // tp if collective == "all_gather" else size
                    t = _loss_free(collective, algorithm, tp, per_node, "ib-ndr400", message)
                    link = LINK_PRESETS["ib-ndr400" if per_node else "nvlink4"]
                    payload_only = nccl.estimate(collective, algorithm, tp, 1 if per_node is None else tp, size,
                                                 link.bandwidth_Bps, "nvlink", "net").seconds
                    assert 1.0 <= t / payload_only <= 1.018 + 1e-3, (collective, algorithm, inter, tp, size)
                    cells.append(f"{_show(t)} ({busbw(collective, tp, size, t) / 1e9:.0f})")
                where = "NVLink, 1 node" if per_node is None else f"NDR 400G, {tp} nodes"
                row = (f"| {collective.replace('_', '-')} {algorithm} | {where} | {tp} | " + " | ".join(cells) + " |")
                assert row in doc, row


def test_bad_schedule_arguments():
    with pytest.raises(ValueError, match="algorithm='alltoall'"):
        schedule("alltoall", "all_reduce", 4, 100)
    with pytest.raises(ValueError, match="R=0"):
        ring_all_reduce_time(0, 100, BARE)
    with pytest.raises(ValueError, match="M=-1"):
        ring_all_reduce_time(4, -1, BARE)
    with pytest.raises(ValueError, match="bad compute spec '': empty"):
        parse_compute("")
