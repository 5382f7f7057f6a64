"""Ring, tree and direct collectives: loss-free sums, what a lost packet takes away, closed forms.

Contributions of rank j are 2**j, so an output element's bits say exactly which
ranks' data reached it.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

from lossysim.net.algorithms import chunk_bounds, depth, schedule
from lossysim.net import delivery as deliver
from lossysim.net.network import LossyNetwork
from lossysim.net.spec import NetworkSpec

ALPHA = 1e-5  # p-value threshold of the statistical checks
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def powers_of_two(tp: int, n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.stack([torch.full((n,), 2.0**r, dtype=dtype) for r in range(tp)])


def contributors(out: torch.Tensor, tp: int) -> list[list[frozenset]]:
    """[receiver][element] -> the set of ranks whose data reached it."""
    bits = out.to(torch.int64).tolist()
    return [[frozenset(j for j in range(tp) if value >> j & 1) for value in row] for row in bits]


def ring_owner(sched, element: int, per_packet: int) -> int:
    packet = element // per_packet
    return next(c for c, (first, count) in enumerate(chunk_bounds(sched.n_packets, sched.ranks))
                if first <= packet < first + count)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
@pytest.mark.parametrize("tp", range(1, 9))
def test_loss_free_equals_the_plain_sum(algorithm, tp):
    """Message sizes not divisible by tp_size, single packets, chunks smaller than a packet."""
    g = torch.Generator().manual_seed(tp)
    for payload, n in [(1450, 1), (1450, 5), (64, 7 * 16 + 3), (1450, 362 * tp + 1), (64, 16 * tp * 3)]:
        net = LossyNetwork(tp, "none", payload_bytes=payload, algorithm=algorithm)
        x = torch.randn(tp, n, generator=g)
        out = net.all_reduce("s", "fwd", x, range(tp))
        torch.testing.assert_close(out, x.sum(0).expand(tp, n), rtol=1e-6, atol=1e-6)
        gathered = net.all_gather("g", "fwd", x, range(tp))
        assert torch.equal(gathered, x.expand(tp, tp, n))


@pytest.mark.parametrize("tp", [2, 3, 5, 8])
def test_ring_contributions_are_a_run_ending_at_the_chunk_owner(tp):
    net = LossyNetwork(tp, "bernoulli:0.15", seed=tp, payload_bytes=16, algorithm="ring")
    n, per = 4 * 11 * tp + 3, 4
    sched = schedule("ring", "all_reduce", tp, -(-n // per))
    seen = set()
    for _ in range(5):
        out = net.all_reduce("s", "fwd", powers_of_two(tp, n), range(tp))
        for receiver, row in enumerate(contributors(out, tp)):
            for element, got in enumerate(row):
                owner = ring_owner(sched, element, per)
                run = frozenset((owner - k) % tp for k in range(len(got)))
                assert got == run or not got, (receiver, element, sorted(got), owner)
                seen.add(len(got))
    assert {0, 1, tp} <= seen  # holes, the owner alone and complete sums all occur


@pytest.mark.parametrize("tp", [2, 3, 6, 8])
def test_tree_contributions_are_a_subtree_holding_the_root(tp):
    net = LossyNetwork(tp, "bernoulli:0.15", seed=tp, payload_bytes=16, algorithm="tree")
    n = 4 * 40 + 1
    sizes = set()
    for _ in range(5):
        out = net.all_reduce("s", "fwd", powers_of_two(tp, n), range(tp))
        for row in contributors(out, tp):
            for got in row:
                if got:
                    assert 0 in got and all((j - 1) // 2 in got for j in got if j), sorted(got)
                sizes.add(len(got))
    assert 0 in sizes and tp in sizes and len(sizes) > 2


@pytest.mark.parametrize("tp", [2, 4])
def test_direct_receiver_always_keeps_its_own_contribution(tp):
    net = LossyNetwork(tp, "bernoulli:0.3", seed=1, payload_bytes=16, algorithm="direct")
    out = net.all_reduce("s", "fwd", powers_of_two(tp, 200), range(tp))
    for receiver, row in enumerate(contributors(out, tp)):
        assert all(receiver in got for got in row)


@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_complete_probability_matches_closed_form(algorithm):
    """Bernoulli p, zero: an element reaches a receiver d all-gather (broadcast) hops from its
    chunk's owner (the root) complete with probability (1-p)^(tp_size-1+d)."""
    tp, p, per = 4, 0.1, 4
    net = LossyNetwork(tp, f"bernoulli:{p}", seed=3, payload_bytes=16, algorithm=algorithm)
    n = per * 64 * tp
    sched = schedule(algorithm, "all_reduce", tp, n // per)
    complete, total = np.zeros(tp), np.zeros(tp)
    for _ in range(60):
        out = net.all_reduce("s", "fwd", powers_of_two(tp, n), range(tp))
        full = (out.to(torch.int64) == 2**tp - 1)[:, ::per].numpy()  # one element per packet
        for receiver in range(tp):
            for packet in range(n // per):
                owner = ring_owner(sched, packet * per, per) if algorithm == "ring" else 0
                d = (receiver - owner) % tp if algorithm == "ring" else depth(receiver)
                complete[d] += full[receiver, packet]
                total[d] += 1
    for d in range(tp):
        if total[d]:
            test = stats.binomtest(int(complete[d]), int(total[d]), (1 - p) ** (tp - 1 + d))
            assert test.pvalue > ALPHA, (d, complete[d] / total[d], (1 - p) ** (tp - 1 + d))
            # the bound bites: one hop more or less is rejected
            assert stats.binomtest(int(complete[d]), int(total[d]), (1 - p) ** (tp + d)).pvalue < ALPHA


@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
def test_rescale_is_unbiased_and_zero_is_not(algorithm):
    tp, calls = 4, 300
    x = torch.stack([torch.full((40,), v) for v in (1.0, -2.0, 3.0, 7.0)]).double()
    truth = x.sum(0)
    for recovery, unbiased in (("rescale", True), ("zero", False)):
        net = LossyNetwork(tp, "bernoulli:0.2", seed=5, payload_bytes=16, algorithm=algorithm, recovery=recovery)
        errors = torch.stack([(net.all_reduce("s", "fwd", x, range(tp)) - truth).mean(1)
                              for _ in range(calls)])  # [calls, receivers]
        for receiver in range(tp):
            p = stats.ttest_1samp(errors[:, receiver].numpy(), 0.0).pvalue
            assert (p > ALPHA) if unbiased else (p < ALPHA), (recovery, receiver, p)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
@pytest.mark.parametrize("recovery", ["zero", "rescale"])
def test_each_receiver_alone_computes_the_same_bits(algorithm, recovery):
    """What dist does (one receiver per process, every link drawn) equals the simulator's row."""
    tp = 4
    spec = dict(ranks=tp, loss_model="ge:rate=0.1,burst=4", seed=9, payload_bytes=32,
                algorithm=algorithm, recovery=recovery)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(tp, 3, 37 + i, generator=g) for i in range(3)]
    every = LossyNetwork(**spec)
    full = [every.all_reduce("s", "fwd", x, range(tp)) for x in xs]
    full_gather = [every.all_gather("g", "fwd", x, range(tp)) for x in xs]
    for r in range(tp):
        alone = LossyNetwork(**spec)
        for x, expected, gathered in zip(xs, full, full_gather):
            assert torch.equal(alone.all_reduce("s", "fwd", x, [r])[0], expected[r])
            assert torch.equal(alone.all_gather("g", "fwd", x, [r])[0], gathered[r])
        assert alone.stats() == every.stats()


def test_ring_all_gather_holes_travel_downstream():
    tp, per = 4, 4
    net = LossyNetwork(tp, "bernoulli:0.2", seed=2, payload_bytes=16, algorithm="ring")
    x = powers_of_two(tp, per * 50)
    out = net.all_gather("g", "fwd", x, range(tp))  # [receiver, shard, elements]
    holders = out[:, :, ::per] != 0                 # [receiver, shard, packet]
    for shard in range(tp):
        assert holders[shard, shard].all()
        for packet in range(holders.shape[-1]):
            got = [holders[(shard + d) % tp, shard, packet].item() for d in range(tp)]
            assert got == sorted(got, reverse=True)  # delivered up to some hop, then holes


def test_inter_node_only_loses_between_nodes():
    """2 nodes x 2 ranks: the ring crosses nodes on 1->2 and 3->0; NVLink inside a node is reliable."""
    tp, p = 4, 0.2
    net = LossyNetwork(tp, f"bernoulli:{p}", seed=4, payload_bytes=16, ranks_per_node=2, lossy_links="inter_node")
    for _ in range(20):
        net.all_reduce("s", "fwd", torch.randn(tp, 4 * 400), range(tp))
    df = pd.DataFrame(net.stats())
    assert set(map(tuple, df[["src", "dst"]].drop_duplicates().values)) == {(0, 1), (1, 2), (2, 3), (3, 0)}
    assert set(df.phase) == {"reduce_scatter", "all_gather"}
    intra, inter = df[df.link_class == "intra"], df[df.link_class == "inter"]
    assert set(map(tuple, inter[["src", "dst"]].values)) == {(1, 2), (3, 0)}
    assert intra.lost.sum() == 0 and intra.sent.sum() > 0
    rate = inter.lost.sum() / inter.sent.sum()
    assert stats.binomtest(int(inter.lost.sum()), int(inter.sent.sum()), p).pvalue > ALPHA, rate
    by_class = {row["link_class"]: row for row in net.summary(by=("link_class",))}
    assert by_class["intra"]["configured_loss_rate"] == 0 and by_class["inter"]["configured_loss_rate"] == p
    (both,) = net.summary()
    assert both["configured_loss_rate"] == pytest.approx(p * inter.sent.sum() / df.sent.sum())


@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_observed_loss_per_phase_matches_configured(algorithm):
    tp = 4
    net = LossyNetwork(tp, "ge:rate=0.05,burst=4", seed=6, payload_bytes=16, algorithm=algorithm)
    for _ in range(30):
        net.all_reduce("s", "fwd", torch.zeros(tp, 4 * 1000), range(tp))
    model = net.loss_model
    for row in net.summary(by=("phase",)):
        se = math.sqrt(model.variance_per_packet / row["sent"])
        assert abs(row["observed_loss_rate"] - model.loss_rate) < 5 * se, row
    # every packet the schedule sends is counted once
    sched = schedule(algorithm, "all_reduce", tp, 1000)
    assert sum(r["sent"] for r in net.summary()) == 30 * sum(s.packets for s in sched.sends)


def test_schedules_send_what_ring_and_tree_send():
    ring = schedule("ring", "all_reduce", 4, 10)
    assert ring.steps == 6 and all(s.dst == (s.src + 1) % 4 for s in ring.sends)
    per_rank = [sum(s.packets for s in ring.sends if s.src == r) for r in range(4)]
    assert all(abs(n - 2 * 3 / 4 * 10) <= 2 for n in per_rank)  # each rank sends 2(R-1)/R of the message
    tree = schedule("tree", "all_reduce", 7, 10)
    assert tree.steps == 4 and {(s.src, s.dst) for s in tree.sends if s.phase == "reduce"} == \
        {(j, (j - 1) // 2) for j in range(1, 7)}
    assert schedule("tree", "all_gather", 4, 10).algorithm == "ring"  # as NCCL: no tree all-gather


@pytest.mark.parametrize("algorithm", ["ring", "tree"])
@pytest.mark.parametrize("recovery", ["zero", "rescale"])
def test_gpu_dense_path_gives_the_cpu_bits(algorithm, recovery):
    """The sync-free path a GPU takes computes exactly what the patch list computes."""
    tp = 4
    net = LossyNetwork(tp, "bernoulli:0.2", seed=3, payload_bytes=16, algorithm=algorithm, recovery=recovery)
    x = torch.randn(tp, 4 * 50 + 3)
    x[2, 7] = float("inf")  # a lost inf must contribute nothing on both paths
    delivery = net.simulate("s", "fwd", x[0].numel(), x.dtype, "all_reduce", x.device)
    assert (delivery.coef == 0).any() and (delivery.gain == 0).any()
    sparse = deliver.all_reduce(x, delivery, range(tp), 4, recovery == "rescale", lambda seen: None, dense=False)
    dense = deliver.all_reduce(x, delivery, range(tp), 4, recovery == "rescale", lambda seen: None, dense=True)
    torch.testing.assert_close(sparse, dense, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_gpt2_matches_hf_through_every_algorithm(algorithm, tp):
    """A loss rate too small to lose anything still takes the lossy path (schedule, masks,
    patching, gains): logits and every gradient equal the unmodified HF model's."""
    import copy

    from _tp_common import build, grads, hf_step, make_batch, parallelize, rel_err, tp_layout, tp_step
    ref = build("cls")
    network = LossyNetwork(tp, "bernoulli:1e-12", algorithm=algorithm)
    tpm = parallelize(copy.deepcopy(ref), tp, network)
    batch = make_batch("cls")
    out, loss = hf_step(ref, "cls", batch)
    rank_logits, rank_losses = tp_step(tpm, "cls", batch)
    assert network.drops("fwd") and sum(row["sent"] for row in network.stats()) > 0
    for r in range(tp):
        assert rel_err(rank_logits[r], out) <= 1e-5 and rel_err(rank_losses[r], loss) <= 1e-5
    for name, grad in grads(ref).items():
        assert rel_err(grads(tpm)[name], tp_layout(tpm, name, grad)) <= 1e-5, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(3, 4 * 7), (3, 4 * 7 + 2), (2, 3, 4 * 5 + 1)])
def test_zeroing_holes_by_index_is_masking_them(dtype, shape):
    """The CPU's few-holes path (indices, in numpy, on the bits) zeroes what the device's masks zero,
    the short last packet included, in every float type (numpy has no bfloat16)."""
    per_packet = 4
    packets = -(-shape[-1] // per_packet)
    g = torch.Generator().manual_seed(len(shape))
    holes = torch.rand(*shape[:-1], packets, generator=g) < 0.3
    holes[(0,) * (len(shape) - 1) + (-1,)] = True
    x = torch.randn(shape, generator=g).to(dtype) - 0.5
    few, masked = x.clone(), x.clone()
    deliver.zero_holes(few, holes, per_packet, dense=False)
    deliver.zero_holes(masked, holes, per_packet, dense=True)
    assert torch.equal(few.view(torch.uint8), masked.view(torch.uint8))   # bit for bit: +0.0, not -0.0
    assert (few == 0).any() and (few != 0).any()


@pytest.mark.parametrize("tp", [2, 5, 8])
def test_direct_exchange_patching_what_receivers_missed_gives_the_full_sums_bits(tp):
    """The CPU's direct all-reduce adds the plain sum once and again only the packets a receiver missed
    some sender's of: the bits of adding every sender's packets at every receiver, a lost inf included."""
    g = torch.Generator().manual_seed(tp)
    for n in (4 * 50 + 3, 4 * 50):
        x = torch.randn(tp, n, generator=g) * 100
        x[1, 5] = float("inf")
        packets = -(-n // 4)
        for rate in (0.0, 0.05, 0.5):
            kept = torch.rand(tp, tp, packets, generator=g) >= rate
            kept[torch.arange(tp), torch.arange(tp)] = True     # a rank's own contribution never travels
            patched = deliver.direct_sum(x, kept, 4, dense=False)
            every = deliver.direct_sum(x, kept, 4, dense=True)
            torch.testing.assert_close(patched, every, rtol=0, atol=0, equal_nan=True)
            assert rate == 0 or not torch.equal(every[0], every[1])


def test_a_repaired_call_builds_no_per_packet_layout_and_a_dropped_one_counts_by_it():
    """The per-packet tables (where each send's packets sit in a draw; each packet's counter slot) are
    built only where read: a 128-rank ring's 1 GB message would need gigabytes of them. A retransmitted
    call counts step by step and never builds them; a dropped call counts its draw whole, slot by slot,
    and its counts per phase are the schedule's."""
    numel = 3 * 1024 + 5   # packets that do not split evenly into 4 chunks
    for transport, built in (("retransmit", False), ("drop", True)):
        schedule.cache_clear()   # a schedule another test built may hold them already
        net = LossyNetwork(NetworkSpec(ranks=4, seed=1, loss="bernoulli:0.02", transport=transport, nic="irn",
                                       algorithm="ring", payload_bytes=64))
        net.simulate("s", "bwd", numel, torch.float32, deliver=False)
        sched = schedule("ring", "all_reduce", 4, -(-numel // 16), None, None)   # the network's (cached) one
        assert bool(sched._packet_layout) is built
        sent = {row["phase"]: row["sent"] - row["resent"] for row in net.summary(by=("phase",))}
        assert sent == {phase: sum(s.packets for s in sched.sends if s.phase == phase)
                        for phase in ("reduce_scatter", "all_gather")}
