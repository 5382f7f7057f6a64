"""TCP as Linux runs it, by hand: RACK-TLP and the RTO (tcp_output.c, tcp_recovery.c, tcp_timer.c) in
jiffies at HZ = 1000, and CUBIC's congestion window, whose throughput under a loss every 1/p packets is
the response function sqrt(3 / (2 p)) packets per round trip (RFC 9438 section 5, Mathis et al.)."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from lossysim.net.transport import Sends, Transport, run_step
from lossysim.timing.retransmission import (CUBIC_BETA, NIC_PRESETS, congestion_delay_s, linux_tcp_timer_s,
                                            response_packets_per_rtt)
from test_repairs import scripted

TCP, BBR = NIC_PRESETS["tcp"], NIC_PRESETS["tcp-bbr"]
TAU, RTT = 1e-7, 1e-5        # pipe = RTT / TAU = 100 packets
ALPHA = 3 * (1 - CUBIC_BETA) / (1 + CUBIC_BETA)   # 921 / 1741 = 0.52901...
PS = 1e-12


def one_send(packets: int, tails: int = 3) -> Sends:
    mask = torch.zeros(1, packets, dtype=torch.bool)
    mask[0, packets - tails:] = True
    f64 = dict(dtype=torch.float64)
    return Sends(torch.tensor([packets]), torch.tensor([TAU], **f64), torch.tensor([RTT], **f64),
                 torch.tensor([8]), torch.tensor([True]), mask, torch.tensor([tails]))


def extra(nic, packets, rounds) -> float:
    return run_step(Transport("retransmit", nic.mode), nic, one_send(packets), scripted(rounds), math.inf).extra


def test_the_timers_are_the_kernels_in_jiffies():
    """RTT 10 us: RTO = srtt + rttvar floored at 200 ms = 200.010 ms -> 201 jiffies = 0.201 s. The probe,
    armed at the last ACK a round trip after the send: 2 srtt + 2 ms = 2.020 ms -> 3 jiffies, or with one
    packet out 2 srtt + 200 ms = 200.020 ms -> 201 jiffies, capped by the RTO (201): 0.201 s. Then the RTO
    doubles: 0.402, 0.804, ... until 120 s."""
    srtt = torch.tensor([RTT] * 5, dtype=torch.float64)
    timeouts = torch.tensor([0, 0, 1, 2, 14])
    one = torch.tensor([False, True, False, False, False])
    got = linux_tcp_timer_s(srtt, timeouts, one).tolist()
    for g, want in zip(got, [RTT + 0.003, RTT + 0.201, 0.201, 0.402, 120.0]):
        assert g == pytest.approx(want, abs=PS)
    # RACK: reo_wnd = min_rtt / 4 = 2.5 us, + TCP_TIMEOUT_MIN_US = 2.0025 ms -> 3 jiffies, after the SACK's round trip
    assert float(TCP.reorder_s(srtt[:1])) == pytest.approx(RTT + 0.003, abs=PS)


@pytest.mark.parametrize("nic", [TCP, BBR])
def test_what_one_loss_costs_by_where_it_falls(nic):
    """20 packets, the last three tails (fewer than 3 SACKs behind them). A loss at 16 has 3 SACKed
    behind: one round trip. At 17 or 18 some arrived behind: RACK's reordering timer. At 19 nothing:
    the probe, with one packet out (0.201 s); 18 and 19 both lost: two out, 3 ms. Each loss is known
    a window (100 packets) after it, past the send's end: no window cut."""
    assert extra(nic, 20, [[16]]) == pytest.approx(TAU + RTT, abs=PS)
    for k in (17, 18):
        assert extra(nic, 20, [[k]]) == pytest.approx(TAU + RTT + 0.003, abs=PS)
    assert extra(nic, 20, [[19]]) == pytest.approx(TAU + RTT + 0.201, abs=PS)
    assert extra(nic, 20, [[18, 19]]) == pytest.approx(2 * TAU + RTT + 0.003, abs=PS)


