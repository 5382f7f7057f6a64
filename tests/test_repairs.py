"""What a lost packet costs in time, per NIC preset: the transport's repairs against their exact
expectation (``timing.expected_repair_s``), failures at the rate the retry count implies, the
ideal preset as a lower bound, and every preset at zero loss costing what the loss-free model says."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from lossysim import timing
from lossysim.net.network import LossyNetwork
from lossysim.net.transport import Sends, Transport, rounds, run_step, selective
from lossysim.timing import NIC_PRESETS, expected_repair_s

ALPHA = 1e-5
pytestmark = pytest.mark.usefixtures("one_torch_thread")
TAU, RTT, WINDOW = 0.12e-6, 6e-6, 8


def one_connection(nic, packets: int, final: bool = True) -> Sends:
    tails = torch.zeros(1, packets, dtype=torch.bool)
    if final:
        tails[0, packets - nic.dupacks:] = True
    f64 = dict(dtype=torch.float64)
    return Sends(torch.tensor([packets]), torch.tensor([TAU], **f64), torch.tensor([RTT], **f64),
                 torch.tensor([WINDOW]), torch.tensor([final]), tails,
                 torch.tensor([nic.dupacks if final else 0]))


def bernoulli(p: float, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def draw(lengths, known=True):
        return torch.rand(len(lengths), int(lengths.max()), generator=gen) < p, lambda used: None
    return draw


def repairs(nic, p, packets, trials, final=True, seed=0):
    """(extra seconds, timer waits, failed) of ``trials`` independent messages on one connection."""
    sends, draw = one_connection(nic, packets, final), bernoulli(p, seed)
    transport = Transport("retransmit", nic.mode)
    out = [run_step(transport, nic, sends, draw, math.inf) for _ in range(trials)]
    return (np.array([float(r.extra) for r in out]), np.array([int(r.timeouts.sum()) for r in out]),
            np.array([bool(r.failed.any()) for r in out]))


# p where each preset's timers matter, and few enough packets that runs are quick; roce-gbn's fifth
# timeout in a row waits seconds (the IB ACK timeout), so its p keeps that out of reach.
CASES = {"ideal": (0.1, 60), "irn": (0.1, 60), "srd": (0.1, 60), "roce-gbn": (0.02, 150),
         "roce-gbn-timeout": (0.02, 150)}


@pytest.mark.parametrize("name", [name for name, nic in NIC_PRESETS.items() if not nic.rack])
def test_repair_time_is_its_closed_form(name):
    # TCP's repairs (RACK-TLP) have none: tests/test_tcp.py holds them against an event-level RACK-TLP
    nic = NIC_PRESETS[name]
    p, n = CASES[name]
    extra, _, failed = repairs(nic, p, n, 1500)
    assert not failed.any()
    expected = expected_repair_s(nic, n, p, TAU, RTT, WINDOW)
    assert stats.ttest_1samp(extra, expected).pvalue > ALPHA
    other = "irn" if name == "ideal" else "ideal"   # and the formula tells the presets apart
    wrong = expected_repair_s(NIC_PRESETS[other], n, p, TAU, RTT, WINDOW)
    assert stats.ttest_1samp(extra, wrong).pvalue < ALPHA


@pytest.mark.parametrize("name", ["irn", "roce-gbn"])
def test_a_step_that_is_not_the_connections_last_waits_no_timer(name):
    """Later traffic on the same connection reveals every loss: one round trip each, never a timer."""
    nic = NIC_PRESETS[name]
    extra, timeouts, _ = repairs(nic, 0.1, 60, 600, final=False)
    assert timeouts.sum() == 0
    expected = expected_repair_s(nic, 60, 0.1, TAU, RTT, WINDOW, final=False)
    assert stats.ttest_1samp(extra, expected).pvalue > ALPHA
    assert expected < expected_repair_s(nic, 60, 0.1, TAU, RTT, WINDOW)


@pytest.mark.parametrize("mode", ["selective", "go_back_n"])
def test_failures_occur_at_the_rate_the_retry_count_implies(mode):
    """A packet lost retries + 1 times in a row fails the collective: 1 - (1 - p^(retries+1))^n."""
    nic = replace(NIC_PRESETS["irn"], mode=mode, retries=2)
    p, n, trials = 0.1, 50, 3000
    _, _, failed = repairs(nic, p, n, trials, seed=3)
    rate = 1 - (1 - p ** 3) ** n
    assert stats.binomtest(int(failed.sum()), trials, rate).pvalue > ALPHA
    assert stats.binomtest(int(failed.sum()), trials, 1 - (1 - p ** 2) ** n).pvalue < ALPHA


def test_a_send_the_deadline_stops_keeps_its_pending_packets_missing():
    """Send 0 (5 packets) loses packets 1 and 2, send 1 (3 packets) its packet 0. Resending would take send
    0 to 1 + 2 x 1 = 3 s, past the 2 s budget: it stops, and both stay missing, whatever later rounds draw;
    send 1's resend (1.1 s) fits and arrives. The step ends at the budget."""
    f64 = dict(dtype=torch.float64)
    sends = lambda: Sends(torch.tensor([5, 3]), torch.tensor([1.0, 1.0], **f64),   # noqa: E731
                          torch.tensor([1.0, 0.1], **f64), torch.tensor([8, 8]), torch.tensor([False, False]),
                          torch.zeros(2, 5, dtype=torch.bool), torch.tensor([0, 0]))
    script = [{(0, 1), (0, 2), (1, 0)}, set()]
    nic = NIC_PRESETS["irn"]
    by_masks = run_step(Transport("deadline", "selective"), nic, sends(), scripted_masks(script), 2.0)
    by_positions = selective(nic, sends().host(), *scripted_positions(script), 2.0, give_up=True)
    for result in (by_masks, by_positions):
        assert list(zip(result.missing_row.tolist(), result.missing_packet.tolist())) == [(0, 1), (0, 2)]
        assert result.transmissions.tolist() == [5, 4] and result.extra == 2.0


