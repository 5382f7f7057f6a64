"""Context parallelism: sequences cut into 2 x cp chunks over the context ranks, keys and values exchanged
over the lossy network (ring or all-gather).

Loss-free, a context-parallel model computes what the unsplit HF model does (logits, loss, every gradient,
to ``TOL``: the attention sums its keys in another order than HF's kernel); training with context, tensor and
data parallelism ends where one replica on the global batch ends; under loss the keys and values lose
packets at the configured rate where the mesh puts the context groups (across nodes); ``dist`` is ``sim`` bit
for bit, and a resumed run ends as an uninterrupted one."""
from __future__ import annotations

import copy
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from scipy import stats

from lossysim import LossyNetwork, cli, parallelize
from lossysim.config import ExperimentConfig
from lossysim.cp import apply_cp
from lossysim.io import read_jsonl
from lossysim.run.experiment import run_experiment
from lossysim.tp import gather_full_model
from _tp_common import assert_matches_hf, build
from test_data_parallel import PARAM_TOL, assert_dist_is_sim, sim_and_dist, tiny
from tiny_runs import train_steps

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (kind, family, tp, cp, mode, kv heads): cp 2 and 4, both modes, GPT-2 and Llama with grouped-query
# attention (2 kv heads; 1 with tp 2: both TP ranks hold a copy), causal LM, classification and a headless
# model, tp 1, 2 and 4. The batch's rows (10 tokens) are padded to 12 or 16: 2 x cp chunks.
CASES = [("lm", "gpt2", 1, 2, "ring", None), ("cls", "gpt2", 2, 4, "allgather", None),
         ("model", "gpt2", 2, 2, "ring", None), ("lm", "gpt2", 1, 4, "allgather", None),
         ("lm", "llama", 2, 4, "ring", 2), ("cls", "llama", 2, 2, "allgather", 1),
         ("cls", "llama", 1, 4, "ring", 2), ("lm", "llama", 4, 2, "allgather", 2)]


def _context_parallel(ref, kind: str, tp: int, cp: int, mode: str, **settings):
    config = ExperimentConfig(tp_size=tp, cp_size=cp, cp_mode=mode, max_length=16, ranks_per_node=tp,
                              **settings).validate()
    mesh = config.mesh()
    model = parallelize(copy.deepcopy(ref), tp, LossyNetwork(mesh.network_spec("tp", 0, config.network_settings())))
    return model, apply_cp(model, config, mesh)


@pytest.mark.parametrize("kind, family, tp, cp, mode, kv", CASES)
def test_loss_free_context_parallelism_computes_the_unsplit_model(kind, family, tp, cp, mode, kv):
    """Every rank's logits and loss and every gradient (TP layout) within TOL of HF's on the whole batch."""
    ref = build(kind, "sdpa", family=family, **({} if kv is None else {"num_key_value_heads": kv}))
    model, context = _context_parallel(ref, kind, tp, cp, mode)
    assert_matches_hf(ref, model, kind, tp)
    assert all(n.totals()["sent"] > 0 for n in context.train_networks.cp)


def test_loss_free_tp_cp_dp_trains_as_one_replica_on_the_global_batch(tmp_path):
    """tp 2 x cp 2 x dp 2 for 2 AdamW steps ends with the weights of one tp 1 replica trained on the whole
    batch, to PARAM_TOL; its replicas have not drifted."""
    single, _, _ = train_steps(tiny(tmp_path, tp_size=1), 2)
    split, state, _ = train_steps(tiny(tmp_path, tp_size=2, cp_size=2, dp_size=2, ranks_per_node=2), 2)
    expected = dict(gather_full_model(single.model).named_parameters())
    for replica in split.dp.replicas:
        got = dict(gather_full_model(replica.model).named_parameters())
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value.detach(), **PARAM_TOL, msg=name)
    assert split.dp.drift() == 0.0 and state.cp_s > 0


