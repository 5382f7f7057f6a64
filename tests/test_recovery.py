"""Recovery policies beside zero and rescale: hadamard, hadamard+rescale, stale and error_feedback.

Every policy applies to any all-reduce through the network, so the tests drive ``LossyNetwork``
directly, then the tensor-parallel model. What a policy did is checked against what it should have
done given the masks the network drew (read back by wrapping the policy's ``draw``) and the
Hadamard signs it drew (wrapping ``Memory.signs``), never against a previous run.
"""
from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from scipy import stats

from lossysim import LossyNetwork, parallelize
from lossysim.config import ExperimentConfig
from lossysim.net import delivery as deliver
from lossysim.net import recovery
from lossysim.net.algorithms import ALGORITHMS, IN_SWITCH
from lossysim.net.receivers import combine
from lossysim.net.spec import NetworkSpec
from lossysim.timing import parse_compute

ALPHA = 1e-5  # p-value threshold of the statistical checks
POLICIES = recovery.RECOVERY_POLICIES
# A send-by-send policy replays every send between ranks: NVLS reduces in the switch, and is refused.
HOP_BY_HOP = [a for a in ALGORITHMS if a not in IN_SWITCH]
PAIRS = [(p, a) for p in POLICIES for a in ALGORITHMS if a in HOP_BY_HOP or not recovery.policy(p).send_by_send]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def powers_of_two(tp: int, n: int, dtype=torch.float64) -> torch.Tensor:
    return torch.stack([torch.full((n,), 2.0**r, dtype=dtype) for r in range(tp)])