# Scripted fates of one step of two sends (5 packets on a link's last step, 3 on an earlier one), round by
# round as (send, k) pairs: the k-th transmission of the round on that send is lost.
SCRIPT = [{(0, 1), (0, 4), (1, 0)},   # packet 4 of send 0 is a tail loss: nothing behind it reveals it
          {(0, 1)},                   # send 0 resends 1 and 4: 4, the last resend, is lost again (a tail)
          set()]


def scripted_sends() -> Sends:
    f64 = dict(dtype=torch.float64)
    tails = torch.zeros(2, 5, dtype=torch.bool)
    tails[0, 4] = True
    return Sends(torch.tensor([5, 3]), torch.tensor([TAU, 2 * TAU], **f64), torch.tensor([RTT, 2 * RTT], **f64),
                 torch.tensor([WINDOW, WINDOW]), torch.tensor([True, False]), tails, torch.tensor([1, 0]))


def scripted_masks(script=SCRIPT):
    rounds = iter(script)

    def draw(lengths, known=True):
        lost = torch.zeros(len(lengths), int(lengths.max()), dtype=torch.bool)
        for send, k in next(rounds):
            lost[send, k] = True
        return lost, lambda used: None
    return draw


def scripted_positions(script=SCRIPT):
    rounds = iter(script)

    def draw(to_send, width):
        return np.array(sorted(send * width + k for send, k in next(rounds)), dtype=np.int64)
    return draw, lambda row, column, to_send: None


@pytest.mark.parametrize("retries", [None, 1])
def test_selective_repeat_is_one_rule_whatever_keeps_the_fates(retries):
    """The same fates as masks (``run_step``) or as positions (``transport.selective``) are one repair,
    the one worked out by hand: each lost packet is resent once per loss, a tail loss waits the timer,
    any other loss a round trip; a packet lost retries + 1 times fails its send."""
    nic = replace(NIC_PRESETS["irn"], retries=retries)
    timer = nic.timer_value
    assert timer > 2 * RTT
    transport = Transport("retransmit", "selective")
    by_masks = run_step(transport, nic, scripted_sends(), scripted_masks(), math.inf)
    by_positions = selective(nic, scripted_sends().host(), *scripted_positions(), math.inf, give_up=False)
    for name in ("missing_row", "missing_packet", "transmissions", "timeouts", "failed"):
        np.testing.assert_array_equal(getattr(by_masks, name), getattr(by_positions, name))
    assert (by_masks.extra, by_masks.shadow) == (by_positions.extra, by_positions.shadow)
    if retries is None:   # send 0: 3 resends, two tail timers; send 1: 1 resend, one round trip
        assert by_masks.transmissions.tolist() == [8, 4] and by_masks.timeouts.tolist() == [2, 0]
        assert not by_masks.failed.any()
        assert by_masks.extra == pytest.approx(max(3 * TAU + 2 * timer, 2 * TAU + 2 * RTT), rel=1e-12)
        assert by_masks.shadow == pytest.approx(max(3 * TAU + 2 * RTT, 2 * TAU + 2 * RTT), rel=1e-12)
    else:                 # packet 4 is lost twice: send 0 gives up after its one retry
        assert by_masks.transmissions.tolist() == [7, 4] and by_masks.timeouts.tolist() == [1, 0]
        assert by_masks.failed.tolist() == [True, False]
        assert by_masks.extra == pytest.approx(max(2 * TAU + timer, 2 * TAU + 2 * RTT), rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.booleans(), st.integers(0, 3)), min_size=1, max_size=6),
       st.sampled_from([None, 0, 1, 3]), st.floats(0.02, 0.6), st.integers(0, 2 ** 31))