@pytest.mark.parametrize("mode", ["ring", "allgather"])
def test_keys_and_values_lose_packets_at_the_configured_rate_across_nodes(tmp_path, mode):
    """tp 2 x cp 2 with a TP group to a node: the TP links stay inside nodes and lose nothing; each TP
    position's context group crosses nodes and loses 5% of its keys' and values' packets and of their
    gradients' (binomial tests, every packet a trial)."""
    p = 0.05
    parts, _, _ = train_steps(tiny(tmp_path, tp_size=2, cp_size=2, cp_mode=mode, ranks_per_node=2,
                                   lossy_links="inter_node", loss=f"bernoulli:{p}"), 2)
    context = parts.context
    for network in [parts.train_net, *context.train_networks.tp]:
        assert network.totals()["sent"] > 0 and network.totals()["lost"] == 0
    for network in context.train_networks.cp:
        entries = network.summary(by=("direction", "link_class"))
        assert {(e["direction"], e["link_class"]) for e in entries} == {("fwd", "inter"), ("bwd", "inter")}
        for entry in entries:
            assert entry["sent"] > 0 and stats.binomtest(entry["lost"], entry["sent"], p).pvalue > 1e-3, entry


@pytest.mark.parametrize("mode", ["ring", "allgather"])
def test_dist_context_ranks_are_sim_bit_for_bit_under_loss(tmp_path, mode):
    """cp 2 as 2 gloo processes, the tiny GPT-2 as a causal LM (its head tied to the embeddings: both
    context ranks' gradients of it, summed in sim's order), keys and values losing 5% of their packets
    and masked where lost (the ring's sends, or the all-gather and its reduce-scatter): every metrics row
    and every saved weight, bit for bit."""
    rows, weights = sim_and_dist(tmp_path, tp_size=1, cp_size=2, cp_mode=mode, dp_size=1, task="lm",
                                 loss="bernoulli:0.05", recovery="mask", ranks_per_node=1, grad_clip=0.1)
    assert_dist_is_sim(rows, weights)
    last = [r for r in rows["sim"] if r["split"] == "train"][-1]
    assert last["packets_lost_cp_fwd"] > 0 and last["packets_lost_cp_bwd"] > 0 and last["cp_s_per_step"] > 0


def test_one_replica_s_context_ranks_sum_their_gradients_over_the_lossy_context_group(tmp_path):
    """tp 1 x cp 2 x dp 1, a context rank per node, only data-parallel traffic lossy (5%): the context ranks'
    gradients are all-reduced over their dp x cp group (Megatron's; here the context group), whose buckets
    lose packets at the configured rate (a binomial test, every packet a trial) and add their seconds to
    the step, while the keys and values lose none. Loss-free, the run still trains as the unsplit model."""
    p = 0.05
    parts, state, _ = train_steps(tiny(tmp_path, cp_size=2, ranks_per_node=1, lossy_traffic="dp",
                                       loss=f"bernoulli:{p}"), 2)
    assert parts.dp.grouped and len(parts.dp.networks) == 1
    totals = parts.dp.networks[0].totals()
    assert totals["sent"] > 0 and stats.binomtest(totals["lost"], totals["sent"], p).pvalue > 1e-3, totals
    assert all(n.totals()["lost"] == 0 for n in parts.context.train_networks.cp) and state.dp_s > 0
    single, _, _ = train_steps(tiny(tmp_path, tp_size=1), 2)
    split, _, _ = train_steps(tiny(tmp_path, cp_size=2, ranks_per_node=1), 2)
    expected = dict(gather_full_model(single.model).named_parameters())
    got = dict(gather_full_model(split.dp.replicas[0].model).named_parameters())
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value.detach(), **PARAM_TOL, msg=name)


def test_dist_sums_one_replica_s_context_gradients_over_the_lossy_group_as_sim_does(tmp_path):
    """cp 2 at dp 1 as 2 gloo processes, only the gradient buckets lossy (10%): every metrics row (their
    lost packets among them) and every saved weight, bit for bit."""
    rows, weights = sim_and_dist(tmp_path, tp_size=1, cp_size=2, dp_size=1, task="lm", loss="bernoulli:0.1",
                                 lossy_traffic="dp", ranks_per_node=1)
    assert_dist_is_sim(rows, weights)
    last = [r for r in rows["sim"] if r["split"] == "train"][-1]
    assert last["observed_loss_rate_dp"] > 0 and last["dp_s_per_step"] > 0


