"""lossysim estimate of experts beside context parallelism (ep carved out of dp x cp, as training's mesh carves
it): the ep and expert-data groups are training's, a rank's all-to-alls carry its own seq / cp tokens' rows (at
zero loss their closed form, on the clock beside the context exchanges), loss on them is counted at the
configured rate, also where a replica's context ranks sit in several ep groups (ep below or beside cp:
Megatron's carving, which training refuses)."""
import sys

import pytest
from scipy import stats

from lossysim.cli import main
from lossysim.estimate import Workload, estimate, job_config, load
from lossysim.ep import routing
from lossysim.ep.estimate import expert_data
from lossysim.estimate.job import Job
from lossysim.mesh import Mesh
from lossysim.pp.stages import stage_layout
from test_estimate_experts import _call_seconds

pytestmark = pytest.mark.usefixtures("private_cache", "one_torch_thread")

LOSSY = dict(loss="bernoulli:0.05", lossy_traffic="ep_dispatch,ep_combine", ranks_per_node=1)


def _job(config, seq: int) -> Job:
    shape = load("tiny-moe")
    return Job(shape, config, Workload(seq=seq), stage_layout(config.pp_layout, config.pp_size, shape.layers),
               seq * config.micro_batch_size)


@pytest.mark.parametrize("tp,cp,dp,ep", [(1, 2, 2, 4), (2, 2, 2, 4), (1, 2, 2, 2), (2, 2, 1, 2),
                                         (1, 4, 1, 2), (2, 4, 2, 2), (1, 3, 2, 2)])