def test_compiled_rounds_are_numpys_rounds_to_the_bit(sends, retries, p, seed):
    """Selective repeat's bookkeeping in ``transport.rounds`` (compiled, and the same functions run as
    Python) against numpy's passes, on the same fates: every figure of the Result equal, floats to the
    bit, and every round's count of the losses that went out the same. Sends of any lengths, a link's
    last step or not, tail positions and tail resends, failures after any retries."""
    nic = replace(NIC_PRESETS["irn"], retries=retries)
    packets = [k for k, _, _ in sends]
    tails = torch.zeros(len(sends), max(packets), dtype=torch.bool)
    for i, (k, final, last) in enumerate(sends):
        tails[i, max(k - last, 0):k] = final
    f64 = dict(dtype=torch.float64)
    host = Sends(torch.tensor(packets), torch.linspace(1e-7, 3e-7, len(sends), **f64),
                 torch.linspace(6e-6, 9e-6, len(sends), **f64), torch.full((len(sends),), WINDOW),
                 torch.tensor([final for _, final, _ in sends]), tails,
                 torch.tensor([last for _, _, last in sends])).host()   # (only a final send's count)
    kernels = rounds.kernels()
    assert kernels is not None, "the dev extra installs numba"

    def repaired(which):
        rng, counted = np.random.default_rng(seed), []

        def draw(to_send, width):
            return np.flatnonzero(rng.random((len(packets), width)) < p)

        def count(row, column, to_send):
            counted.append((row.tolist(), column.tolist(), to_send.tolist()))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(rounds, "kernels", lambda: which)
            return selective(nic, host, draw, count, math.inf, give_up=False), counted

    numpy, *others = (repaired(which) for which in (None, kernels, (rounds.went, rounds.advance, rounds.wait, rounds.repairs)))
    for result, counted in others:
        assert counted == numpy[1]
        for name in ("missing_row", "missing_packet", "transmissions", "timeouts", "failed"):
            np.testing.assert_array_equal(getattr(result, name), getattr(numpy[0], name))
        assert (result.extra, result.shadow) == (numpy[0].extra, numpy[0].shadow)


def lossy_clock(nic: str, loss: str, tp=4, transport="retransmit", **kwargs) -> dict:
    net = LossyNetwork(tp, loss, transport=transport, nic=nic, seed=5, **kwargs)
    x = torch.zeros(tp, 362 * 60)
    for _ in range(5):
        net.all_reduce("s", "fwd", x, range(tp))
        net.all_gather("s", "fwd", x[:, :362 * 15], range(tp))
    return net.clock()


@pytest.mark.parametrize("nic", list(NIC_PRESETS))
def test_zero_loss_costs_the_loss_free_time_and_ideal_is_a_lower_bound(nic):
    kwargs = dict(ranks_per_node=2, link_inter="roce-200g")
    clean = lossy_clock(nic, "bernoulli:0", **kwargs)
    assert clean["comm_s"] == clean["ideal_comm_s"] == clean["comm_s_ideal_nic"] > 0
    assert clean["comm_s"] == lossy_clock("ideal", "none", transport="drop", **kwargs)["comm_s"]
    if NIC_PRESETS[nic].mode == "go_back_n":
        kwargs["loss_model"] = "bernoulli:0.03"
    lossy = lossy_clock(nic, kwargs.pop("loss_model", "ge:rate=0.05,burst=3"), **kwargs)
    assert lossy["comm_s_ideal_nic"] <= lossy["comm_s"] and lossy["comm_s_ideal_nic"] > clean["comm_s"]
    if nic == "ideal":
        assert lossy["comm_s_ideal_nic"] == lossy["comm_s"]


