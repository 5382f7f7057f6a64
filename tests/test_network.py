"""LossyNetwork: packets, element-exact delivery and recovery, statistics, seeds and saved state.

Masks are read back by wrapping the loss model's ``sample_with_states`` (the
network's only source of randomness), so every expectation below is computed
independently from the drawn masks, never copied from a previous run.
"""
from __future__ import annotations

import io
import math

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

from lossysim.net import stats as counting
from lossysim.net.network import LossyNetwork as _LossyNetwork

ALPHA = 1e-5  # p-value threshold of the statistical checks


def LossyNetwork(*args, **kwargs):
    """These tests read masks link by link, as the direct exchange uses them (ring and tree: test_algorithms.py)."""
    return _LossyNetwork(*args, **{"algorithm": "direct", **kwargs})


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- helpers ---------------------------------------------------------------------
def per_packet(payload_bytes: int, dtype: torch.dtype) -> int:
    """Elements per packet as the spec states it: payload bytes over element size."""
    return payload_bytes // torch.empty((), dtype=dtype).element_size()


@pytest.fixture
def spy(monkeypatch):
    """``spy(net)`` -> list that receives every mask [links, packets] the network draws, in order."""
    def attach(net):
        masks = []
        draw = net.loss_model.sample_with_states

        def recorded(n, generator, state=None, used=None):
            lost, in_bad, next_state = draw(n, generator, state, used=used)
            if lost.shape[-1]:  # not the zero-length draw that starts every chain
                masks.append(lost.clone())
            return lost, in_bad, next_state

        monkeypatch.setattr(net.loss_model, "sample_with_states", recorded)
        if hasattr(net.loss_model, "lost_positions"):  # the same fates, as positions (net.sparse)
            positions = net.loss_model.lost_positions

            def recorded_positions(rows, width, generator, state=None, used=None):
                flat, after = positions(rows, width, generator, state, used)
                if width:
                    lost = torch.zeros(rows * width, dtype=torch.bool)
                    lost[torch.from_numpy(flat)] = True
                    masks.append(lost.view(rows, width))
                return flat, after

            monkeypatch.setattr(net.loss_model, "lost_positions", recorded_positions)
        return masks
    return attach


def powers_of_two(tp: int, shape, dtype=torch.float32) -> torch.Tensor:
    """Rank r sends 2**r everywhere, so a sum tells exactly whose data reached each element."""
    return torch.stack([torch.full(shape, 2.0**r, dtype=dtype) for r in range(tp)])


def arrivals(out: torch.Tensor, tp: int) -> torch.Tensor:
    """[receiver, sender, element] bool, decoded from an all_reduce of ``powers_of_two``."""
    bits = out.reshape(out.shape[0], -1).to(torch.int64)
    return torch.stack([(bits >> s) & 1 for s in range(tp)], 1).bool()


def element_mask(lost_packets: torch.Tensor, per: int, numel: int) -> torch.Tensor:
    """Per-element loss of one link's message: each packet's fate covers its elements."""
    return lost_packets.repeat_interleave(per)[:numel]


def run_lengths(lost: np.ndarray) -> np.ndarray:
    edges = np.diff(np.concatenate([[0], lost.astype(np.int8), [0]]))
    return np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)


def link_index(net: LossyNetwork, src: int, dst: int) -> int:
    return net.links.index((src, dst))


def exercise(net: LossyNetwork, calls: int = 4) -> list[torch.Tensor]:
    """A fixed mix of collectives on two sites and both directions; returns every output."""
    g = torch.Generator().manual_seed(99)
    outputs = []
    for i in range(calls):
        x = torch.randn(net.ranks, 3, 50 + 7 * i, generator=g)
        outputs.append(net.all_reduce("h.0.attn", "fwd", x, range(net.ranks)))
        outputs.append(net.all_reduce("h.0.attn", "bwd", x, range(net.ranks)))
        outputs.append(net.all_gather("h.1.mlp", "fwd", x, range(net.ranks)))
    return outputs