def test_a_context_parallel_run_resumes_exactly(tmp_path):
    """Stopped after its step-2 checkpoint and resumed, a lossy tp 2 x cp 2 run ends as the uninterrupted
    one: its context groups' and context ranks' networks (streams, counters, clock) come back with the
    model."""
    settings = dict(tp_size=2, cp_size=2, ranks_per_node=2, loss="bernoulli:0.05", recovery="mask", steps=4,
                    eval_every=2, save_checkpoint=True)
    whole = tiny(tmp_path, **settings, out=str(tmp_path / "whole"))
    summary = run_experiment(whole, whole.out, progress=False)
    assert summary["status"] == "completed"
    # summary.json's traffic classes count the keys' and values' packets as the context summary does
    cp = summary["context_parallel"]
    for direction, traffic in summary["traffic"]["cp"].items():
        assert traffic["lossy"] and traffic["sent"] == cp[f"packets_sent_cp_{direction}"] > 0
        assert traffic["lost"] == cp[f"packets_lost_cp_{direction}"] > 0
    cut = tiny(tmp_path, **settings, checkpoint_every=2, keep_checkpoints=0, out=str(tmp_path / "cut"))
    assert run_experiment(cut, cut.out, progress=False)["status"] == "completed"
    out = Path(cut.out)
    shutil.rmtree(out / "checkpoints" / "step-0000004")
    shutil.rmtree(out / "checkpoint")
    (out / "summary.json").unlink()
    assert run_experiment(cut, cut.out, progress=False, resume=True)["status"] == "completed"
    from safetensors.torch import load_file
    rows = {"sim": read_jsonl(Path(whole.out) / "metrics.jsonl"), "dist": read_jsonl(out / "metrics.jsonl")}
    assert len(rows["sim"]) == len(rows["dist"])
    assert_dist_is_sim(rows, [load_file(Path(d) / "checkpoint" / "model.safetensors") for d in (whole.out, cut.out)])