def test_what_receivers_get_does_not_depend_on_the_nic():
    """Only the clock moves: drop delivers the same packets, retransmit the same exact tensors."""
    x = torch.randn(4, 362 * 20, generator=torch.Generator().manual_seed(0))
    for transport in ("drop", "retransmit"):
        outs, clocks = [], []
        for nic in NIC_PRESETS:
            if transport == "retransmit" and NIC_PRESETS[nic].mode == "go_back_n":
                continue
            net = LossyNetwork(4, "bernoulli:0.2", transport=transport, nic=nic, seed=2)
            outs.append(net.all_reduce("s", "fwd", x, range(4)))
            clocks.append(net.clock()["comm_s"])
        assert all(torch.equal(outs[0], o) for o in outs)
        assert (len(set(clocks)) == 1) == (transport == "drop")


# Published bus bandwidths of large all-reduces (nccl-tests, 1 GiB and up) against the model's, for
# the link presets they back: (tp, ranks per node, intra, inter, GB/s, source).
PUBLISHED_BUSBW = [
    (8, 8, "nvlink4", "ib-ndr400", 370, "8 x H100, NCCL_ALGO=Ring (NVIDIA/nccl-tests#212)"),
    (8, 8, "nvlink3", "ib-hdr200", 232.5, "8 x A100 SXM4 (NVIDIA/nccl-tests#175)"),
    (16, 8, "nvlink3", "ib-hdr200", 192, "2 x DGX-A100, 8 x HDR 200G (NVIDIA/nccl#812)"),
    (2, 1, "nvlink4", "ib-ndr400", 48.5, "ConnectX-7 NDR: 48-49 GB/s per NIC (NVIDIA/nccl-tests#267)"),
]


@pytest.mark.parametrize("tp,per_node,intra,inter,published,source", PUBLISHED_BUSBW)
def test_large_all_reduces_reach_the_published_bus_bandwidth(tp, per_node, intra, inter, published, source):
    """Within 5% of what nccl-tests measured on the hardware the presets describe."""
    from lossysim.net.algorithms import schedule
    from lossysim.net.spec import NetworkSpec
    from lossysim.net.transfer import loss_free_time
    spec = NetworkSpec(tp, "none", ranks_per_node=per_node, link_intra=intra, link_inter=inter)
    size = 2 ** 30
    t = loss_free_time(spec, schedule("ring", "all_reduce", tp, 1), size, spec.payload_bytes)
    assert timing.busbw("all_reduce", tp, size, t) / 1e9 == pytest.approx(published, rel=0.05), source


# What each preset charges, by hand. One connection of 20 packets in its last step (TAU 0.12 us, RTT
# 6 us, go-back-N window 8); the tails are the last `dupacks` packets (TCP: 3). Timers at RTT 6 us:
# ideal 6 us; irn 100 us; srd 3 RTT = 18 us; roce-gbn 2 ms x 2^s: 2, 4, 8, 16 ms, then 4.29 s;
# roce-gbn-timeout 4.096 us x 2^20 = 4.294967296 s; tcp: the probe at the last ACK (RTT) + 201 ms with one
# packet out (2 RTT + 200 ms, capped by the RTO SRTT + 200 ms = 200.006 ms, both 201 jiffies), then the
# RTO 0.201 s doubling. 20 packets end before any loss is known (a 50-packet window later): no cut.
GBN_TIMEOUT = 4.096e-6 * 2 ** 20
TAIL = {"ideal": RTT, "irn": 100e-6, "srd": 3 * RTT, "roce-gbn": 2e-3, "roce-gbn-timeout": GBN_TIMEOUT,
        "tcp": RTT + 0.201, "tcp-bbr": RTT + 0.201}
SECOND = {"ideal": RTT, "irn": 100e-6, "srd": 3 * RTT, "roce-gbn": 4e-3, "roce-gbn-timeout": GBN_TIMEOUT,
          "tcp": 0.201, "tcp-bbr": 0.201}
THIRD = {"ideal": RTT, "irn": 100e-6, "srd": 3 * RTT, "roce-gbn": 8e-3, "roce-gbn-timeout": GBN_TIMEOUT,
         "tcp": 0.402, "tcp-bbr": 0.402}
# A lost resend with nothing sent after it: the tail timer; TCP's, in recovery (no probe), the RTO from the
# resend (tests/test_tcp.py: one with the stream still going on behind it is found a round trip later).
AGAIN = {**TAIL, "tcp": 0.201, "tcp-bbr": 0.201}
NAK = RTT - WINDOW * TAU   # go-back-N: the NAK returns while the 8 packets behind the loss go out