# -- packets ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("payload", [8, 1450])
def test_packet_count_is_ceil_of_numel_over_elements_per_packet(dtype, payload):
    net = LossyNetwork(2, payload_bytes=payload)
    per = per_packet(payload, dtype)
    for numel in (0, 1, per - 1, per, per + 1, 10 * per + 3):
        assert net.packets(numel, dtype) == (per, math.ceil(numel / per))


@pytest.mark.parametrize("payload", [1448, 1450])
def test_fp16_packet_carries_twice_the_fp32_elements(payload):
    """Same bytes per packet; 1450 is not a multiple of 4, so fp32 packets carry 2 bytes less."""
    net = LossyNetwork(2, payload_bytes=payload)
    fp16, fp32 = net.packets(1, torch.float16)[0], net.packets(1, torch.float32)[0]
    assert fp16 == 2 * fp32 + (payload % 4) // 2
    assert 4 * fp32 <= payload and 2 * fp16 <= payload


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lost_packets_zero_exactly_their_elements(spy, dtype):
    """Recovery zero: every element of a lost packet (partial last one included) misses that peer."""
    tp, payload = 4, 64
    net = LossyNetwork(tp, "ge:rate=0.3,burst=3", seed=1, payload_bytes=payload)
    masks, per = spy(net), per_packet(payload, dtype)
    zeroed = torch.zeros(len(net.links), dtype=torch.long)
    sent = 0
    for shape in [(3, 5 * per + 7), (4 * per,), (1,), (2 * per + 1,)] * 3:
        numel = math.prod(shape)
        out = net.all_reduce("s", "fwd", powers_of_two(tp, shape, dtype), range(tp))
        got = arrivals(out, tp)
        expected = torch.ones_like(got)
        for li, (src, dst) in enumerate(net.links):
            expected[dst, src] = ~element_mask(masks[-1][li], per, numel)
            # a packet counts as zeroed when none of its elements arrived from src
            missing = ~got[dst, src]
            zeroed[li] += sum(bool(missing[i:i + per].all()) for i in range(0, numel, per))
        assert torch.equal(got, expected)  # own contribution (diagonal) always arrives
        sent += math.ceil(numel / per)
    rows = net.stats()
    assert [r["lost"] for r in rows] == zeroed.tolist()
    assert all(r["sent"] == sent and r["calls"] == 12 for r in rows)
    assert zeroed.sum() > 0


@pytest.mark.parametrize("recovery", ["zero", "rescale"])
def test_recovery_policy_on_surviving_remote_contributions(spy, recovery):
    """zero: lost packets add nothing; rescale: surviving remote packets divided by 1 - loss_rate."""
    tp, payload, rate = 3, 32, 0.25
    net = LossyNetwork(tp, f"bernoulli:{rate}", seed=2, payload_bytes=payload, recovery=recovery)
    masks = spy(net)
    c = torch.randn(tp, 50, 7, dtype=torch.float64)
    out = net.all_reduce("s", "fwd", c, range(tp)).reshape(tp, -1)
    flat, per = c.reshape(tp, -1), per_packet(payload, torch.float64)
    scale = 1 / (1 - rate) if recovery == "rescale" else 1.0
    for dst in range(tp):
        expected = flat[dst].clone()
        for src in range(tp):
            if src != dst:
                keep = ~element_mask(masks[0][link_index(net, src, dst)], per, flat.shape[1])
                expected += keep * flat[src] * scale
        torch.testing.assert_close(out[dst], expected, rtol=1e-12, atol=1e-12)


def test_receivers_own_contribution_is_never_lost():
    """Even when every packet on every link is lost, each rank keeps its own data."""
    net = LossyNetwork(3, "bernoulli:1", seed=0, payload_bytes=16)
    c = torch.randn(3, 40)
    assert torch.equal(net.all_reduce("s", "fwd", c, range(3)), c)
    gathered = net.all_gather("g", "fwd", c, range(3))
    for i in range(3):
        assert torch.equal(gathered[i, i], c[i])
        assert not gathered[i, [j for j in range(3) if j != i]].any()