@pytest.fixture
def draws(monkeypatch):
    """Every draw of a send-by-send policy (its ``Hops``: schedule and lost packets per send), in order."""
    seen = []
    draw = recovery.SendBySend.draw

    def recorded(self, *args, **kwargs):
        out = draw(self, *args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(recovery.SendBySend, "draw", recorded)
    return seen


@pytest.fixture
def signs(monkeypatch):
    """Every call's Hadamard sign bits, in order."""
    seen = []
    draw = recovery.Memory.signs

    def recorded(self, numel):
        bits = draw(self, numel)
        seen.append(bits)
        return bits

    monkeypatch.setattr(recovery.Memory, "signs", recorded)
    return seen


# -- without loss: the plain sum ------------------------------------------------------------------
@pytest.mark.parametrize("policy, algorithm", PAIRS)
def test_loss_free_every_policy_returns_the_plain_sum(policy, algorithm):
    """Through the policy's own path (the links could lose packets, none of them does): sizes not
    divisible by the block, by a packet or by tp_size, several calls so what a policy keeps is used."""
    g = torch.Generator().manual_seed(7)
    for tp in range(1, 9):
        net = LossyNetwork(tp, "bernoulli:0.5", algorithm=algorithm, recovery=policy, payload_bytes=64,
                           hadamard_block=64, ranks_per_node=tp, lossy_links="inter_node")
        for n in (1, 5, 7 * 16 + 3, 64 * 3 + 17, 16 * tp * 3, 1000, 1000, 64 * 5 + 1):
            x = torch.randn(tp, n, generator=g)
            out = net.all_reduce("s", "bwd", x, range(tp))
            torch.testing.assert_close(out, x.sum(0).expand(tp, n), rtol=1e-5, atol=1e-5)
        if tp > 1 and recovery.policy(policy).computes:
            assert net.clock()["recovery_s"] > 0  # the policy ran
    net = LossyNetwork(3, "bernoulli:0.5", algorithm=algorithm, recovery=policy, ranks_per_node=3,
                       lossy_links="inter_node")   # the default block, more than the message
    x = torch.randn(3, 362 * 3 + 1, generator=g)
    torch.testing.assert_close(net.all_reduce("s", "bwd", x, range(3)), x.sum(0).expand(3, -1), rtol=1e-5,
                               atol=1e-5)


def test_the_hadamard_transform_is_orthonormal_and_its_own_inverse():
    """Against the Sylvester matrix built by Kronecker products; blocks of a remainder included."""
    for bits in range(0, 9):
        size = 2**bits
        h = torch.ones(1, 1, dtype=torch.float64)
        for _ in range(bits):
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        y = torch.randn(3, 2, size, dtype=torch.float64)
        torch.testing.assert_close(recovery.walsh_hadamard(y), y @ h / math.sqrt(size))
    assert recovery.blocks(1000, 256) == [(0, 3, 256), (768, 1, 128), (896, 1, 64), (960, 1, 32), (992, 1, 8)]
    assert recovery.blocks(100, 4096) == [(0, 1, 64), (64, 1, 32), (96, 1, 4)]
    x = torch.randn(2, 1000, dtype=torch.float64)
    bits = torch.randint(0, 2, (1000,), dtype=torch.uint8)
    y = recovery.transform(x, bits, 256)
    torch.testing.assert_close(y.norm(dim=1), x.norm(dim=1))
    torch.testing.assert_close(recovery.inverse(y, bits, 256), x)


# -- hadamard: a lost packet becomes noise spread over its block -----------------------------------
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_hadamard_error_is_what_the_lost_coefficients_carry(algorithm, signs):
    """Bernoulli loss: the receivers hold the inverse transform of what the zero policy delivers of the
    transformed messages (the same masks), so, block by block, the squared error equals the squared
    error of the transformed coefficients: the energy a lost packet took is what comes back as noise,
    spread over the whole block."""
    tp, block, n = 4, 256, 256 * 5 + 100
    spec = dict(seed=3, algorithm=algorithm, payload_bytes=64, hadamard_block=block)
    net = LossyNetwork(tp, "bernoulli:0.1", recovery="hadamard", **spec)
    zero = LossyNetwork(tp, "bernoulli:0.1", recovery="zero", **spec)
    g = torch.Generator().manual_seed(1)
    spread = []
    for _ in range(6):
        x = torch.randn(tp, n, generator=g, dtype=torch.float64)
        out = net.all_reduce("s", "bwd", x, range(tp))
        bits = signs[-1]
        coefficients = zero.all_reduce("s", "bwd", recovery.transform(x, bits, block), range(tp))
        torch.testing.assert_close(out, recovery.inverse(coefficients, bits, block))
        error = out - x.sum(0)
        lost = coefficients - recovery.transform(x.sum(0), bits, block)
        for start, count, size in recovery.blocks(n, block):
            for b in range(count):
                part = slice(start + b * size, start + (b + 1) * size)
                torch.testing.assert_close(error[:, part].pow(2).sum(1), lost[:, part].pow(2).sum(1))
                hit = lost[:, part].abs().amax(1) > 1e-6        # (not rounding: a lost coefficient)
                spread += (error[hit, part].abs() > 1e-12).double().mean(1).tolist()
        assert (lost.abs() > 1e-6).any()
    # where a coefficient was lost, (almost) every element of its block carries some of it
    assert len(spread) > 10 and np.mean(spread) > 0.99


def test_hadamard_largest_error_falls_as_one_over_root_block():
    """Direct exchange, tp 2, calls where exactly one packet of the peer was lost: the largest
    element error against zero's falls as about block**-1/2 (the lost packet's energy spread over
    the block; extreme-value theory adds sqrt(ln block), so the expected slope is -0.45). The slope
    per call, over many calls: its 1 - 1e-5 interval lies inside [-0.55, -0.35]; no spreading
    (slope 0) or a 1/block fall (slope -1) is rejected."""
    n, p = 1 << 16, 0.005
    blocks = [1 << 10, 1 << 12, 1 << 14, 1 << 16]
    nets = {b: LossyNetwork(2, f"bernoulli:{p}", seed=1, algorithm="direct", recovery="hadamard",
                            hadamard_block=b) for b in blocks}
    zero = LossyNetwork(2, f"bernoulli:{p}", seed=1, algorithm="direct")
    per = 362  # fp32 elements per 1450-byte packet
    g = torch.Generator().manual_seed(0)
    logs = []
    for _ in range(120):
        x = torch.randn(2, n, generator=g, dtype=torch.float64)
        total = x.sum(0)
        zero_error = zero.all_reduce("s", "fwd", x, [0, 1]) - total
        lost_packets = (zero_error[:, ::per] != 0).sum(1)
        largest = torch.stack([(nets[b].all_reduce("s", "fwd", x, [0, 1]) - total).abs().amax(1)
                               for b in blocks], 1)
        for r in range(2):
            if lost_packets[r] == 1:
                logs.append(torch.log(largest[r] / zero_error[r].abs().amax()).numpy())
    logs = np.array(logs)
    slopes = np.polyfit(np.log(blocks), logs.T, 1)[0]
    assert len(slopes) > 40
    low, high = stats.t.interval(1 - ALPHA, len(slopes) - 1, slopes.mean(), stats.sem(slopes))
    assert -0.55 < low and high < -0.35, (slopes.mean(), low, high)
    assert stats.ttest_1samp(slopes, 0.0).pvalue < ALPHA and stats.ttest_1samp(slopes, -1.0).pvalue < ALPHA
    # and it is smaller than zero's from the smallest block on, by about sqrt(packet / block)
    assert (logs[:, 0] < 0).mean() > 0.9
    ratio = np.exp(logs.mean(0))
    expected = np.sqrt(per / np.array(blocks))
    assert np.all((ratio > 0.4 * expected) & (ratio < 1.6 * expected)), (ratio, expected)


# -- unbiasedness --------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_hadamard_rescale_is_unbiased_and_hadamard_is_not(algorithm):
    """Mean over calls of each receiver's error (t-test): unbiased with rescale inside the transform;
    without it the transform spreads zero's bias (the lost share of the sum) but keeps it."""
    tp, calls = 4, 300
    x = torch.stack([torch.full((200,), v) for v in (1.0, -2.0, 3.0, 7.0)]).double()
    truth = x.sum(0)
    for policy, unbiased in (("hadamard+rescale", True), ("hadamard", False)):
        net = LossyNetwork(tp, "bernoulli:0.2", seed=5, payload_bytes=64, algorithm=algorithm, recovery=policy,
                           hadamard_block=64)
        errors = torch.stack([(net.all_reduce("s", "bwd", x, range(tp)) - truth).mean(1) for _ in range(calls)])
        for receiver in range(tp):
            p = stats.ttest_1samp(errors[:, receiver].numpy(), 0.0).pvalue
            assert (p > ALPHA) if unbiased else (p < ALPHA), (policy, receiver, p)


# -- stale and error feedback, send by send ----------------------------------------------------------
def reference(calls, hops: list, per: int, policy: str) -> list[np.ndarray]:
    """What every rank holds after each call, computed element by element from the schedule's sends in
    order (an independent implementation of the send-by-send semantics): a send carries what its
    sender holds (an exchange: its own message); a reduce or exchange adds what arrives, an all-gather
    or broadcast holds it. stale: a lost packet takes the last payload that arrived on that send
    (nothing yet: zero). error_feedback: a send adds what it owes; a lost packet is owed."""
    memory, out = {}, []
    for x, drawn in zip(calls, hops):
        sched, lost = drawn.sched, drawn.lost.numpy()
        x = x.numpy()
        held, n = x.copy(), x.shape[1]
        for i, s in sorted(enumerate(sched.sends), key=lambda item: item[1].step):
            source = x if s.phase == "exchange" else held
            for k in range(s.packets):
                part = slice((s.first + k) * per, min(n, (s.first + k + 1) * per))
                payload = source[s.src, part].copy()
                if policy == "error_feedback":
                    payload = payload + memory.get((i, k), 0.0)
                if lost[i, k]:
                    taken = memory.get((i, k), np.zeros_like(payload)) if policy == "stale" else 0.0 * payload
                    if policy == "error_feedback":
                        memory[(i, k)] = payload
                else:
                    taken = payload
                    memory[(i, k)] = payload if policy == "stale" else 0.0
                if s.phase in ("reduce_scatter", "reduce", "exchange"):
                    held[s.dst, part] += taken
                else:
                    held[s.dst, part] = taken
        out.append(held)
    return out


@pytest.mark.parametrize("policy", ["stale", "error_feedback"])
@pytest.mark.parametrize("algorithm", HOP_BY_HOP)
@pytest.mark.parametrize("tp", [2, 3, 5])
def test_send_by_send_policies_match_an_element_by_element_reference(policy, algorithm, tp, draws):
    """Exactly (float64 powers of two, so every order of additions gives the same bits), over calls
    whose contributions change, with Gilbert-Elliott bursts across calls."""
    per = 4
    net = LossyNetwork(tp, "ge:rate=0.2,burst=3", seed=tp, payload_bytes=32, algorithm=algorithm, recovery=policy)
    n = per * 9 * tp + 3
    calls = [powers_of_two(tp, n) * (3.0**c) for c in range(6)]
    outs = [net.all_reduce("s", "bwd", x, range(tp)).numpy() for x in calls]
    for got, expected in zip(outs, reference(calls, draws, per, policy)):
        np.testing.assert_array_equal(got, expected)
    assert sum(row["lost"] for row in net.stats()) > 5


@pytest.mark.parametrize("algorithm", HOP_BY_HOP)
def test_send_by_send_without_memory_is_what_combine_says(algorithm, draws):
    """The send-by-send run with zero's rule (a lost packet carries nothing) gives what ``combine`` and
    the delivery give from the same lost packets: two independent implementations of one semantics."""
    for tp in (2, 3, 5, 8):
        net = LossyNetwork(tp, "bernoulli:0.2", seed=tp, payload_bytes=32, algorithm=algorithm, recovery="stale")
        x = powers_of_two(tp, 4 * 13 * tp + 1)
        net.all_reduce("s", "bwd", x, range(tp))
        drawn = draws[-1]
        nothing_kept = deliver.send_by_send(
            x, drawn.sched, drawn.lost, 4, lambda hop, payload, lost: torch.where((hop.valid & ~lost)[..., None],
                                                                                 payload, 0))
        plain = deliver.all_reduce(x, combine(drawn.sched, drawn.lost), range(tp), 4, False, lambda seen: None)
        assert torch.equal(nothing_kept, plain)
        assert drawn.lost.any()


def test_stale_fills_the_values_that_arrived_before():
    """Direct exchange: element by element, a receiver holds its own value, each peer's value of this
    call if its packet arrived, else the value of the last call whose packet arrived, else nothing.
    Contributions are bits (rank r, call c: 2**(tp * c + r)), so the sum says which call each came
    from. The first call is zero's."""
    tp, per, calls = 3, 4, 6
    net = LossyNetwork(tp, "bernoulli:0.4", seed=2, payload_bytes=32, algorithm="direct", recovery="stale")
    zero = LossyNetwork(tp, "bernoulli:0.4", seed=2, payload_bytes=32, algorithm="direct", recovery="zero")
    n = per * 30
    last = np.full((tp, tp, n), -1)           # [receiver, sender, element]: the call whose value it holds
    filled = 0
    for c in range(calls):
        x = torch.stack([torch.full((n,), 2.0 ** (tp * c + r), dtype=torch.float64) for r in range(tp)])
        out = net.all_reduce("s", "bwd", x, range(tp)).to(torch.int64)
        if c == 0:
            assert torch.equal(out, zero.all_reduce("s", "bwd", x, range(tp)).to(torch.int64))
        for i in range(tp):
            for j in range(tp):
                came = [[(int(v) >> (tp * k + j)) & 1 for k in range(c + 1)] for v in out[i]]
                for e, bits in enumerate(came):
                    assert sum(bits) <= 1, (c, i, j, e, bits)
                    now = bits[c] == 1
                    if i == j:
                        assert now
                    elif not now:   # lost now: the last call that arrived, or nothing
                        expected = last[i, j, e]
                        assert (bits.index(1) if any(bits) else -1) == expected, (c, i, j, e)
                        filled += expected >= 0
                    else:
                        last[i, j, e] = c
    assert filled > 50


@pytest.mark.parametrize("algorithm", HOP_BY_HOP)
def test_error_feedback_conserves_the_sum(algorithm, draws):
    """The same contribution every call: what each receiver has been delivered, plus what the sends on
    its paths still owe, is exactly calls x the sum (every reduce-phase send, the forward sends from
    the chunk's owner or the root down to it, every exchange send to it). So the delivered total
    approaches the sent total: its mean relative error falls as 1/calls, while zero's stays at the
    lost share."""
    tp, per, calls = 4, 4, 200
    spec = dict(seed=11, payload_bytes=32, algorithm=algorithm)
    net = LossyNetwork(tp, "bernoulli:0.2", recovery="error_feedback", **spec)
    zero = LossyNetwork(tp, "bernoulli:0.2", recovery="zero", **spec)
    x = torch.randn(tp, per * 10 * tp + 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    total = x.sum(0)
    delivered = torch.zeros(tp, x.shape[1], dtype=torch.float64)
    zero_delivered = torch.zeros_like(delivered)
    for _ in range(calls):
        delivered += net.all_reduce("s", "bwd", x, range(tp))
        zero_delivered += zero.all_reduce("s", "bwd", x, range(tp))
    sched = draws[-1].sched
    owed = next(iter(net.channels.by_key[("s", "bwd")].memory.buffers.values()))["owed"]
    pending = torch.zeros_like(delivered)
    for i in range(tp):
        for p in range(sched.n_packets):
            on_path = owed_on_path(sched, i, p)
            part = slice(p * per, min(x.shape[1], (p + 1) * per))
            width = part.stop - part.start
            pending[i, part] = sum((owed[s, k, :width] for s, k in on_path), torch.zeros(width, dtype=torch.float64))
    torch.testing.assert_close(delivered + pending, calls * total.expand(tp, -1), rtol=1e-9, atol=1e-9)
    relative = ((delivered / calls - total).abs().mean() / total.abs().mean()).item()
    zero_relative = ((zero_delivered / calls - total).abs().mean() / total.abs().mean()).item()
    assert relative < 0.1 * zero_relative and relative < 0.02, (relative, zero_relative)
    assert pending.abs().sum() > 0


def owed_on_path(sched, receiver: int, packet: int) -> list[tuple[int, int]]:
    """(send, packet slot) of every send whose debt for ``packet`` is ``receiver``'s."""
    covering = [(i, s, packet - s.first) for i, s in enumerate(sched.sends) if s.first <= packet < s.first + s.packets]
    path = [(i, k) for i, s, k in covering if s.phase in ("reduce_scatter", "reduce")]
    path += [(i, k) for i, s, k in covering if s.phase == "exchange" and s.dst == receiver]
    forward = {s.dst: (i, s, k) for i, s, k in covering if s.phase in ("all_gather", "broadcast")}
    rank = receiver
    while rank in forward:                      # up the chain to the owner or the root
        i, s, k = forward[rank]
        path.append((i, k))
        rank = s.src
    return path


def test_error_feedback_on_activations_is_zero():
    """Forward traffic is never summed again later: error feedback leaves it to zero (same bits)."""
    x = torch.randn(4, 1000, generator=torch.Generator().manual_seed(2))
    outs = []
    for policy in ("error_feedback", "zero"):
        net = LossyNetwork(4, "bernoulli:0.2", seed=4, recovery=policy)
        outs.append([net.all_reduce("s", "fwd", x, range(4)) for _ in range(3)])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


# -- what every policy shares ------------------------------------------------------------------------
@pytest.mark.parametrize("policy, algorithm", PAIRS)
def test_an_all_reduce_in_place_leaves_the_same_bits(policy, algorithm):
    """``out=contributions`` (DDP's in-place bucket all-reduce) writes what the call would return,
    call after call (memory, stale values, error feedback carried on alike), and counts the same."""
    spec = dict(ranks=3, loss_model="ge:rate=0.15,burst=4", seed=5, payload_bytes=32, algorithm=algorithm,
                hadamard_block=64, recovery=policy)
    returned, in_place = LossyNetwork(**spec), LossyNetwork(**spec)
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        x = torch.randn(3, 5, 41 + i, generator=g)
        expected = returned.all_reduce("s", "bwd", x, range(3))
        buffer = x.clone()
        held = in_place.all_reduce("s", "bwd", buffer, range(3), out=buffer)
        assert held.data_ptr() == buffer.data_ptr() and torch.equal(buffer, expected), (policy, i)
    assert in_place.stats() == returned.stats() and in_place.clock() == returned.clock()


@pytest.mark.parametrize("policy, algorithm", PAIRS)
def test_each_receiver_alone_computes_the_same_bits(policy, algorithm):
    """What dist does (one receiver per process, every link drawn, its own memory) equals the
    simulator's row, call after call, and the same packets are lost whatever the policy."""
    tp = 4
    spec = dict(ranks=tp, loss_model="ge:rate=0.15,burst=4", seed=9, payload_bytes=32, algorithm=algorithm,
                hadamard_block=64)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(tp, 3, 37 + i % 2, generator=g) for i in range(4)]
    every = LossyNetwork(recovery=policy, **spec)
    full = [every.all_reduce("s", "bwd", x, range(tp)) for x in xs]
    for r in range(tp):
        alone = LossyNetwork(recovery=policy, **spec)
        for x, expected in zip(xs, full):
            assert torch.equal(alone.all_reduce("s", "bwd", x, [r])[0], expected[r])
        assert alone.stats() == every.stats() and alone.clock() == every.clock()
    zero = LossyNetwork(recovery="zero", **spec)
    for x in xs:
        zero.all_reduce("s", "bwd", x, range(tp))
    assert zero.stats() == [row for row in every.stats() if row["site"] == "s"]   # not a side path's


@pytest.mark.parametrize("policy", ["hadamard", "hadamard+rescale", "stale", "error_feedback"])
def test_a_saved_network_goes_on_exactly(policy):
    """What a policy keeps (the signs' stream, per-send buffers) is saved and restored with the
    network: a restored network continues bit for bit; a fresh one does not."""
    tp = 3
    spec = dict(seed=5, payload_bytes=32, recovery=policy, hadamard_block=64)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(tp, 200, generator=g) for _ in range(6)]
    net = LossyNetwork(tp, "ge:rate=0.2,burst=3", **spec)
    for x in xs[:3]:
        net.all_reduce("s", "bwd", x, range(tp))
    buffer = io.BytesIO()
    torch.save(net.state_dict(), buffer)
    buffer.seek(0)
    restored = LossyNetwork(tp, "ge:rate=0.2,burst=3", **spec)
    restored.load_state_dict(torch.load(buffer, weights_only=False))
    later = [net.all_reduce("s", "bwd", x, range(tp)) for x in xs[3:]]
    for x, expected in zip(xs[3:], later):
        assert torch.equal(restored.all_reduce("s", "bwd", x, range(tp)), expected)
    assert restored.clock() == net.clock()
    # the memory mattered: a network that forgot it (same chains and streams) delivers other values
    forgetful = LossyNetwork(tp, "ge:rate=0.2,burst=3", **spec)
    forgetful.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
    for channel in forgetful.channels.by_key.values():
        channel.memory = recovery.Memory(5, "s", "bwd", "cpu")
    assert any(not torch.equal(forgetful.all_reduce("s", "bwd", x, range(tp)), expected)
               for x, expected in zip(xs[3:], later))