def scripted(rounds):
    """A draw that loses, round by round, the k-th transmissions of the round that ``rounds`` lists."""
    it = iter(rounds)

    def draw(lengths, known=True):
        lost = torch.zeros(len(lengths), int(lengths.max()), dtype=torch.bool)
        for k in next(it, ()):
            lost[0, k] = True
        return lost, lambda used: None
    return draw


def hand(name, rounds, packets=20):
    """extra seconds and transmissions of one scripted connection (rounds: the k-th transmissions lost)."""
    nic = NIC_PRESETS[name]
    r = run_step(Transport("retransmit", nic.mode), nic, one_connection(nic, packets), scripted(rounds), math.inf)
    return r.extra, int(r.transmissions[0])


@pytest.mark.parametrize("name", list(NIC_PRESETS))
def test_one_loss_mid_stream_costs_a_resend_and_a_round_trip(name):
    """Packet 5 lost. Selective: 1 resend + RTT = 6.12 us, 21 sent. Go-back-N: 14 out in round 0 (5, the
    lost one, 8 behind it), then 15 from packet 5: 29 sent, 9 TAU + (RTT - 8 TAU) = 6.12 us too."""
    got, sent = hand(name, [[5]])
    assert got == pytest.approx(TAU + RTT, abs=1e-12)
    assert sent == (29 if NIC_PRESETS[name].mode == "go_back_n" else 21)


@pytest.mark.parametrize("name", list(NIC_PRESETS))
def test_one_loss_at_the_tail_waits_the_presets_timer(name):
    """Packet 19 lost, nothing behind it: 1 resend + the tail timer (TAIL)."""
    got, sent = hand(name, [[19]])
    assert got == pytest.approx(TAU + TAIL[name], abs=1e-12) and sent == 21


@pytest.mark.parametrize("name", list(NIC_PRESETS))
def test_two_losses_in_one_round(name):
    """Packets 3 and 11 lost. Selective: both resent after one RTT, 2 TAU + RTT. Go-back-N: 3 stops the
    round at 12 packets (11 was among the 8 thrown away anyway), then 17 from packet 3: 29 sent,
    9 TAU + (RTT - 8 TAU)."""
    got, sent = hand(name, [[3, 11]])
    if NIC_PRESETS[name].mode == "go_back_n":
        assert got == pytest.approx(9 * TAU + NAK, abs=1e-12) and sent == 29
    else:
        assert got == pytest.approx(2 * TAU + RTT, abs=1e-12) and sent == 22


@pytest.mark.parametrize("name", list(NIC_PRESETS))
def test_a_resend_lost_again(name):
    """Packet 5 lost, its resend lost too. Selective: RTT, then the lone resend is its round's tail: the
    tail timer (AGAIN; TCP's resend goes out after the 20 packets, a window of 50 on, and waits the RTO),
    2 resends. Go-back-N: round 0 sends 14, round 1 the resend and 8 behind it (9), round 2 the 15 from
    packet 5: 38 sent, 18 TAU + 2 (RTT - 8 TAU)."""
    got, sent = hand(name, [[5], [0]])
    if NIC_PRESETS[name].mode == "go_back_n":
        assert got == pytest.approx(18 * TAU + 2 * NAK, abs=1e-12) and sent == 38
    else:
        assert got == pytest.approx(2 * TAU + RTT + AGAIN[name], abs=1e-12) and sent == 22


@pytest.mark.parametrize("name", ["roce-gbn", "roce-gbn-timeout"])
def test_go_back_n_resends_the_window_behind_a_loss(name):
    """Packet 15 lost: 4 packets behind it go out and are thrown away (fewer than the window of 8);
    the NAK comes RTT - 4 TAU after, then 16..20 again: 20 + 5 = 25 sent, 5 TAU + RTT - 4 TAU."""
    got, sent = hand(name, [[15]])
    assert got == pytest.approx(TAU + RTT, abs=1e-12) and sent == 25


@pytest.mark.parametrize("name", list(NIC_PRESETS))
def test_a_tail_lost_three_times_backs_off(name):
    """Packet 19 lost, then its resend twice: 3 resends and the tail timers in a row (TCP: the probe,
    the RTO, its double; roce-gbn: 6, 8, 16 us)."""
    got, sent = hand(name, [[19], [0], [0]])
    assert got == pytest.approx(3 * TAU + TAIL[name] + SECOND[name] + THIRD[name], abs=1e-12) and sent == 23