def test_all_gather_zeroes_lost_packets_without_rescaling(spy):
    """A gathered shard is not a sum: lost packets arrive as zeros, survivors unscaled."""
    tp, payload = 3, 16
    net = LossyNetwork(tp, "bernoulli:0.3", seed=8, payload_bytes=payload, recovery="rescale")
    masks = spy(net)
    shards = torch.randn(tp, 5, 9)
    out = net.all_gather("g", "fwd", shards, range(tp))
    assert out.shape == (tp, tp, 5, 9)
    per = per_packet(payload, shards.dtype)
    for li, (src, dst) in enumerate(net.links):
        keep = ~element_mask(masks[0][li], per, 45)
        assert torch.equal(out[dst, src].flatten(), shards[src].flatten() * keep)
    for i in range(tp):
        assert torch.equal(out[i, i], shards[i])


def test_lossless_network_is_the_plain_sum():
    net = LossyNetwork(4, "none", payload_bytes=16)
    c = torch.randn(4, 6, 33)
    out = net.all_reduce("s", "fwd", c, range(4))
    for i in range(4):
        assert torch.equal(out[i], c.sum(0))
    assert torch.equal(net.all_gather("g", "bwd", c, [2])[0], c)
    assert all(r["sent"] == math.ceil(6 * 33 / 4) and r["lost"] == 0 for r in net.stats())


def test_directions_not_lossy_lose_nothing_but_are_counted():
    net = LossyNetwork(2, "bernoulli:0.5", seed=3, payload_bytes=16, lossy=("fwd",))
    c = torch.randn(2, 1000)
    assert not net.drops("bwd") and net.drops("fwd")
    bwd = net.all_reduce("s", "bwd", c, range(2))
    assert torch.equal(bwd, c.sum(0).expand(2, -1))
    assert not torch.equal(net.all_reduce("s", "fwd", c, range(2)), bwd)
    df = pd.DataFrame(net.stats()).set_index("direction")
    packets = math.ceil(1000 / per_packet(16, torch.float32))
    assert (df.loc["bwd", "sent"] == packets).all() and (df.loc["bwd", "lost"] == 0).all()
    assert (df.loc["bwd", "calls"] == 1).all()
    assert (df.loc["fwd", "sent"] == packets).all() and (df.loc["fwd", "lost"] > 0).all()
    summary = {r["direction"]: r for r in net.summary()}
    assert summary["bwd"]["configured_loss_rate"] == 0.0 and summary["fwd"]["configured_loss_rate"] == 0.5


# -- statistics -------------------------------------------------------------------------
def test_stats_and_burst_histogram_match_numpy_runs_across_calls(spy):
    """Counters and run lengths (runs spanning calls, open runs, the pooled last bin) vs numpy."""
    max_burst = 8
    net = LossyNetwork(3, "ge:rate=0.3,burst=6", seed=4, payload_bytes=8, max_burst=max_burst)
    masks = spy(net)
    per = per_packet(8, torch.float32)
    sizes = [1, 3, 1, 50, 7, 1, 1, 200, 2, 30] * 3
    for n in sizes:  # two sites interleaved: their runs must not mix
        net.all_reduce("a", "fwd", torch.ones(3, per * n), range(3))
        net.all_reduce("b", "bwd", torch.ones(3, per * (n + 1)), range(3))
    lost_a = torch.cat(masks[0::2], 1).numpy()
    boundaries = np.cumsum(sizes)[:-1]
    assert (lost_a[:, boundaries - 1] & lost_a[:, boundaries]).any()  # some runs span calls
    rows = {(r["src"], r["dst"]): r for r in net.stats() if r["site"] == "a"}
    hist = pd.DataFrame(net.burst_histogram())
    for li, link in enumerate(net.links):
        lengths = run_lengths(lost_a[li])
        row = rows[link]
        assert (row["sent"], row["calls"]) == (sum(sizes), len(sizes))
        assert (row["lost"], row["bursts"]) == (lost_a[li].sum(), lengths.size)
        assert row["sent_bad"] == row["lost"]  # simple Gilbert: lost exactly when sent in Bad
        expected = np.bincount(np.minimum(lengths, max_burst), minlength=max_burst + 1)
        mine = hist[(hist.site == "a") & (hist.src == link[0]) & (hist.dst == link[1])]
        observed = np.zeros(max_burst + 1, dtype=np.int64)
        observed[mine.length.to_numpy()] = mine["count"].to_numpy()
        assert observed.tolist() == expected.tolist()