def test_ep_and_expert_data_groups_are_training_s(tp, cp, dp, ep, monkeypatch):
    """The groups the estimate builds networks on (asked of the mesh rank by rank) are the mesh's ep and edp
    groups, as training builds them (``ep.apply._connect_sim``: replica r's context rank 0 at each stage and TP
    position) when ep is a multiple of cp; a replica's clock reads its own context ranks' ep groups (one then;
    with ep below or beside cp, as Megatron carves it and training does not run, every group one of them is in)."""
    asked = {"ep": [], "edp": []}
    spec = Mesh.network_spec

    def recording(mesh, axis, rank, settings, lossy=None, traffic=None):
        if axis in asked and traffic in (None, "ep_dispatch") and \
                sys._getframe(1).f_globals["__name__"] == "lossysim.ep.estimate":   # the estimate's own groups
            asked[axis].append(tuple(mesh.group(axis, rank)))
        return spec(mesh, axis, rank, settings, lossy, traffic)
    monkeypatch.setattr(Mesh, "network_spec", recording)
    config = job_config("tiny-moe", micro_batch=1, microbatches=1, tp_size=tp, cp_size=cp, dp_size=dp, ep_size=ep,
                        max_length=96, **LOSSY)
    job = _job(config, 48)   # a multiple of 2 x cp
    mesh = config.mesh()
    training = {tuple(mesh.group("ep", mesh.rank(dp=r, tp=t, cp=c))) for r in range(dp) for t in range(tp)
                for c in (range(1) if ep % cp == 0 else range(cp))}
    assert set(asked["ep"]) == training == {tuple(g) for g in mesh.groups("ep")}
    assert len(asked["ep"]) == len(training) == tp * dp * cp // ep and all(len(g) == ep for g in training)
    edp = [tuple(g) for g in mesh.groups("edp")] if mesh.size("edp") > 1 else []
    assert sorted(asked["edp"]) == sorted(edp) and len(edp) == (tp * ep if mesh.size("edp") > 1 else 0)
    # the job's groups in (TP position, expert-data index) order; replica r's context ranks' index its own
    assert [g.specs[0] for g in job.ep[0]] == [
        spec(mesh, "ep", mesh.rank(tp=t, dp=g * ep // cp, cp=g * ep % cp), config.network_settings(),
             config.lossy_directions("ep_dispatch"), "ep_dispatch") for t in range(tp) for g in range(dp * cp // ep)]
    for r in range(dp):   # the (context, replica) index cp + cp_size x dp cut ep innermost
        assert expert_data(mesh, r) == tuple(range(r * cp // ep, ((r + 1) * cp - 1) // ep + 1))
        assert len(expert_data(mesh, r)) == (1 if ep % cp == 0 else len({(r * cp + c) // ep for c in range(cp)}))


@pytest.mark.parametrize("cp,dp,ep,pp", [(2, 2, 4, 1), (2, 2, 2, 1), (2, 2, 2, 2), (4, 1, 2, 1), (4, 2, 2, 1)])
def test_zero_loss_all_to_alls_carry_a_context_rank_s_tokens_in_closed_form(cp, dp, ep, pp):
    """tiny-moe, cp 2 or 4 (ep 2: a replica's context ranks in two ep groups, each its slowest's): each rank routes its own seq / cp tokens of every sequence (top-k rows each, uniform over
    the experts); per micro-batch and MoE block a dispatch and a combine forward and their gradients backward,
    each the all-to-all's loss-free time for those rows, on the replica's stream beside the context exchanges:
    the stacked parts sum to the step. With stages (which training does not run beside experts and context
    ranks) each stage's blocks send on its own ep groups, the same packets in all; the schedule's step holds
    their seconds."""
    shape = load("tiny-moe")
    config = job_config("tiny-moe", micro_batch=2, microbatches=2, tp_size=1, cp_size=cp, dp_size=dp, ep_size=ep,
                        pp_size=pp, ranks_per_node=2, link_inter="roce-400g")
    row = estimate(shape, config, Workload(seq=32), steps=2)
    tokens, k, hidden = 2 * 32 // cp, 2, 64
    per = routing.rows(tokens, k, 8, ep)
    assert per == [[tokens * k // ep] * ep] * ep
    counts = tuple(0 if s == d else per[s][d] * hidden for s in range(ep) for d in range(ep))
    spec = config.mesh().network_spec("ep", 0, config.network_settings(), ("fwd", "bwd"), "ep_dispatch")
    seconds, sent = _call_seconds(spec, counts, 2)
    calls = 2 * len(shape.experts.blocks) * 2                 # micro-batches x blocks x (forward, backward)
    groups = dp * cp // ep
    for cls in ("ep_dispatch", "ep_combine"):
        assert row[f"{cls}_packets_sent"] == calls * sent * groups
        if pp > 1:
            assert 0 < row[f"{cls}_loss_free_s"] <= calls * seconds * (1 + 1e-9)
            continue
        assert row[f"{cls}_loss_free_s"] == pytest.approx(calls * seconds, rel=1e-9)
        assert row[f"stack_{cls}_s"] == pytest.approx(calls * seconds, rel=1e-9)
    assert row["cp_packets_sent"] > 0 and row["slowdown"] == pytest.approx(1.0)
    if pp > 1:
        return
    parts = ("compute", "tp", "cp", "ep_dispatch", "ep_combine", "dp")
    assert sum(row[f"stack_{name}_s"] for name in parts) == pytest.approx(row["loss_free_step_s"], rel=1e-9)


def test_ep_over_dp_and_cp_loses_at_the_configured_rate():
    """ep 4 carved out of dp 2 x cp 2: the dispatch's and combine's forward packets lose at 5% (the backward,
    the other half of those sent, is loss-free)."""
    config = job_config("tiny-moe", micro_batch=2, tp_size=1, cp_size=2, dp_size=2, ep_size=4, **LOSSY)
    row = estimate("tiny-moe", config, Workload(seq=64), steps=4)
    for cls in ("ep_dispatch", "ep_combine"):
        sent, lost = round(row[f"{cls}_packets_sent"] * 4), round(row[f"{cls}_packets_lost"] * 4)
        assert sent > 300 and stats.binomtest(lost, sent // 2, 0.05).pvalue > 1e-3, (cls, lost, sent)
        assert 0 < row[f"{cls}_elements_lost"] < 0.05
    assert row["cp_packets_lost"] == row["dp_packets_lost"] == 0
    # retransmitted: every loss repaired, the repairs on the replicas' streams
    config = job_config("tiny-moe", micro_batch=2, tp_size=1, cp_size=2, dp_size=2, ep_size=4, transport="retransmit",
                        **LOSSY)
    repaired = estimate("tiny-moe", config, Workload(seq=64), steps=1)
    assert repaired["ep_dispatch_packets_resent"] > 0 and repaired["ep_dispatch_elements_lost"] == 0
    assert repaired["ep_dispatch_repair_s"] > 0 and repaired["step_mean_s"] > repaired["loss_free_step_s"]


def test_the_command_times_experts_beside_context_parallelism(capsys):
    code = main(["estimate", "tiny-moe", "--tp-size", "1", "--cp-size", "2", "--dp-size", "2", "--ep-size", "4",
                 "--seq", "16", "--loss", "bernoulli:0.01", "--ranks-per-node", "1", "--steps", "1", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0 and "cp2" in err and "ep4" in err and "bernoulli:0.01" in out


def test_a_replica_s_context_ranks_over_several_ep_groups_are_timed_and_lose_at_the_configured_rate(capsys):
    """cp 4 x ep 2 (Megatron's carving; training refuses it): the command runs, and each ep group's forward
    packets lose at 5%."""
    code = main(["estimate", "tiny-moe", "--tp-size", "1", "--cp-size", "4", "--dp-size", "1", "--ep-size", "2",
                 "--seq", "16", "--steps", "1", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0 and "cp4" in err and "ep2" in err, err
    config = job_config("tiny-moe", micro_batch=2, tp_size=1, cp_size=4, dp_size=1, ep_size=2, **LOSSY)
    row = estimate("tiny-moe", config, Workload(seq=128), steps=4)
    for cls in ("ep_dispatch", "ep_combine"):
        sent, lost = round(row[f"{cls}_packets_sent"] * 4), round(row[f"{cls}_packets_lost"] * 4)
        assert sent > 300 and stats.binomtest(lost, sent // 2, 0.05).pvalue > 1e-3, (cls, lost, sent)