@pytest.mark.parametrize("name", list(NIC_PRESETS))
def test_a_step_waits_for_its_slowest_send(name):
    """Two sends: 0 (20 packets, its link's last step) loses its tail; 1 (20 packets on a link twice as
    slow and far, TAU 0.24 us and RTT 12 us, not its last step) loses 3 and 11. The step costs the larger:
    TAU + TAIL against 2 x 2 TAU + 2 RTT (go-back-N: 2 x (9 TAU + NAK))."""
    nic = NIC_PRESETS[name]
    f64 = dict(dtype=torch.float64)
    tails = torch.zeros(2, 20, dtype=torch.bool)
    tails[0, 20 - nic.dupacks:] = True
    sends = Sends(torch.tensor([20, 20]), torch.tensor([TAU, 2 * TAU], **f64), torch.tensor([RTT, 2 * RTT], **f64),
                  torch.tensor([WINDOW, WINDOW]), torch.tensor([True, False]), tails, torch.tensor([nic.dupacks, 0]))
    rounds = iter([[(0, 19), (1, 3), (1, 11)]])

    def draw(lengths, known=True):
        lost = torch.zeros(len(lengths), int(lengths.max()), dtype=torch.bool)
        for send, k in next(rounds, ()):
            lost[send, k] = True
        return lost, lambda used: None
    got = run_step(Transport("retransmit", nic.mode), nic, sends, draw, math.inf).extra
    second = 2 * (9 * TAU + NAK) if nic.mode == "go_back_n" else 2 * (2 * TAU + RTT)
    assert got == pytest.approx(max(TAU + TAIL[name], second), abs=1e-12)


@pytest.mark.parametrize("preset", ["tcp", "tcp-bbr"])
@pytest.mark.parametrize("retries", [None, 1])
def test_tcps_rounds_compiled_are_numpys_rounds_to_the_bit(preset, retries):
    """TCP's steps (RACK's waits per connection, the windows carried) through ``rounds``' compiled
    bookkeeping and through numpy's passes, on the same fates: the same Result, floats and windows to the
    bit, and the same losses counted each round. Sends of 1 to 4 connections, a link's last step or not,
    scattered and heavy loss (so later rounds lose again), windows fresh and carried from a step before."""
    nic = replace(NIC_PRESETS[preset], retries=retries)
    assert rounds.kernels() is not None, "the dev extra installs numba"
    rng = np.random.default_rng(7)
    rounds_seen = 0
    for k in (1, 2, 4):
        for p in (0.003, 0.05, 0.3):
            n = 12
            packets = rng.integers(k, 2000, size=n)
            f64 = dict(dtype=torch.float64)
            rtt = torch.from_numpy(10 ** rng.uniform(-6, -4, size=n))
            host = Sends(torch.from_numpy(packets), rtt / 10 ** torch.from_numpy(rng.uniform(0.5, 3, size=n)), rtt,
                         torch.full((n,), WINDOW), torch.from_numpy(rng.random(n) < 0.7),
                         torch.zeros(n, int(packets.max()), dtype=torch.bool), torch.zeros(n, dtype=torch.int64),
                         connections=k).host()
            seed = int(rng.integers(2 ** 31))
            before = None
            for _ in range(2):     # the second step starts from the windows the first left
                results = []
                for which in (None, rounds.kernels()):
                    fates, counted = np.random.default_rng(seed), []

                    def draw(to_send, width):
                        return np.flatnonzero(fates.random((n, width)) < p)

                    def count(row, column, to_send):
                        counted.append((row.tolist(), column.tolist(), to_send.tolist()))
                    with pytest.MonkeyPatch.context() as patch:
                        patch.setattr(rounds, "kernels", lambda: which)
                        start = None if before is None else before.copy()
                        results.append((selective(nic, host, draw, count, math.inf, give_up=False, windows=start),
                                        counted))
                (numpy, numpy_counted), (compiled, compiled_counted) = results
                assert compiled_counted == numpy_counted
                rounds_seen += len(numpy_counted)
                for name in ("missing_row", "missing_packet", "transmissions", "timeouts", "failed", "windows"):
                    a, b = getattr(compiled, name), getattr(numpy, name)
                    assert (a is None) == (b is None) and (a is None or np.asarray(a).tobytes() == b.tobytes()), name
                assert (compiled.extra, compiled.shadow) == (numpy.extra, numpy.shadow)
                before, seed = numpy.windows, seed + 1
    assert rounds_seen > (60 if retries is None else 30)    # (one retry: two rounds a step at most)