@pytest.mark.parametrize("bad", [False, True])
def test_compiled_count_of_lost_packets_equals_numpys(monkeypatch, bad):
    """``runs.count`` (one compiled pass) against ``count_runs``' numpy passes on the same queued losses:
    bursty runs, runs carried from batch to batch and left open at a link's last packet, rows that send
    nothing, links in any order, slots by phase and per packet."""
    from lossysim.net import runs
    from lossysim.net.stats import Counters
    kernel = runs.compiled()
    assert kernel is not None, "the dev extra installs numba"
    links, rows, max_burst = 40, 12, 5

    def counted(compiled: bool):
        monkeypatch.setitem(runs._compiled, "count", kernel if compiled else None)
        rng = np.random.default_rng(7)
        counters = Counters(links, max_burst, "cpu")
        for batch in range(6):
            link_ids = torch.from_numpy(rng.choice(links, rows, replace=False))
            silent = rng.random(rows) < 0.2                            # send nothing this batch
            for _ in range(int(rng.integers(1, 9))):
                width = int(rng.integers(1, 30))
                used = rng.integers(0, width + 1, rows)
                used[silent | (rng.random(rows) < 0.2)] = 0
                burst = rng.random((rows, width)) < 0.15
                lost = burst | np.roll(burst, 1, 1) & (rng.random((rows, width)) < 0.7)
                lost[:, -2:] |= rng.random((rows, 1)) < 0.3       # runs reaching the call's end
                lost &= np.arange(width) < used[:, None]
                row, position = np.nonzero(lost)
                if rng.random() < 0.5:
                    counters.record_lost(link_ids, row, position, used, int(rng.integers(0, 2)), bad=bad)
                else:
                    slots = torch.from_numpy(rng.integers(0, 3, (rows, width)) * links + link_ids.numpy()[:, None])
                    sent = torch.zeros(counters.counts.shape[1:], dtype=torch.long).view(-1)
                    sent.index_add_(0, slots[torch.from_numpy(np.arange(width) < used[:, None])],
                                    torch.ones(int(used.sum()), dtype=torch.long))
                    counters.record_lost(link_ids, row, position, used, slots, sent.view(counters.counts.shape[1:]),
                                         bad=bad)
            counters.flush()
        return counters.counts.clone(), counters.runs.clone(), counters.open_run.clone()

    numpy, compiled = counted(False), counted(True)
    assert compiled[0][3].sum() > 100 and compiled[1][max_burst].sum() > 0 and (compiled[2] > 0).any()
    for a, b in zip(numpy, compiled):
        assert torch.equal(a, b)


@pytest.mark.parametrize("settings", [dict(algorithm="ring"), dict(algorithm="tree", payload_bytes=16),
                                      dict(algorithm="ring", transport="retransmit"),
                                      dict(algorithm="ring", transport="deadline", deadline=3.0)])
def test_counting_draws_together_equals_counting_each_alone(monkeypatch, settings):
    """Queued draws are counted in batches: the counters and every run length come out as if each
    call were counted at once (runs spanning calls and padded links included)."""
    def counted(queue):
        monkeypatch.setattr(counting, "QUEUE", queue)
        net = _LossyNetwork(4, "ge:rate=0.2,burst=5", seed=9, max_burst=6, **settings)
        g = torch.Generator().manual_seed(1)
        for n in [5, 900, 3, 2000, 17, 1, 362 * 4 + 1] * 3:
            net.all_reduce("s", "fwd", torch.randn(4, n, generator=g), range(4))
            net.all_gather("t", "bwd", torch.randn(4, n, generator=g), range(4))
        return net.stats(), net.burst_histogram()
    alone, together = counted(1), counted(64)
    assert alone == together and sum(r["bursts"] for r in alone[0]) > 20


