"""The sparse path (net/sparse.py: Bernoulli and simple Gilbert fates as loss positions) against the general
one (masks): the same deliveries, counts, burst histogram, clock and random streams, bit for bit."""
import numpy as np
import pytest
import torch

from lossysim.estimate import Workload, estimate, job_config
from lossysim.loss import Bernoulli, GilbertElliott
from lossysim.net import LossyNetwork, NetworkSpec, sparse
from lossysim.net.recovery import packets_of
from lossysim.net.stats import count_runs


def run(spec: NetworkSpec, sizes=(100, 5000, 40000), calls=3, deliver=True) -> dict:
    net = LossyNetwork(spec)
    deliveries = []
    for _ in range(calls):
        for site, numel in enumerate(sizes):
            for direction in ("fwd", "bwd"):
                drawn = net.simulate(f"s{site}", direction, numel, torch.bfloat16, deliver=deliver)
                if isinstance(drawn, sparse.Losses):   # an estimate's: what it counts of them
                    drawn = drawn.bad_packets()
                elif drawn is not None:
                    drawn = vars(packets_of(drawn)) if deliver else sparse.bad_packets_of(packets_of(drawn))
                deliveries.append(drawn)
    return {"deliveries": deliveries, "stats": net.stats(), "bursts": net.burst_histogram(), "clock": net.clock(),
            "failures": net.totals()["failures"], "totals": net.totals(),
            "streams": [ch.chains.generator.get_state() for ch in net.channels.by_key.values()]}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


SETTINGS = [
    dict(loss="bernoulli:0.01", transport="retransmit", nic="irn"),
    dict(loss="bernoulli:0.5", transport="retransmit", nic="irn"),              # retries run out: failures
    dict(loss="bernoulli:0.3", transport="retransmit", nic="tcp", algorithm="direct"),
    dict(loss="bernoulli:0.05", transport="deadline", nic="srd", deadline=1.05),  # the deadline stops sends
    dict(loss="bernoulli:0.2", transport="deadline", nic="irn", algorithm="tree", ranks_per_node=2,
         lossy_links="inter_node"),
    dict(loss="bernoulli:0.05", transport="drop"),
    dict(loss="bernoulli:0.05", transport="drop", recovery="rescale", algorithm="tree"),
    dict(loss="bernoulli:0.1", transport="drop", ranks_per_node=2, lossy_links="inter_node"),
    # Simple Gilbert chains: the losses are the burst state's packets, the chains' states carried call to call.
    dict(loss="ge:rate=0.01,burst=4", transport="retransmit", nic="irn"),
    dict(loss="ge:rate=0.2,burst=8", transport="retransmit", nic="irn"),          # retries run out: failures
    dict(loss="ge:rate=0.1,burst=3", transport="retransmit", nic="tcp", algorithm="direct"),
    dict(loss="ge:rate=0.05,burst=2", transport="deadline", nic="srd", deadline=1.05),
    dict(loss="ge:rate=0.1,burst=5", transport="deadline", nic="irn", algorithm="tree", ranks_per_node=2,
         lossy_links="inter_node"),
    dict(loss="ge:rate=0.05,burst=4", transport="drop"),
    dict(loss="ge:rate=0.05,burst=3", transport="drop", recovery="rescale", algorithm="tree"),
    dict(loss="ge:rate=0.1,burst=6", transport="drop", ranks_per_node=2, lossy_links="inter_node"),
]


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("deliver", [True, False])
def test_sparse_path_is_the_general_path_bit_for_bit(settings, deliver, monkeypatch):
    spec = NetworkSpec(ranks=4, seed=3, **settings)
    assert sparse.applies(spec, torch.device("cpu"))
    fast = run(spec, deliver=deliver)
    monkeypatch.setattr(sparse, "applies", lambda spec, device: False)
    general = run(spec, deliver=deliver)
    assert same(fast, general)
    assert fast["totals"]["lost"] > 0


@pytest.mark.parametrize("loss", ["bernoulli:0.5", "ge:rate=0.3,burst=3"])
def test_sends_without_packets_take_no_losses(loss, monkeypatch):
    """A ring of 4 over 1 to 3 packets has sends without packets, some starting where the next link's
    first packet does (past a full row of the draw): the losses go to the sends that own packets."""
    spec = NetworkSpec(ranks=4, seed=3, loss=loss, transport="drop")
    fast = run(spec, sizes=(1, 2, 3), calls=20, deliver=False)
    monkeypatch.setattr(sparse, "applies", lambda spec, device: False)
    assert same(fast, run(spec, sizes=(1, 2, 3), calls=20, deliver=False))
    assert fast["totals"]["lost"] > 0


def test_an_estimate_is_the_same_on_either_path(monkeypatch):
    workload = Workload(seq=64)
    rows = {}
    for name in ("sparse", "general"):
        rows[name] = [estimate("tiny-llama", job_config("tiny-llama", micro_batch=2, tp_size=4, seed=1, **settings),
                               workload, steps=2)
                      for settings in SETTINGS]
        monkeypatch.setattr(sparse, "applies", lambda spec, device: False)
    assert rows["sparse"] == rows["general"]
    assert any(row["elements_lost_fwd"] > 0 for row in rows["sparse"])


BURSTY = GilbertElliott.from_rate(0.05, 4)


@pytest.mark.parametrize("model", [Bernoulli(0.001), Bernoulli(0.01), Bernoulli(0.3), Bernoulli(0.5), BURSTY,
                                   GilbertElliott.from_rate(0.3, 20), GilbertElliott(0.9, 0.8)])