@pytest.mark.parametrize("policy", ["hadamard", "stale", "error_feedback"])
def test_a_replayed_call_repeats_itself_and_moves_nothing_on(policy):
    """A recomputed forward (activation checkpointing) replays a call: the same output, the same
    signs, and what the policy keeps is left as the original call left it; the clock charges the
    replayed sends and the policy's compute again (a real recomputation sends again)."""
    from collections import defaultdict, deque
    tp = 3
    spec = dict(seed=6, payload_bytes=32, recovery=policy, hadamard_block=64)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(tp, 300, generator=g) for _ in range(4)]
    net, plain = LossyNetwork(tp, "bernoulli:0.3", **spec), LossyNetwork(tp, "bernoulli:0.3", **spec)
    record = defaultdict(deque)
    for x in xs[:2]:
        with net.recording(record):
            first = net.all_reduce("s", "bwd", x, range(tp))
        with net.replaying(record):
            assert torch.equal(net.all_reduce("s", "bwd", x, range(tp)), first)
        assert torch.equal(plain.all_reduce("s", "bwd", x, range(tp)), first)
    for x in xs[2:]:
        assert torch.equal(net.all_reduce("s", "bwd", x, range(tp)), plain.all_reduce("s", "bwd", x, range(tp)))
    # drop transport: every call of this shape costs the same, and net made 4 calls plus 2 replays
    assert plain.clock()["recovery_s"] > 0
    for key in ("comm_s", "ideal_comm_s", "recovery_s"):
        assert net.clock()[key] == pytest.approx(plain.clock()[key] * 6 / 4, rel=1e-12)