def test_stats_drop_into_a_dataframe():
    net = LossyNetwork(3, "ge:rate=0.1,burst=4", seed=5, payload_bytes=8, max_burst=10_000)
    exercise(net)
    df = pd.DataFrame(net.stats())
    assert {"site", "direction", "src", "dst", "calls", "sent", "lost", "sent_bad", "bursts"} <= set(df)
    assert len(df) == 3 * len(net.links)  # (h.0.attn fwd, h.0.attn bwd, h.1.mlp fwd) x links
    hist = pd.DataFrame(net.burst_histogram())
    assert (hist.length * hist["count"]).sum() == df.lost.sum()
    assert hist.groupby(["site", "direction", "src", "dst"])["count"].sum().sum() == df.bursts.sum()
    by_site = pd.DataFrame(net.summary(by=("site",))).set_index("site")
    totals = df.groupby("site")[["sent", "lost"]].sum()
    assert np.allclose(by_site.observed_loss_rate, totals.lost / totals.sent)


def test_reset_stats_zeroes_counters_and_chains_go_on():
    spec = dict(ranks=3, loss_model="ge:rate=0.2,burst=10", seed=6, payload_bytes=8)
    reset, kept = LossyNetwork(**spec), LossyNetwork(**spec)
    exercise(reset), exercise(kept)
    before = pd.DataFrame(kept.stats())
    reset.reset_stats()
    assert all(r["sent"] == r["lost"] == r["bursts"] == r["sent_bad"] == r["calls"] == 0
               for r in reset.stats())
    assert reset.burst_histogram() == []
    for a, b in zip(exercise(reset), exercise(kept)):
        assert torch.equal(a, b)
    after, total = pd.DataFrame(reset.stats()), pd.DataFrame(kept.stats())
    for name in ("sent", "lost", "calls"):
        assert (after[name] == total[name] - before[name]).all()


@pytest.mark.parametrize("spec", ["bernoulli:0.05", "ge:rate=0.05,burst=8",
                                  "ge:p_gb=0.002,p_bg=0.05,loss_bad=0.8,loss_good=0.01"])
def test_observed_loss_rate_over_many_calls_within_4_standard_errors(spec):
    """Each link is one chain over every call: its loss rate and mean burst match the model."""
    net = LossyNetwork(4, spec, seed=7, payload_bytes=8)
    per = per_packet(8, torch.float32)
    for _ in range(20):
        net.all_reduce("s", "fwd", torch.zeros(4, per * 5_000), range(4))
    df = pd.DataFrame(net.stats())
    model, sent, lost = net.loss_model, df.sent.sum(), df.lost.sum()
    assert sent == 20 * 5_000 * len(net.links)
    se = math.sqrt(model.variance_per_packet / sent)
    assert abs(lost / sent - model.loss_rate) < 4 * se
    assert abs(lost / sent - 1.25 * model.loss_rate) > 4 * se  # the bound bites
    # mean burst: ratio estimator over the 12 independent links
    ratio = lost / df.bursts.sum()
    resid = df.lost - ratio * df.bursts
    links = len(df)
    se_burst = math.sqrt(links / (links - 1) * (resid**2).sum()) / df.bursts.sum()
    assert 2 * stats.t.sf(abs(ratio - model.mean_burst) / se_burst, links - 1) > ALPHA
    (row,) = net.summary()
    assert row["observed_loss_rate"] == lost / sent and row["configured_loss_rate"] == model.loss_rate