def test_lost_positions_are_the_mask_of_sample_with_states(model):
    """Short calls (one uniform per packet, at most _DENSE_BELOW packets) and long ones (gaps or sojourns),
    from a fresh chain and from a given state with fewer packets sent than drawn: the same lost packets,
    next state and generator state."""
    assert model.sparse
    for rows, width in ((3, 100), (8, 1024), (8, 2900), (1, 50000)):
        for given in (False, True):
            pick = torch.Generator().manual_seed(rows * width)
            state = torch.rand(rows, generator=pick) < 0.5 if given and model.hidden_state else None
            used = torch.randint(0, width + 1, (rows,), generator=pick) if given else None
            a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
            mask, _, after = model.sample_with_states((rows, width), a, state, used)
            flat, moved = model.lost_positions(rows, width, b, state, None if used is None else used.numpy())
            assert torch.equal(mask.flatten().nonzero().flatten(), torch.from_numpy(flat))
            assert same(moved, after)
            assert torch.equal(a.get_state(), b.get_state())


def test_only_a_simple_gilbert_chain_that_moves_takes_positions():
    """A chain that loses in Good or keeps some packets in Bad has losses apart from its states: masks."""
    cpu = torch.device("cpu")
    assert sparse.applies(NetworkSpec(ranks=4, loss="ge:rate=0.01,burst=4"), cpu)
    for loss in ("ge:p_gb=0.01,p_bg=0.25,loss_bad=0.9,loss_good=0.0",
                 "ge:p_gb=0.01,p_bg=0.25,loss_bad=1.0,loss_good=0.001",
                 "netem:loss gemodel 1% 25% 100% 0.1%"):
        spec = NetworkSpec(ranks=4, loss=loss)
        assert not spec.loss.sparse and not sparse.applies(spec, cpu)
    assert not GilbertElliott(0.0, 0.5).sparse and not GilbertElliott(0.5, 0.0).sparse
    assert not sparse.applies(NetworkSpec(ranks=4, loss="ge:rate=0.01,burst=4", transport="retransmit",
                                          nic="roce-gbn"), cpu)  # go-back-N reads masks


@pytest.mark.parametrize("algorithm, collective", [("ring", "all_reduce"), ("ring", "reduce_scatter"),
                                                   ("tree", "all_reduce")])
@pytest.mark.parametrize("tp", [2, 3, 4, 8])
def test_a_delivery_from_its_losses_is_combines(algorithm, collective, tp):
    """``Losses.delivery`` works a ring's or tree's Delivery out from the lost packets alone: the very
    tensors ``combine`` follows along every path, with and without ``rescale``'s weights, empty ring
    chunks and partial trees included."""
    import numpy as np
    from lossysim.net.algorithms import schedule
    from lossysim.net.receivers import combine, path_weights
    rng = np.random.default_rng(tp)
    for n_packets in (1, tp - 1, tp, 7, 60):
        sched = schedule(algorithm, collective, tp, n_packets)
        weights = path_weights(sched, torch.from_numpy(1 + rng.random(len(sched.sends))), torch.float32)
        for rate in (0.0, 0.05, 0.4, 1.0):
            lost = torch.from_numpy(rng.random((len(sched.sends), sched.max_packets)) < rate)
            losses = sparse.Losses.of(sched, lost)   # slots past a send's packets are junk: left out
            assert all(p < sched.sends[s].packets for s, p in zip(losses.send, losses.packet))
            for w in (None, weights):
                assert same(vars(losses.delivery(w)), vars(combine(sched, lost, w)))


def test_losses_of_a_mask_give_back_the_sent_packets_of_it():
    from lossysim.net.algorithms import schedule
    sched = schedule("tree", "all_reduce", 5, 9)
    lost = torch.rand(len(sched.sends), sched.max_packets, generator=torch.Generator().manual_seed(0)) < 0.5
    back = sparse.Losses.of(sched, lost).mask()
    for i, s in enumerate(sched.sends):
        assert torch.equal(back[i, :s.packets], lost[i, :s.packets]) and not back[i, s.packets:].any()


@pytest.mark.parametrize("xp", [np, torch])
def test_runs_are_counted_by_one_rule_on_either_representation(xp):
    """One batch on four links, worked by hand: link 0 (10 packets, a run of 3 left open before) loses
    0-2, 5, 7-8: the open run grows to 6 and closes, then runs of 1 and 2 close; link 1 sends 4 and loses
    none: its open run of 2 closes; link 2 sends nothing: its open run of 1 stays open; link 3 loses its
    last 2 of 3: a burst begun, left open."""
    a = lambda *v: xp.asarray(v) if xp is np else torch.tensor(v)  # noqa: E731
    row, stream = a(0, 0, 0, 0, 0, 0, 3, 3), a(0, 1, 2, 5, 7, 8, 1, 2)
    total, link_ids, open_run = a(10, 4, 0, 3), a(0, 1, 2, 3), a(3, 2, 1, 0)
    bursts, hist = xp.zeros_like(link_ids), xp.zeros_like(a(*[0] * 4 * 8))
    after = count_runs(xp, row, stream, total, link_ids, link_ids[row], open_run, 7, bursts, hist)
    assert after.tolist() == [0, 0, 1, 2]
    assert bursts.tolist() == [2, 0, 0, 1]                 # the carried run was begun before
    expected = np.zeros((4, 8), dtype=np.int64)
    expected[0, [6, 1, 2]] = 1
    expected[1, 2] = 1
    assert np.asarray(hist).reshape(8, 4).T.tolist() == expected.tolist()   # kept by length, then link