def test_a_saved_state_records_the_policy_settings_it_depends_on():
    """hadamard_block and compute are recorded (and checked on load) only where the policy uses
    them: a zero or rescale network's state is what it was before these settings existed."""
    before = {"ranks", "loss_model", "seed", "payload_bytes", "recovery", "lossy", "max_burst", "algorithm",
              "ranks_per_node", "lossy_links", "transport", "retransmit", "deadline", "link_intra", "link_inter",
              "rto_s", "nic", "channels", "nics_per_node"}
    for policy, extra in (("zero", set()), ("rescale", set()), ("hadamard", {"hadamard_block", "compute"}),
                          ("stale", {"compute"}), ("error_feedback", {"compute"})):
        assert set(LossyNetwork(2, "bernoulli:0.1", recovery=policy).spec.as_dict()) == before | extra, policy
    state = LossyNetwork(2, "bernoulli:0.1", recovery="hadamard", hadamard_block=64).state_dict()
    with pytest.raises(ValueError, match="hadamard_block"):
        LossyNetwork(2, "bernoulli:0.1", recovery="hadamard", hadamard_block=128).load_state_dict(state)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_policys_capabilities_are_what_it_does(policy, monkeypatch):
    """Callers ask a policy what it can do rather than test its name: each attribute against the
    behaviour it stands for."""
    hops = []
    send_by_send = deliver.send_by_send
    monkeypatch.setattr(deliver, "send_by_send", lambda *args: hops.append(1) or send_by_send(*args))
    net = LossyNetwork(2, "bernoulli:0.2", seed=3, payload_bytes=64, recovery=policy, hadamard_block=16,
                       compute="flops=1e12,mfu=0.5")
    pol = net.recovery
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0))
    net.all_reduce("s", "bwd", x, range(2))
    assert (net.clock()["recovery_s"] > 0) == pol.computes
    assert bool(hops) == pol.send_by_send
    assert (net.channels.by_key[("s", "bwd")].memory is not None) == pol.keeps_memory
    assert (pol.side_bytes(256, torch.float32) > 0) == pol.side_path
    assert pol.on("fwd") is (pol if pol.on_activations else recovery.ZERO)
    assert {"hadamard_block", "outlier_fraction"} & set(net.spec.as_dict()) == set(pol.settings)
    if pol.acts_on_shards:
        net.reduce_scatter("s", "bwd", x, range(2))
    else:
        with pytest.raises(ValueError, match="does not act on reduce-scatters"):
            net.reduce_scatter("s", "bwd", x, range(2))
    assert (policy in recovery.SHARD_POLICIES) == pol.acts_on_shards


