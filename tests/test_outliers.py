"""``outliers`` and ``outliers+hadamard``: each rank's largest elements over a reliable side path.

What the policy delivers is checked against its closed form: ``zero`` (same seed, so the same masks)
applied to the messages without their outliers, plus every rank's outliers added back. The side
path's packets and time are checked against the time model's formula for an all-gather of the
bytes it carries, and its repairs against the transport's promise (nothing missing).
"""
from __future__ import annotations

import math
from collections import defaultdict, deque

import pytest
import torch

from lossysim import LossyNetwork, cli, parallelize
from lossysim.net import recovery
from lossysim.net.algorithms import ALGORITHMS
from lossysim.net.spec import NetworkSpec
from lossysim.timing import nccl, parse_compute

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SIDE = "s/outliers"


def largest(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k elements of largest magnitude, by a full sort (not the policy's top-k)."""
    index = x.abs().argsort(dim=1, descending=True)[:, :k]
    return index, x.gather(1, index)


def planted(tp: int, n: int, seed: int, scale: float = 1000.0) -> torch.Tensor:
    """Gaussian messages, each rank with a few elements ``scale`` times larger at places of its own."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tp, n, generator=g, dtype=torch.float64)
    for r in range(tp):
        x[r, torch.randperm(n, generator=g)[:3]] *= scale
    return x


def side_rows(net: LossyNetwork) -> list[dict]:
    return [row for row in net.stats() if row["site"] == SIDE]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("tp", [2, 3, 5])
def test_outliers_arrive_exactly_and_the_rest_is_what_zero_delivers(algorithm, tp):
    """Bit for bit: zero (same seed: same masks) of the messages with each rank's k largest zeroed,
    plus every rank's k largest added at every receiver. The main packets lost are zero's; some of
    them held an outlier, which zero of the whole messages then loses."""
    fraction, n = 0.002, 3000
    k = math.ceil(fraction * n)
    spec = dict(seed=tp, algorithm=algorithm, payload_bytes=256, outlier_fraction=fraction)
    net = LossyNetwork(tp, "bernoulli:0.2", recovery="outliers", **spec)
    zero, zero_whole = (LossyNetwork(tp, "bernoulli:0.2", recovery="zero", **spec) for _ in range(2))
    outliers_hit = 0
    for call in range(4):
        x = planted(tp, n, seed=call)
        index, values = largest(x, k)
        rest = x.scatter(1, index, 0.0)
        expected = zero.all_reduce("s", "fwd", rest, range(tp)).clone()
        for r in range(tp):
            expected += torch.zeros(n, dtype=x.dtype).scatter(0, index[r], values[r])
        out = net.all_reduce("s", "fwd", x, range(tp))
        assert torch.equal(out, expected)
        whole = zero_whole.all_reduce("s", "fwd", x, range(tp))
        for r in range(tp):   # a place where rank r's outlier went missing under zero
            outliers_hit += int(((whole - x.sum(0))[:, index[r]].abs() > 100).sum())
    assert outliers_hit > 0
    assert [row for row in net.stats() if row["site"] == "s"] == zero.stats()
    assert sum(row["lost"] for row in zero.stats()) > 0


def test_loss_free_outliers_return_the_exact_sum():
    """Nothing lost (the links could lose packets: one node, only inter-node links lossy): every
    receiver holds the sum, the policy ran (its compute and side path are charged)."""
    x = planted(4, 2000, seed=1)
    for name in ("outliers", "outliers+hadamard"):
        net = LossyNetwork(4, "bernoulli:0.5", recovery=name, hadamard_block=256, lossy_links="inter_node",
                           ranks_per_node=4, outlier_fraction=0.01)
        torch.testing.assert_close(net.all_reduce("s", "bwd", x, range(4)), x.sum(0).expand(4, -1),
                                   rtol=1e-12, atol=1e-9)
        assert net.clock()["recovery_s"] > 0 and side_rows(net)


@pytest.mark.parametrize("numel, fraction, k", [(1, 1e-3, 1), (5, 1e-3, 1), (3000, 1e-3, 3), (3001, 1e-3, 4),
                                                (30, 0.1, 3), (7, 0.5, 4), (10**6, 1e-6, 1)])
def test_k_and_the_side_path_bytes(numel, fraction, k):
    """k = ceil(fraction x n), at least 1; a pair is an int32 index and a value in the message dtype."""
    policy = recovery.policy("outliers", outlier_fraction=fraction)
    assert recovery.outlier_count(numel, fraction) == k
    assert policy.side_bytes(numel, torch.float32) == 8 * k
    assert policy.side_bytes(numel, torch.bfloat16) == 6 * k
    assert recovery.ZERO.side_bytes(numel, torch.float32) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp, ranks_per_node", [(3, None), (4, 2)])
def test_side_path_is_charged_as_an_all_gather_of_its_bytes(dtype, tp, ranks_per_node):
    """The side path sends tp (tp - 1) packets per packet of a rank's pairs (a ring all-gather), its
    repairs aside; recovery_s is calls x (the policy's compute, 2n + (tp + 1) k FLOPs at the GPU rate,
    plus NCCL's loss-free all-gather time of k pairs), so comm_s = ideal + retransmit + recovery. On
    one node (only inter-node links lossy) nothing is lost or repaired; on two, the side path's
    repairs go to retransmit_s, never to recovery_s."""
    n, fraction, calls, payload = 5000, 0.01, 3, 1450
    k = math.ceil(fraction * n)
    nbytes = k * (4 + dtype.itemsize)
    rate = 1e12 * 0.5
    net = LossyNetwork(tp, "bernoulli:0.3", recovery="outliers", outlier_fraction=fraction, payload_bytes=payload,
                       compute="flops=1e12,mfu=0.5", ranks_per_node=ranks_per_node or tp, lossy_links="inter_node")
    spec = net.spec
    x = torch.randn(tp, n).to(dtype)
    for _ in range(calls):
        net.all_reduce("s", "fwd", x, range(tp))
    if ranks_per_node is None:   # one node: nothing can be lost
        assert net.totals()["lost"] == 0
    rows = side_rows(net)
    assert sum(row["sent"] for row in rows) - sum(row["resent"] for row in rows) == \
        calls * tp * (tp - 1) * -(-nbytes // payload)
    gather = nccl.collective_time("all_gather", "ring", tp, spec.topology.nodes, nbytes, payload, spec.link_intra,
                                  spec.link_inter, spec.bus_bandwidth())
    flops = 2 * n + (tp + 1) * k
    clock = net.clock()
    assert clock["recovery_s"] == pytest.approx(calls * (flops / rate + gather), rel=1e-12)
    assert clock["comm_s"] == pytest.approx(clock["ideal_comm_s"] + clock["retransmit_s"] + clock["recovery_s"],
                                            rel=1e-12)
    if ranks_per_node is None:
        assert clock["retransmit_s"] == 0.0
    assert parse_compute("flops=1e12,mfu=0.5").seconds(flops) == pytest.approx(flops / rate)


def test_with_loss_the_side_path_retransmits_and_misses_nothing():
    """Whatever ``transport`` says (drop here), the pairs are repaired until delivered: resends on the
    side path's own rows, nothing missing there, the repairs in retransmit_s; the main message lost
    packets that stay lost."""
    tp = 3
    net = LossyNetwork(tp, "bernoulli:0.2", seed=4, recovery="outliers", outlier_fraction=0.5)
    x = torch.randn(tp, 4000)
    for _ in range(3):
        net.all_reduce("s", "bwd", x, range(tp))
    side = side_rows(net)
    assert sum(row["lost"] for row in side) > 0 and sum(row["resent"] for row in side) > 0
    assert sum(row["missing"] for row in side) == 0 and net.totals()["failures"] == 0
    assert net.clock()["retransmit_s"] > 0
    main = [row for row in net.stats() if row["site"] == "s"]
    assert sum(row["lost"] for row in main) > 0 and sum(row["resent"] for row in main) == 0


def test_outliers_beat_hadamard_and_zero_where_the_outliers_are():
    """Two sites: one whose messages carry planted outliers (1000x), one plain Gaussian. At the
    outliers' places zero loses a whole outlier now and then and hadamard spreads every lost
    coefficient's share of them over the block; outliers delivers them. On the plain site the
    remainder still gains from hadamard: outliers+hadamard's largest error is below outliers'."""
    tp, n, block = 3, 16384, 16384
    nets = {name: LossyNetwork(tp, "bernoulli:0.05", seed=2, recovery=name, hadamard_block=block,
                               outlier_fraction=0.001) for name in
            ("zero", "hadamard", "outliers", "outliers+hadamard")}
    at_outliers = dict.fromkeys(nets, 0.0)
    plain_largest = dict.fromkeys(nets, 0.0)
    g = torch.Generator().manual_seed(9)
    for call in range(12):
        x = planted(tp, n, seed=100 + call)
        places = (x.abs() > 50).any(0)
        y = torch.randn(tp, n, generator=g, dtype=torch.float64)
        for name, net in nets.items():
            error = net.all_reduce("mlp", "fwd", x, range(tp)) - x.sum(0)
            at_outliers[name] += error[:, places].pow(2).sum().item()
            plain = net.all_reduce("attn", "fwd", y, range(tp)) - y.sum(0)
            plain_largest[name] = max(plain_largest[name], plain.abs().max().item())
    assert at_outliers["outliers"] < 1e-3 * min(at_outliers["zero"], at_outliers["hadamard"]), at_outliers
    assert at_outliers["outliers+hadamard"] < 1e-3 * at_outliers["hadamard"], at_outliers
    assert plain_largest["outliers+hadamard"] < 0.5 * plain_largest["outliers"], plain_largest


def test_a_replayed_call_replays_its_side_path():
    """Activation checkpointing: a replayed call returns the same output, counts nothing again, and
    charges its sends again, the side path's included (its repairs exactly as recorded)."""
    tp = 3
    spec = dict(seed=6, recovery="outliers", outlier_fraction=0.3)
    xs = [torch.randn(tp, 3000, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    net, plain, first_two = (LossyNetwork(tp, "bernoulli:0.2", **spec) for _ in range(3))
    record = defaultdict(deque)
    for x in xs[:2]:
        with net.recording(record):
            out = net.all_reduce("s", "fwd", x, range(tp))
        with net.replaying(record):
            assert torch.equal(net.all_reduce("s", "fwd", x, range(tp)), out)
        assert torch.equal(plain.all_reduce("s", "fwd", x, range(tp)), out)
        first_two.all_reduce("s", "fwd", x, range(tp))
    assert torch.equal(net.all_reduce("s", "fwd", xs[2], range(tp)), plain.all_reduce("s", "fwd", xs[2], range(tp)))
    assert net.stats() == plain.stats() and sum(row["resent"] for row in side_rows(net)) > 0
    for key, value in net.clock().items():
        assert value == pytest.approx(plain.clock()[key] + first_two.clock()[key], rel=1e-12), key


def test_a_saved_network_goes_on_exactly_side_path_included():
    tp = 3
    spec = dict(seed=5, recovery="outliers+hadamard", hadamard_block=64, outlier_fraction=0.2)
    xs = [torch.randn(tp, 500, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    net = LossyNetwork(tp, "ge:rate=0.2,burst=3", **spec)
    for x in xs[:3]:
        net.all_reduce("s", "bwd", x, range(tp))
    restored = LossyNetwork(tp, "ge:rate=0.2,burst=3", **spec)
    restored.load_state_dict(net.state_dict())
    for x in xs[3:]:
        assert torch.equal(restored.all_reduce("s", "bwd", x, range(tp)), net.all_reduce("s", "bwd", x, range(tp)))
    assert restored.stats() == net.stats() and restored.clock() == net.clock()
    assert net.clock()["retransmit_s"] > 0
    with pytest.raises(ValueError, match="outlier_fraction"):
        LossyNetwork(tp, "ge:rate=0.2,burst=3", **{**spec, "outlier_fraction": 0.1}).load_state_dict(net.state_dict())


def test_tensor_parallel_training_with_recomputation_is_exact():
    """Two steps of a tiny TP GPT-2 under bursty loss: the main packets lost are zero's, and activation
    checkpointing replays masks and side paths alike (the same gradients, counts and clock)."""
    from _tp_common import two_steps
    runs = {}
    for name in ("outliers", "outliers/recomputed", "zero"):
        network = LossyNetwork(2, "ge:rate=0.2,burst=3", seed=3, recovery=name.split("/")[0])
        runs[name] = (*two_steps(network, recompute=name.endswith("/recomputed")), network.clock())
    losses, grad, counted, clock = runs["outliers"]
    main = [row for row in counted if not row["site"].endswith("/outliers")]
    assert main == runs["zero"][2] and len(main) < len(counted)
    assert torch.isfinite(losses).all()
    assert any(not torch.equal(grad[k], runs["zero"][1][k]) for k in grad)
    again_losses, again, recounted, reclock = runs["outliers/recomputed"]
    assert recounted == counted and torch.equal(again_losses, losses)
    assert reclock["recovery_s"] > clock["recovery_s"]     # the recomputed forward sends again
    for name, value in grad.items():
        assert torch.equal(again[name], value), name


@pytest.mark.parametrize("value", ["0", "0.6", "-0.1", "nan"])
def test_a_bad_outlier_fraction_is_one_line_and_exit_2(tmp_path, capsys, value):
    out = tmp_path / "run"
    code = cli.main(["train", "--set", "recovery=outliers", "--set", f"outlier_fraction={value}", "--loss", "bernoulli:0.1",
                     "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "outlier_fraction" in err and "(0, 0.5]" in err, err
    assert not out.exists()
    with pytest.raises(ValueError, match=r"^outlier_fraction=.* must be in \(0, 0.5\]"):
        NetworkSpec(2, outlier_fraction=float(value))


def test_settings_that_cannot_repair_the_side_path_are_refused():
    with pytest.raises(ValueError, match="retransmits its outliers"):
        NetworkSpec(2, "bernoulli:1", recovery="outliers")
    with pytest.raises(ValueError, match="dp_mode=fsdp: recovery=outliers does not act on reduce-scatters"):
        from lossysim.config import ExperimentConfig
        ExperimentConfig(dp_size=2, tp_size=1, batch_size=4, dp_mode="fsdp", recovery="outliers").validate()
    with pytest.raises(ValueError, match="does not act on reduce-scatters"):
        LossyNetwork(2, "bernoulli:0.1", recovery="outliers").reduce_scatter("s", "bwd", torch.ones(2, 8), [0, 1])


def test_outlier_fraction_at_its_default_leaves_run_identity_alone(monkeypatch):
    """Sweeps written before the key find their runs: the hash of a config at the default is the one a
    version without the key computes, another value changes it; a network state records the key only
    under an outliers policy."""
    from lossysim.config import ExperimentConfig
    from lossysim.run.sweep import config_key
    configs = [ExperimentConfig(), ExperimentConfig(recovery="hadamard", loss="bernoulli:0.1")]
    now = [config_key(c) for c in configs]
    changed = config_key(configs[1].replace(recovery="outliers", outlier_fraction=0.01))
    assert changed != config_key(configs[1].replace(recovery="outliers"))
    to_dict = ExperimentConfig.to_dict
    monkeypatch.setattr(ExperimentConfig, "to_dict",
                        lambda self: {k: v for k, v in to_dict(self).items() if k != "outlier_fraction"})
    assert now == [config_key(c) for c in configs]
    assert "outlier_fraction" not in LossyNetwork(2, "bernoulli:0.1", recovery="hadamard").spec.as_dict()
    assert LossyNetwork(2, "bernoulli:0.1", recovery="outliers").spec.as_dict()["outlier_fraction"] == 1e-3


def test_ddp_gradient_buckets_lose_zeros_packets_and_keep_their_outliers(tmp_path):
    """dp 2, loss on the gradient buckets only: the buckets lose the packets zero loses, the side paths
    repair theirs, and the replicas end with finite parameters that are not zero's."""
    from test_data_parallel import _lossy_step, tiny
    config = tiny(tmp_path, tp_size=1, dp_size=2, loss="bernoulli:0.1", lossy_traffic="dp")
    runs = {name: _lossy_step(config.replace(recovery=name))[0] for name in ("zero", "outliers")}

    def rows(parts, side: bool) -> list[dict]:
        return [row for net in parts.dp.networks for row in net.stats() if row["site"].endswith("/outliers") == side]
    assert rows(runs["outliers"], False) == rows(runs["zero"], False)
    assert sum(row["lost"] for row in rows(runs["zero"], False)) > 0
    side = rows(runs["outliers"], True)
    assert side and all(row["site"].startswith("dp.bucket") for row in side)
    assert sum(row["missing"] for row in side) == 0
    for zero, coped in zip(runs["zero"].dp.replicas, runs["outliers"].dp.replicas):
        params = list(coped.model.parameters())
        assert all(torch.isfinite(p).all() for p in params)
        assert not all(torch.equal(a, b) for a, b in zip(zero.model.parameters(), params))


def test_ddp_resumed_run_ends_as_the_uninterrupted_one(tmp_path, monkeypatch):
    """tp 2 x dp 2, outliers on TP activations and gradients and on the DDP buckets: a run resumed from
    its first checkpoint ends exactly as the uninterrupted one (the side paths' streams, counts and
    clocks travel in the checkpoint)."""
    from test_resume import assert_resumes_exactly, config_for
    monkeypatch.setenv("LOSSYSIM_CACHE", str(tmp_path / "cache"))
    config = config_for(tmp_path / "full", steps=6, eval_every=3, checkpoint_every=3, recovery="outliers",
                        outlier_fraction=0.01, dp_size=2, dp_bucket_mb=0.05)
    assert_resumes_exactly(config, tmp_path / "resumed")