@pytest.mark.parametrize("nic", [TCP, BBR])
def test_a_probe_lost_waits_the_rto_then_it_doubles(nic):
    """The tail (19) lost, its probe lost, the RTO's resend lost, then through: 3 resends, waits
    probe (10 us + 0.201 s), RTO 0.201 s, doubled 0.402 s."""
    got = extra(nic, 20, [[19], [0], [0], []])
    assert got == pytest.approx(3 * TAU + (RTT + 0.201) + 0.201 + 0.402, abs=PS)


def test_cubic_cuts_the_window_at_a_loss_and_bbr_does_not():
    """400 packets, packet 5 lost. Known a window later, at 105: the window (100, the pipe) is cut to
    beta 100 = 70.02 and grows alpha = 0.52901 a round trip over the 295 packets left: w' = sqrt(70.02^2 +
    2 alpha 295) = 72.214, taking (w' - 70.02) / alpha = 4.148 round trips = 41.48 us where the pipe
    takes 29.5 us: 11.98 us more, on top of the resend and its round trip."""
    w0 = 100 * CUBIC_BETA
    w1 = math.sqrt(w0 ** 2 + 2 * ALPHA * 295)
    window = (w1 - w0) / ALPHA * RTT - 295 * TAU
    assert window == pytest.approx(11.98e-6, abs=0.01e-6)
    assert extra(TCP, 400, [[5]]) == pytest.approx(TAU + RTT + window, abs=PS)
    assert extra(BBR, 400, [[5]]) == pytest.approx(TAU + RTT, abs=PS)
    # a second loss within the window behind the first is the same episode: one cut
    assert extra(TCP, 400, [[5, 50]]) == pytest.approx(2 * TAU + RTT + window, abs=PS)


@pytest.mark.parametrize("p", [0.001, 0.01, 0.05])
@pytest.mark.parametrize("window", ["cubic", "reno"])
def test_throughput_under_periodic_loss_is_the_response_function(p, window):
    """A loss every 1/p packets, the pipe far above the window: each extra cycle of 1/p packets takes
    1/p / (sqrt(3 / (2 p)) / rtt) seconds, for CUBIC (beta 0.7, alpha 0.529) as for Reno (1/2, 1).
    At 0.1%, 1%, 5%: 38.73, 12.25, 5.477 packets per round trip."""
    nic = replace(TCP, window=window)
    tau, rtt, gap = 1e-8, 1e-5, round(1 / p)            # pipe: 1000 packets
    assert response_packets_per_rtt(p) == pytest.approx({0.001: 38.730, 0.01: 12.247, 0.05: 5.4772}[p], abs=1e-3)

    def seconds(cycles):
        n = cycles * gap
        return n * tau + congestion_delay_s(nic, n, np.arange(gap - 1, n, gap), tau, rtt)
    rate = 100 * gap / (seconds(300) - seconds(200))   # packets a second, past the start's transient
    assert rate * rtt == pytest.approx(response_packets_per_rtt(p), rel=1e-9)


@pytest.mark.parametrize("p", [0.001, 0.01, 0.05])
def test_throughput_under_random_loss_is_near_the_response_function(p):
    """Bernoulli gaps vary, and at 5% several losses fall in one episode: the flow gets somewhat more
    than under periodic loss, within [1, 1.3] x the response function (seeded)."""
    rng = np.random.default_rng(1)
    tau, rtt, n = 1e-8, 1e-5, int(2000 / p)
    lost = np.flatnonzero(rng.random(n) < p)
    ratio = n / (n * tau + congestion_delay_s(TCP, n, lost, tau, rtt)) * rtt / response_packets_per_rtt(p)
    assert 1.0 <= ratio <= 1.3
    assert congestion_delay_s(BBR, n, lost, tau, rtt) == 0.0