# -- the clock ---------------------------------------------------------------------------------------
def test_policy_compute_is_charged_at_the_gpu_rate():
    """recovery_s = calls x FLOPs / (peak x MFU): the transform and its inverse, n (log2 block + 2)
    each; error feedback an add and a select per element a rank sends, stale per element it receives
    (ring: 2 (R-1)/R of the message). It is in comm_s, not in retransmit_s; zero, rescale and
    measured compute charge nothing."""
    tp, block, n, calls = 4, 256, 256 * 8, 5
    rate = 1e12 * 0.5
    x = torch.randn(tp, n)
    expected = {"hadamard": 2 * n * (math.log2(block) + 2), "hadamard+rescale": 2 * n * (math.log2(block) + 2),
                "stale": 2 * 2 * (tp - 1) / tp * n, "error_feedback": 2 * 2 * (tp - 1) / tp * n,
                "zero": 0.0, "rescale": 0.0}
    for policy, flops in expected.items():
        net = LossyNetwork(tp, "bernoulli:0.1", seed=1, payload_bytes=64 * 4, recovery=policy, hadamard_block=block,
                           compute="flops=1e12,mfu=0.5")
        for _ in range(calls):
            net.all_reduce("s", "bwd", x, range(tp))
        clock = net.clock()
        assert clock["recovery_s"] == pytest.approx(calls * flops / rate, rel=1e-12), policy
        assert clock["comm_s"] == pytest.approx(clock["ideal_comm_s"] + clock["recovery_s"], rel=1e-12)
        assert clock["retransmit_s"] == 0.0
    measured = LossyNetwork(tp, "bernoulli:0.1", recovery="hadamard", compute="measured")
    measured.all_reduce("s", "bwd", x, range(tp))
    assert measured.clock()["recovery_s"] == 0.0
    assert parse_compute("flops=1e12,mfu=0.5").seconds(1e6) == pytest.approx(2e-6)


