"""A collective the transport gives up on fails the job whichever group ran it: the run counts every
training network's failures (not replica 0's TP network's alone) and charges each a restart."""
import pytest

from lossysim.io import read_jsonl
from lossysim.run import failures
from lossysim.run.experiment import run_experiment
from tiny_runs import tiny_run, train_steps

pytestmark = pytest.mark.usefixtures("private_cache")

STEPS = 2
# Half the packets lost, IRN's 7 retries: a packet fails with probability 2^-8, some in every step's sends.
LOSSY = dict(loss="bernoulli:0.5", transport="retransmit", nic="irn", restart_s=10.0, restart_lost_steps=0)
SIZES = dict(max_train_samples=32, max_eval_samples=16, steps=STEPS, eval_every=STEPS, log_every=1,
             warmup_steps=0, threads=1)


def _dp(parts):
    return parts.dp.networks


def _replicas(parts):
    return [r.model.network for r in parts.dp.replicas]


def _boundaries(parts):
    return [b.network for r in parts.dp.replicas for b in r.pipeline.boundaries]


def _experts(parts):
    return parts.ep.networks()


def _contexts(parts):
    return parts.model.context.train_networks.cp


# (the case's settings: only the named class loses packets; its networks, every replica's)
CASES = {
    "ddp-buckets": (dict(dp_size=2, lossy_traffic="dp"), _dp),
    "fsdp-gathers": (dict(dp_size=2, dp_mode="fsdp", lossy_traffic="dp"), _dp),
    "replicas-tp": (dict(dp_size=2, tp_size=2, lossy_traffic="tp_forward,tp_backward"), _replicas),
    "replicas-pipeline-sends": (dict(dp_size=2, pp_size=2, lossy_traffic="pp_forward,pp_backward"), _boundaries),
    "expert-all-to-all": (dict(model="tiny-moe", dp_size=2, ep_size=2,
                               lossy_traffic="ep_dispatch,ep_combine,ep_dispatch_backward,ep_combine_backward"),
                          _experts),
    "context-exchange": (dict(cp_size=2, lossy_traffic="cp_forward,cp_backward", payload_bytes=64), _contexts),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_failure_on_any_network_is_counted_and_charged(tmp_path, case):
    """The run's failures are every training network's: the one class that loses packets fails
    collectives (its networks' counters say so, the others' hold none), and metrics.jsonl and summary.json
    count exactly that total and charge each one restart_s."""
    settings, where = CASES[case]
    config = tiny_run(tmp_path / "run", **{**SIZES, **LOSSY, **settings})
    parts, _, _ = train_steps(tiny_run(tmp_path / "again", **{**SIZES, **LOSSY, **settings}), STEPS)
    held = sum(n.totals()["failures"] for n in where(parts))
    total = sum(n.totals()["failures"] for n in failures.networks(parts))
    assert held > 0, "the case must fail collectives on the class it names"
    assert failures.count(parts, config) == total == held
    summary = run_experiment(config, config.out, progress=False)
    assert summary["status"] == "completed", summary.get("error")
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["split"] == "train"]
    assert summary["sim_time"]["failures"] == rows[-1]["failures"] == total
    assert summary["sim_time"]["restart_s"] == pytest.approx(10.0 * total, rel=1e-12)


def test_networks_are_known_by_their_own_seed(tmp_path):
    """``dist`` merges the processes' counts by seed: in ``sim``, where every network is held once, no two
    training networks share one (else merging would drop a network's failures)."""
    config = tiny_run(tmp_path / "run", **{**SIZES, **LOSSY, "model": "tiny-moe", "dp_size": 2, "ep_size": 2,
                                           "tp_size": 2, "lossy_traffic": "dp"})
    parts, _, _ = train_steps(config, 1)
    found = failures.networks(parts)
    assert len(found) >= 2 + 2 + 2   # two replicas' TP, two DP groups, expert groups
    assert len({n.spec.seed for n in found}) == len(found)


def test_dist_counts_what_sim_counts(tmp_path, one_torch_thread):
    """tp 2 x dp 2 as 4 gloo processes, every class losing half its packets: each process holds its own
    replica's TP group and its DP group (mirrored on their members), the count merges them by seed, and
    every metrics row (failures and the restarts in sim_time_s among them) is sim's, bit for bit; both
    count DP's failures and the other replica's."""
    from test_data_parallel import assert_dist_is_sim, sim_and_dist
    rows, weights = sim_and_dist(tmp_path, tp_size=2, dp_size=2, **LOSSY, steps=2, eval_every=2)
    assert_dist_is_sim(rows, weights)
    import yaml
    settings = yaml.safe_load((tmp_path / "run.yaml").read_text())   # the runs' own
    config = tiny_run(tmp_path / "again", **{**settings, "save_checkpoint": False})
    parts, _, _ = train_steps(config, 1)
    replica0 = parts.model.network.totals()["failures"]
    assert failures.count(parts, config) > replica0
    train = [r for r in rows["dist"] if r["split"] == "train"]
    assert train[0]["failures"] == failures.count(parts, config) > 0