# -- seeds, independence, determinism -----------------------------------------------------
def test_same_seed_gives_identical_outputs_and_stats():
    spec = dict(ranks=3, loss_model="ge:rate=0.2,burst=5", seed=11, payload_bytes=8)
    a, b = LossyNetwork(**spec), LossyNetwork(**spec)
    for x, y in zip(exercise(a), exercise(b)):
        assert torch.equal(x, y)
    assert a.stats() == b.stats() and a.burst_histogram() == b.burst_histogram()
    other = LossyNetwork(**{**spec, "seed": 12})
    assert all(not torch.equal(x, y) for x, y in zip(exercise(other), exercise(LossyNetwork(**spec))))


def test_same_site_draws_a_new_mask_every_call():
    """Never reseeded per call: same-sized messages get different masks."""
    net = LossyNetwork(2, "bernoulli:0.3", seed=0, payload_bytes=8)
    x = torch.ones(2, 2000)
    assert not torch.equal(net.all_reduce("s", "fwd", x, range(2)), net.all_reduce("s", "fwd", x, range(2)))


def test_site_masks_do_not_depend_on_other_sites_call_order():
    spec = dict(ranks=3, loss_model="ge:rate=0.2,burst=5", seed=13, payload_bytes=8)
    ab, ba = LossyNetwork(**spec), LossyNetwork(**spec)
    x = torch.randn(3, 500)
    a1, b1 = ab.all_reduce("A", "fwd", x, range(3)), ab.all_reduce("B", "fwd", x, range(3))
    b2, a2 = ba.all_reduce("B", "fwd", x, range(3)), ba.all_reduce("A", "fwd", x, range(3))
    assert torch.equal(a1, a2) and torch.equal(b1, b2)


def test_one_receiver_sees_what_the_full_simulation_gives_it():
    """A rank in its own process (receivers=[r]) computes the same bits as one process for all."""
    spec = dict(ranks=4, loss_model="ge:rate=0.2,burst=5", seed=14, payload_bytes=8)
    full = LossyNetwork(**spec)
    x = torch.randn(4, 700)
    everyone = [full.all_reduce("s", "fwd", x, range(4)) for _ in range(3)]
    for r in range(4):
        alone = LossyNetwork(**spec)
        for out in everyone:
            assert torch.equal(alone.all_reduce("s", "fwd", x, [r])[0], out[r])


@pytest.mark.parametrize("spec,thin", [("bernoulli:0.2", 1), ("ge:rate=0.2,burst=4", 32)])
def test_links_sites_directions_and_seeds_draw_independent_masks(spy, spec, thin):
    """Loss indicators of different links/sites/directions/seeds are uncorrelated.

    Gilbert-Elliott indicators are autocorrelated, which pearsonr does not
    allow for, so they are thinned to every ``thin``-th packet (lag-32
    autocorrelation (1 - p_gb - p_bg)^32 ~ 1e-5 here).
    """
    packets = 200_000
    net, twin = LossyNetwork(3, spec, seed=15, payload_bytes=8), LossyNetwork(3, spec, seed=16, payload_bytes=8)
    masks, twin_masks = spy(net), spy(twin)
    x = torch.zeros(3, per_packet(8, torch.float32) * packets)
    for site, direction in [("a", "fwd"), ("a", "bwd"), ("b", "fwd")]:
        net.all_reduce(site, direction, x, range(3))
    twin.all_reduce("a", "fwd", x, range(3))
    a_fwd, a_bwd, b_fwd = masks
    l01, l10, l02 = (link_index(net, *link) for link in [(0, 1), (1, 0), (0, 2)])
    pairs = {"reverse link": (a_fwd[l01], a_fwd[l10]), "same sender": (a_fwd[l01], a_fwd[l02]),
             "other site": (a_fwd[l01], b_fwd[l01]), "other direction": (a_fwd[l01], a_bwd[l01]),
             "other seed": (a_fwd[l01], twin_masks[0][l01])}
    for name, (u, v) in pairs.items():
        u, v = u[::thin].double().numpy(), v[::thin].double().numpy()
        r, p = stats.pearsonr(u, v)
        assert p > 1e-3 and abs(r) < 6 / math.sqrt(u.size), name
    # the check bites: the masks of one seed and site drawn twice are perfectly correlated
    again = LossyNetwork(3, spec, seed=15, payload_bytes=8)
    again_masks = spy(again)
    again.all_reduce("a", "fwd", x, range(3))
    assert torch.equal(again_masks[0], a_fwd)
    assert stats.pearsonr(a_fwd[l01][::thin].double().numpy(), again_masks[0][l01][::thin].double().numpy())[1] < 1e-3