# -- settings ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings, needle", [
    (dict(recovery="error_feedback", lossy="fwd"), "lossy=bwd or both"),
    (dict(recovery="hadamard+rescale", transport="deadline"), "transport=deadline"),
    (dict(recovery="hadamard+rescale", loss="bernoulli:1"), "loss rate below 1"),
    (dict(recovery="hadamard", hadamard_block=1000), "power of two"),
    (dict(recovery="hadamard", hadamard_block=1), "power of two"),
    (dict(recovery="stale+rescale"), "hadamard+rescale, stale, error_feedback"),
])
def test_impossible_settings_are_one_line_errors(settings, needle):
    for build in (lambda: ExperimentConfig(**{"loss": "bernoulli:0.1", **settings}).validate(),
                  lambda: NetworkSpec(2, **{"loss": "bernoulli:0.1", **settings})):
        with pytest.raises(ValueError) as info:
            build()
        message = str(info.value)
        assert needle in message and len(message.splitlines()) == 1, message


def test_what_works_with_what():
    """error_feedback with lossy=both feeds gradients back and leaves activations to zero;
    hadamard (no rescale) and the send-by-send policies work with a deadline."""
    ExperimentConfig(recovery="error_feedback", lossy="both").validate()
    ExperimentConfig(recovery="error_feedback", lossy="bwd").validate()
    for policy in ("hadamard", "stale", "error_feedback"):
        ExperimentConfig(recovery=policy, transport="deadline", loss="bernoulli:0.1").validate()
    assert ExperimentConfig().hadamard_block == NetworkSpec(2).hadamard_block == 16384