def test_a_sequence_length_cp_cannot_split_is_one_line_and_exit_2(tmp_path, capsys):
    code = cli.main(["train", "--cp-size", "3", "--set", "max_length=32", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "max_length=32 is not a multiple of 2 x cp_size = 6" in err
    assert not (tmp_path / "run").exists()


# -- what a lost key or value means ------------------------------------------------------------------

def _exchange_network(cp: int, loss: str, **settings) -> LossyNetwork:
    return LossyNetwork(cp, loss, seed=3, ranks_per_node=1, payload_bytes=64, **settings)


def _holes(missed: torch.Tensor, per_packet: int, n: int) -> torch.Tensor:
    return missed.repeat_interleave(per_packet, dim=-1)[..., :n]


def test_a_ring_forwards_what_arrived_and_a_hole_stays_for_every_rank_further_on():
    """cp 4, 10% Bernoulli loss: a block reaches the rank h hops on missing each packet with probability
    1 - 0.9^h (a hop forwards the holes it got: binomial tests per distance), holds zeros exactly where it
    misses a packet and the block's own values elsewhere, and what one rank misses the next misses too."""
    from lossysim.cp.exchange import ring_forward
    p, cp = 0.1, 4
    network = _exchange_network(cp, f"bernoulli:{p}")
    blocks = torch.randn(cp, 16 * 2000) + 5.0          # no element is 0 by chance
    held, missed, rounds = ring_forward(network, "h.0.attn.kv", blocks)
    per_packet, packets = network.packets(blocks.shape[1], blocks.dtype)
    assert len(rounds) == cp - 1 and missed.shape == (cp, cp, packets)
    for i in range(cp):
        assert not missed[i, i].any() and torch.equal(held[i, i], blocks[i])
        for j in range(cp):
            holes = _holes(missed[i, j], per_packet, blocks.shape[1])
            assert torch.equal(held[i, j], torch.where(holes, 0.0, blocks[j]))
            before = (i - 1) % cp
            if j != i:
                assert not (missed[before, j] & ~missed[i, j]).any()
    for h in range(1, cp):
        counts = [int(missed[(j + h) % cp, j].sum()) for j in range(cp)]
        assert stats.binomtest(sum(counts), cp * packets, 1 - (1 - p) ** h).pvalue > 1e-3, h


@pytest.mark.parametrize("mode", ["ring", "allgather"])
def test_retransmission_delivers_every_block_exact_and_a_deadline_leaves_holes(mode):
    """Retransmitted, every receiver holds every block exactly (nothing missing) and the repairs cost time;
    under a deadline what did not arrive in time is missing, a hole where the gaps say."""
    from lossysim.cp.exchange import FORWARD
    blocks = torch.randn(2, 4000) + 5.0
    repaired = _exchange_network(2, "bernoulli:0.2", transport="retransmit")
    held, missed, _ = FORWARD[mode](repaired, "h.0.attn.kv", blocks)
    assert missed is None and all(torch.equal(held[i, j], blocks[j]) for i in range(2) for j in range(2))
    assert repaired.clock()["retransmit_s"] > 0 and repaired.totals()["resent"] > 0
    late = _exchange_network(2, "bernoulli:0.2", transport="deadline", deadline=1.0)
    held, missed, _ = FORWARD[mode](late, "h.0.attn.kv", blocks)
    per_packet, _ = late.packets(blocks.shape[1], blocks.dtype)
    assert late.totals()["missing"] == int(missed.sum()) > 0
    for i in range(2):
        for j in range(2):
            assert torch.equal(held[i, j], torch.where(_holes(missed[i, j], per_packet, 4000), 0.0, blocks[j]))


def test_the_backward_sends_every_rank_s_key_value_gradient_back_to_the_block_s_owner():
    """Loss-free, each block's gradient is the sum of what every receiver's attention gave it (ring and
    all-gather alike); lost, the ring's backward misses some of it, the all-gather's reduce-scatter too."""
    from lossysim.cp.exchange import BACKWARD
    grads = torch.randn(4, 4, 1000)
    for mode in ("ring", "allgather"):
        got, rounds = BACKWARD[mode](_exchange_network(4, "none"), "h.0.attn.kv", grads)
        torch.testing.assert_close(got, grads.sum(0), rtol=1e-6, atol=1e-6)
        lossy, _ = BACKWARD[mode](_exchange_network(4, "bernoulli:0.2"), "h.0.attn.kv", grads)
        assert not torch.allclose(lossy, grads.sum(0))


@pytest.mark.parametrize("mode", ["ring", "allgather"])
@pytest.mark.parametrize("recovery", ["zero", "mask"])
def test_a_lost_key_is_a_zero_key_or_masked_out_of_the_softmax(monkeypatch, mode, recovery):
    """tp 1 x cp 2 GPT-2, 30% of the keys' and values' packets lost: in every layer each context rank's
    attention is, in fp64 and query by query, a softmax over the keys causally before it (padding out) of
    the blocks as they arrived (``zero``: lost elements zero, still in the softmax), or (``mask``) over those
    whose key and value arrived whole in that head only, renormalised."""
    from lossysim.cp import context as module
    seen = []
    exchanged, attend = module.exchanged, module.attention.attend

    def record_exchange(exchange, site, blocks):
        held, missed = exchanged(exchange, site, blocks)
        seen.append({"held": held.detach(), "missed": missed,
                     "per_packet": exchange.network.packets(held.shape[-1], held.dtype)[0]})
        return held, missed

    def record_attend(query, keys, values, ok, scaling, dropout):
        out = attend(query, keys, values, ok, scaling, dropout)
        seen[-1].update(query=query.detach(), out=out.detach(), scaling=scaling)
        return out
    monkeypatch.setattr(module, "exchanged", record_exchange)
    monkeypatch.setattr(module.attention, "attend", record_attend)
    ref = build("lm", "sdpa")
    model, context = _context_parallel(ref, "lm", 1, 2, mode, loss="bernoulli:0.3", recovery=recovery,
                                       lossy_traffic="cp_forward", payload_bytes=64)
    from _tp_common import make_batch
    batch = make_batch("lm")
    model.eval()
    with torch.no_grad():
        model(**batch)
    valid, k_pos, q_pos = context._keys
    heads, d = 4, 8
    assert len(seen) == 2 and any(s["missed"].any() for s in seen)
    for layer in seen:
        B, L = valid.shape[0], q_pos.shape[1]
        blocks = layer["held"].view(2, 2, 2, B, heads, L, d).double()     # [receiver, origin, K|V, ...]
        gone = _holes(layer["missed"], layer["per_packet"], layer["held"].shape[-1]).view(2, 2, 2, B, heads, L, d)
        gone = gone.any(-1).any(2)                                          # [receiver, origin, B, heads, L]
        query = layer["query"].view(2, B, heads, L, d).double()
        for c in range(2):
            keys = blocks[c, :, 0].permute(1, 2, 0, 3, 4).reshape(B, heads, 2 * L, d)
            values = blocks[c, :, 1].permute(1, 2, 0, 3, 4).reshape(B, heads, 2 * L, d)
            lost = gone[c].permute(1, 2, 0, 3).reshape(B, heads, 2 * L)
            for b in range(B):
                for h in range(heads):
                    for i in range(L):
                        ok = (k_pos <= q_pos[c, i]) & valid[b]
                        if recovery == "mask":
                            ok = ok & ~lost[b, h]
                        scores = keys[b, h, ok] @ query[c, b, h, i] * layer["scaling"]
                        expected = torch.softmax(scores, 0) @ values[b, h, ok]
                        got = layer["out"][c * B + b, i, h].double()
                        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


# -- the estimate --------------------------------------------------------------------------------------

@pytest.mark.usefixtures("private_cache")
@pytest.mark.parametrize("mode, changes", [("ring", dict(loss="bernoulli:0.05", transport="retransmit", nic="irn")),
                                           ("allgather", dict(loss="bernoulli:0.05", recovery="mask")),
                                           ("ring", dict(loss="none", dp_size=2))])
def test_a_tp_cp_estimate_counts_and_times_what_training_does(tmp_path, mode, changes):
    """tp 2 x cp 2 (a TP group to a node, the context groups across nodes), tiny-llama on 8 x 16-token
    batches: the estimate of the run's own config counts every context group's and every context rank's TP
    packets as training sent them, and its step is training's clock: compute, context rank 0's TP traffic and
    what the exchanges added beside attention."""
    from lossysim.estimate import Workload, estimate
    from test_estimate_job import STEPS, _totals, _trained
    config, parts, state, shape = _trained(tmp_path, cp_size=2, cp_mode=mode, ranks_per_node=2, **changes)
    row = estimate(shape, config, Workload(seq=16), steps=STEPS)
    contexts = [r.model.context for r in parts.dp.replicas]
    for cls, networks in (("cp", [n for c in contexts for n in c.train_networks.cp]),
                          ("tp", [r.model.group.network for r in parts.dp.replicas] +
                           [n for c in contexts for n in c.train_networks.tp])):
        trained = _totals(networks)
        for name in ("sent", "lost", "resent"):
            assert row[f"{cls}_packets_{name}"] * STEPS == trained[name], (cls, name)
    total = state.compute_s + parts.train_net.clock()["comm_s"] + state.cp_s + state.dp_s
    assert row["step_mean_s"] == pytest.approx(total / STEPS, rel=1e-12)
    assert row["cp_size"] == 2 and row["stack_cp_s"] > 0 and state.cp_s > 0
    if changes["loss"] != "none":
        assert row["cp_packets_lost"] > 0 and row["cp_repair_s"] >= 0


def test_the_estimate_refuses_a_sequence_cp_cannot_split(capsys):
    code = cli.main(["estimate", "llama-3.1-8b", "--seq", "131070", "--cp-size", "16"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--seq=131070 is not a multiple of 2 x cp_size = 32" in err


def test_the_estimate_counts_the_holes_a_ring_forwards():
    """cp 4 ring, 10% Bernoulli loss dropped: a block's receiver h hops on misses 1 - 0.9^h of its elements
    (what every hop on the way lost), a gradient's receiver what its own hop lost; the estimate's share of
    received key/value elements not exact is their mean, (mean_h (1 - 0.9^h) + 0.1) / 2, within sampling."""
    from lossysim.estimate import Workload, estimate, job_config
    p = 0.1
    config = job_config("tiny-llama", tp_size=1, cp_size=4, ranks_per_node=1, loss=f"bernoulli:{p}", max_length=1024)
    row = estimate("tiny-llama", config, Workload(seq=1024), steps=10)
    forwarded = sum(1 - (1 - p) ** h for h in range(1, 4)) / 3
    assert row["cp_elements_lost"] == pytest.approx((forwarded + p) / 2, abs=0.01)


@pytest.mark.parametrize("changes, message", [
    (dict(cp_size=2, recovery="rescale"),
     "cp_size=2: recovery=rescale does not act on key/value exchanges: use one of zero, mask"),
    (dict(recovery="mask"), "recovery=mask leaves lost keys out of attention: it needs cp_size > 1"),
    (dict(cp_size=2, dp_size=2, dp_mode="fsdp"), "cp_size=2 with dp_mode=fsdp"),
    (dict(cp_size=2, activation_checkpointing=True), "cp_size=2 with activation_checkpointing"),
    (dict(cp_size=2, cp_mode="ulysses"), "cp_mode='ulysses' must be")])
def test_settings_context_parallelism_does_not_take_are_one_line_errors(changes, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        ExperimentConfig(**changes).validate()


def test_the_network_refuses_a_policy_the_key_value_exchange_does_not_take_before_drawing():
    """The one rule (``recovery.require``) holds for a Python caller of ``with_gaps`` too: a policy that
    keeps state or spreads its holes is refused before any packet is drawn; zero and mask are the ones."""
    from lossysim.net import recovery
    assert recovery.KV_POLICIES == ("zero", "mask")
    for name in recovery.RECOVERY_POLICIES:
        net = LossyNetwork(2, "bernoulli:0.5", recovery=name)
        if name in recovery.KV_POLICIES:
            held, missed = net.with_gaps("kv", "fwd", "send", torch.ones(64), pair=(0, 1))
            assert held.shape == (64,) and net.totals()["sent"] > 0
            continue
        with pytest.raises(ValueError, match=f"^recovery={re.escape(name)} does not act on key/value exchanges"):
            net.with_gaps("kv", "fwd", "send", torch.ones(64), pair=(0, 1))
        assert net.totals()["sent"] == 0


def test_sampled_context_groups_count_what_they_stand_for():
    """tp 2 x cp 2 x pp 2 x dp 2 (stages alike), 4 micro-batches: with one group and one micro-batch of each
    simulated, the others drawn, the counts are scaled to stand for all of them, exactly loss-free and in
    packets sent; the packets lost within sampling of the full simulation's; the loss-free step the same."""
    from lossysim.estimate import Workload, estimate, job_config, load
    shape = load("tiny-llama")
    layout = dict(micro_batch=2, tp_size=2, cp_size=2, pp_size=2, dp_size=2, microbatches=4, ranks_per_node=2,
                  lossy_links="inter_node", max_length=256)
    for loss in ("none", "bernoulli:0.2"):
        config = job_config("tiny-llama", loss=loss, **layout)
        full, sampled = (estimate(shape, config, Workload(seq=256, sampled_groups=k), steps=2) for k in (0, 1))
        for key in ("cp_packets_sent", "tp_packets_sent", "loss_free_step_s"):
            assert sampled[key] == pytest.approx(full[key], rel=1e-12), (loss, key)
        if loss != "none":
            assert full["cp_packets_lost"] > 100
            assert sampled["cp_packets_lost"] == pytest.approx(full["cp_packets_lost"], rel=0.3)


def test_a_traced_context_parallel_job_gives_each_context_rank_s_tp_group_its_own_network(tmp_path):
    """tp 2 x cp 2 on 4 NCCL ranks (Megatron's order: a context group across the TP groups): the TP groups of
    context ranks 0 and 1 are two groups, each on its own network as training places it (not both on
    context rank 0's, sharing its streams and clock), and the context groups' all-gathers are class cp."""
    sys.path.insert(0, str(Path(__file__).parent))
    from nccl_trace import NcclCall, write_trace
    from lossysim.estimate import job_config, trace as traces, trace_replay as replays
    groups = {"1": (0, 1), "2": (2, 3), "3": (0, 2), "4": (1, 3)}
    for rank in range(4):
        tp, cp = ("1" if rank < 2 else "2"), ("3" if rank % 2 == 0 else "4")
        calls = [NcclCall("_allgather_base", 4096, 8192, cp, 100, 50), NcclCall("allreduce", 8192, 8192, tp, 300, 50)]
        write_trace(tmp_path / f"rank{rank}.json.gz", rank, groups, [(0, 1000, calls)], [(0, 90), (400, 550)])
    trace = traces.read(tmp_path)
    config = job_config(tp_size=2, cp_size=2, ranks_per_node=2, max_length=1024)
    layout = replays.Layout(trace, config)
    assert layout.describe(trace) == {"1": "tp", "2": "tp", "3": "cp", "4": "cp"}
    settings = config.network_settings()
    placed = []
    for group, context in (("1", 0), ("2", 1)):
        call = next(c for c in trace.ranks[groups[group][0]].calls[0] if c.group == group)
        place, _, _ = layout.place(call, groups[group])
        assert place.cls == "tp" and place.spec == config.mesh().network_spec("tp", config.mesh().rank(cp=context), settings)
        placed.append(place.key)
    assert placed[0] != placed[1]
    row = replays.simulate_trace(trace, config, steps=1)
    assert (row["tp_calls"], row["cp_calls"]) == (2, 2) and row["cp_bytes"] == 2 * 4096 * 2


@pytest.mark.parametrize("bandwidth, hidden", [("1Gbps", "neither"), ("67Gbps", "backward"), ("400Gbps", "both")])
def test_a_ring_round_costs_the_longer_of_its_send_and_the_attention_it_overlaps(tmp_path, bandwidth, hidden):
    """cp 4 ring, a context rank per node, loss-free: every block's 3 rounds each way add what their send
    (timed alone on the context group's network) takes beyond one ring step's attention (backward's twice
    forward's): over slow links both, over links whose send falls between the two only the forward's, over
    fast links nothing, the sends hidden."""
    from lossysim import timing
    from lossysim.cp import clock as cp_clock
    from lossysim.estimate import Workload, estimate, job_config, load
    path = tmp_path / "config.json"   # Llama-like blocks (32 heads, 8 kv heads of 128): attention outlasts a send
    path.write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, '
                    '"num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8, '
                    '"intermediate_size": 11008, "vocab_size": 1000, "max_position_embeddings": 32768}')
    seq, cp, shape = 32768, 4, load(str(path))
    # the context ranks' gradients are all-reduced after the backward (not beside it), so the step is the
    # sends' exposure plus what it was
    config = job_config(str(path), tp_size=1, cp_size=cp, ranks_per_node=1, max_length=seq,
                        link_inter=f"roce-400g,bw={bandwidth}", dp_overlap=False)
    net = LossyNetwork(config.mesh().network_spec("cp", 0, config.network_settings(), ("fwd", "bwd")))
    net.simulate("kv", "fwd", 2 * 8 * (seq // cp) * 128, torch.bfloat16, "send", pair=(0, 1))   # one block's
    send = net.clock()["comm_s"]
    gpu = timing.parse_compute(config.compute)
    forward, backward = (gpu.seconds(cp_clock.attention_step_flops(1, seq, shape.hidden, 1, cp, d))
                         for d in ("fwd", "bwd"))
    assert {"neither": send > backward, "backward": forward < send < backward, "both": send < forward}[hidden]
    row = estimate(shape, config, Workload(seq=seq), steps=1)
    exposed = shape.layers * (cp - 1) * (max(0.0, send - forward) + max(0.0, send - backward))
    assert row["stack_cp_s"] == pytest.approx(exposed, rel=1e-9, abs=1e-15)
    assert (row["stack_cp_s"] == 0) == (hidden == "both")
