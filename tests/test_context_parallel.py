"""Context parallelism: sequences cut into 2 x cp chunks over the context ranks, keys and values exchanged
over the lossy network (ring or all-gather).

Loss-free, a context-parallel model computes what the unsplit HF model does (logits, loss, every gradient,
to ``TOL``: the attention sums its keys in another order than HF's kernel); training with context, tensor and
data parallelism ends where one replica on the global batch ends; under loss the keys and values lose
packets at the configured rate where the mesh puts the context groups (across nodes); ``dist`` is ``sim`` bit
for bit, and a resumed run ends as an uninterrupted one."""
from __future__ import annotations

import copy
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
    model = parallelize(copy.deepcopy(ref), tp, LossyNetwork(mesh.tp_network_spec(config.network_settings())))
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


def test_dist_context_ranks_are_sim_bit_for_bit_under_loss(tmp_path):
    """cp 2 as 2 gloo processes, the tiny GPT-2 as a causal LM (its head tied to the embeddings: both
    context ranks' gradients of it, summed in sim's order), keys and values losing 5% of their packets
    and masked where lost: every metrics row and every saved weight, bit for bit."""
    rows, weights = sim_and_dist(tmp_path, tp_size=1, cp_size=2, dp_size=1, task="lm", loss="bernoulli:0.05",
                                 recovery="mask", ranks_per_node=1, grad_clip=0.1)
    assert_dist_is_sim(rows, weights)
    last = [r for r in rows["sim"] if r["split"] == "train"][-1]
    assert last["packets_lost_cp_fwd"] > 0 and last["packets_lost_cp_bwd"] > 0 and last["cp_s_per_step"] > 0


def test_a_context_parallel_run_resumes_exactly(tmp_path):
    """Stopped after its step-2 checkpoint and resumed, a lossy tp 2 x cp 2 run ends as the uninterrupted
    one: its context groups' and context ranks' networks (streams, counters, clock) come back with the
    model."""
    settings = dict(tp_size=2, cp_size=2, ranks_per_node=2, loss="bernoulli:0.05", recovery="mask", steps=4,
                    eval_every=2, save_checkpoint=True)
    whole = tiny(tmp_path, **settings, out=str(tmp_path / "whole"))
    assert run_experiment(whole, whole.out, progress=False)["status"] == "completed"
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