@pytest.mark.parametrize("policy", ["hadamard", "stale", "error_feedback"])
def test_deadline_misses_go_through_the_policy(policy):
    """What a deadline leaves missing is lost to the policy as a drop is: the receivers still agree
    with one receiver alone, and the loss-free sum is what arrives when nothing misses."""
    tp = 4
    spec = dict(seed=2, payload_bytes=64, transport="deadline", deadline=1.0, recovery=policy, hadamard_block=64)
    x = torch.randn(tp, 2000, generator=torch.Generator().manual_seed(1))
    net = LossyNetwork(tp, "bernoulli:0.3", **spec)
    outs = [net.all_reduce("s", "bwd", x, range(tp)) for _ in range(3)]
    assert sum(row["missing"] for row in net.stats()) > 0
    assert any((out - x.sum(0)).abs().max() > 1e-3 for out in outs)
    alone = LossyNetwork(tp, "bernoulli:0.3", **spec)
    for out in outs:
        assert torch.equal(alone.all_reduce("s", "bwd", x, [1])[0], out[1])


# -- tensor-parallel training --------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["hadamard", "hadamard+rescale", "stale", "error_feedback"])
def test_tensor_parallel_gpt2_trains_through_every_policy(policy):
    """Two steps of a tiny TP GPT-2: the same packets are lost as under zero (policies change what a
    receiver makes of a loss, never which packets are lost), the losses are finite and differ from
    zero's; activation checkpointing replays the masks, signs and buffers: the same gradients."""
    from _tp_common import two_steps
    runs = {name: two_steps(LossyNetwork(2, "ge:rate=0.2,burst=3", seed=3, recovery=name.split("/")[0],
                                         hadamard_block=64), recompute=name.endswith("/recomputed"))
            for name in (policy, policy + "/recomputed", "zero")}
    (losses, grad, counted), (_, zero_grad, zero_counted) = runs[policy], runs["zero"]
    assert counted == zero_counted and sum(row["lost"] for row in counted) > 0
    assert torch.isfinite(losses).all()
    assert any(not torch.equal(grad[k], zero_grad[k]) for k in grad)
    recomputed_losses, recomputed, recounted = runs[policy + "/recomputed"]
    assert recounted == counted and torch.equal(recomputed_losses, losses)
    for name, value in grad.items():
        assert torch.equal(recomputed[name], value), name