# -- saved state ------------------------------------------------------------------------
def test_state_dict_round_trip_continues_identically():
    spec = dict(ranks=3, loss_model="ge:rate=0.2,burst=20", seed=17, payload_bytes=8)
    net = LossyNetwork(**spec)
    exercise(net)
    buffer = io.BytesIO()
    torch.save(net.state_dict(), buffer)
    saved_stats = net.stats()
    continued = exercise(net)
    restored = LossyNetwork(**spec)
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer))
    assert restored.stats() == saved_stats
    for a, b in zip(exercise(restored), continued):
        assert torch.equal(a, b)
    assert restored.stats() == net.stats() and restored.burst_histogram() == net.burst_histogram()
    with pytest.raises(ValueError, match="seed"):
        LossyNetwork(**{**spec, "seed": 18}).load_state_dict(net.state_dict())


def test_an_in_memory_state_loads_twice_alike():
    """Loading a state does not tie the network to it: counting on after a load leaves the state as saved."""
    spec = dict(ranks=3, loss_model="ge:rate=0.2,burst=20", seed=17, payload_bytes=8)
    net = LossyNetwork(**spec)
    exercise(net)
    state, saved_stats = net.state_dict(), net.stats()
    runs = []
    for _ in range(2):
        restored = LossyNetwork(**spec)
        restored.load_state_dict(state)
        assert restored.stats() == saved_stats
        exercise(restored)
        runs.append((restored.stats(), restored.burst_histogram()))
    assert runs[0] == runs[1] and runs[0][0] != saved_stats


def test_a_state_saved_when_ranks_were_called_tp_size_still_loads():
    spec = dict(ranks=3, loss_model="ge:rate=0.2,burst=20", seed=17, payload_bytes=8)
    net = LossyNetwork(**spec)
    exercise(net)
    state = net.state_dict()
    state["config"] = {("tp_size" if k == "ranks" else k): v for k, v in state["config"].items()}
    restored = LossyNetwork(**spec)
    restored.load_state_dict(state)
    assert restored.stats() == net.stats()
    with pytest.raises(ValueError, match="saved with"):   # the old name is read as ranks, and checked
        LossyNetwork(**{**spec, "ranks": 4}).load_state_dict(state)


@pytest.mark.parametrize("shape, dtype", [((3, 5), np.int64), ((257, 1024), np.int64), ((1 << 21,), np.bool_)])
def test_untouched_zeros_are_writable_independent_zeros(shape, dtype, monkeypatch):
    """Large ones are mapped (their pages untouched until written), small ones and a failed mapping are
    the heap's: zeros of the shape and dtype either way, each its own memory."""
    from lossysim import util
    mapping = util.mmap.mmap

    def mapped(a) -> bool:
        while isinstance(a, np.ndarray):
            a = a.base
        return isinstance(a, memoryview) and isinstance(a.obj, mapping)

    for failing in (False, True):
        if failing:
            monkeypatch.setattr(util.mmap, "mmap", lambda *a: (_ for _ in ()).throw(OSError("no more mappings")))
        a, b = util.untouched_zeros(shape, dtype), util.untouched_zeros(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and not a.any() and a.flags.writeable
        assert mapped(a) == (not failing and a.nbytes >= util._MAPPED_FROM)
        a.reshape(-1)[-1] = 1
        assert not b.any() and a.sum() == 1
