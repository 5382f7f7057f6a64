"""Bad input, generated (hypothesis): loss specs, --set overrides and sweep specs either work or
end in a one-line error naming the field, never a traceback, and nothing they leave behind
claims success."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lossysim import cli
from lossysim.run import sweep
from lossysim.run import experiment as train_module
from lossysim.config import ExperimentConfig, from_dict
from lossysim.loss import parse_loss_model
from test_sweep import Recorder

FIELDS = [f.name for f in dataclasses.fields(ExperimentConfig)]
CHECKS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Pieces a loss spec is made of, so generated specs come close to valid ones as often as not.
LOSS_WORDS = ["none", "off", "bernoulli", "random", "ge", "gilbert", "rate", "burst", "p_gb", "p_bg",
              "loss_bad", "loss_good", "p", ":", "=", ",", "%", " ", "0", "1", "0.01", "-1", "2", "1e-3",
              "nan", "inf", "1e400", "0x1", "8", ".", "e"]
loss_specs = st.one_of(st.lists(st.sampled_from(LOSS_WORDS), max_size=10).map("".join), st.text(max_size=20))
# Values as YAML and the command line spell them: numbers, words, lists, mappings, junk.
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**20),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(["none", "null", "1e-3", "[1, 2]", "{a: 1}", "[", "0x10", "tiny", "sdpa",
                                     "bernoulli:0.01", "ge:rate=0.01,burst=8", "tensorboard", "fwd", "-1"]))
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=4), scalars, max_size=2))
keys = st.one_of(st.sampled_from(FIELDS), st.text(max_size=8))


def one_line(text: str) -> str:
    text = text.strip()
    assert text and len(text.splitlines()) == 1, text
    assert "Traceback" not in text
    return text


@CHECKS
@given(loss_specs)
def test_loss_specs_parse_or_name_the_problem(spec):
    try:
        model = parse_loss_model(spec)
    except ValueError as err:
        assert "loss spec" in str(err)
    else:
        assert 0.0 <= model.loss_rate <= 1.0 and math.isfinite(model.loss_rate)
        assert model.lossless or model.mean_burst >= 1.0
    try:
        config = from_dict({"loss": spec})
    except ValueError as err:
        assert str(err).startswith("loss:")
    else:
        assert parse_loss_model(config.loss).loss_rate == model.loss_rate


def fake_experiment(calls):
    def run_experiment(config, run_dir, **kwargs):
        calls.append(config.validate())   # what reaches training is a valid config
        return {"status": "completed"}
    return run_experiment


@CHECKS
@given(st.lists(st.tuples(keys, st.one_of(st.text(max_size=12), scalars.map(str))), min_size=1, max_size=3))
def test_set_overrides_work_or_fail_in_one_line_naming_the_field(pairs):
    # --set=K=V: a value starting with "-" is otherwise an option to argparse (its usage error)
    argv = ["train", "--no-progress", *(f"--set={key}={value}" for key, value in pairs)]
    calls = []
    with mock.patch.object(train_module, "run_experiment", fake_experiment(calls)), \
            mock.patch("sys.stderr", new_callable=lambda: __import__("io").StringIO()) as err:
        code = cli.main(argv)
    if code == 0:
        assert len(calls) == 1
        return
    message = one_line(err.getvalue())
    assert calls == [] and code == 2, message
    # the key is what precedes the first "=" (a generated key may hold one itself)
    read = [f"{key}={value}".partition("=")[0].strip() for key, value in pairs]
    named = [k for key in read for k in (key, repr(key)[1:-1])]
    assert any(name and name in message for name in named) or "--set" in message, message


spec_bases = st.one_of(st.none(), st.dictionaries(keys, values, max_size=3), st.text(max_size=8),
                       st.integers(), st.lists(scalars, max_size=2))
grid_axes = st.dictionaries(keys, st.one_of(scalars, st.lists(scalars, max_size=3)), max_size=2)
grids = st.one_of(st.none(), grid_axes, st.lists(grid_axes, max_size=2), scalars)
GOOD = {"model": "tiny", "dataset": "synthetic", "steps": 4, "eval_every": 2}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=spec_bases, top=st.dictionaries(keys, values, max_size=3), grid=grids, good=st.booleans())
def test_sweep_specs_run_or_fail_in_one_line_and_claim_nothing(base, top, grid, good):
    spec = {**(GOOD if good else {}), **top}
    if base is not None:
        spec["base"] = base
    if grid is not None:
        spec["grid"] = grid
    with tempfile.TemporaryDirectory() as tmp:
        path, out = Path(tmp) / "spec.yaml", Path(tmp) / "out"
        path.write_text(yaml.safe_dump(spec, sort_keys=False, allow_unicode=True))
        rec = Recorder()
        with mock.patch.object(sweep, "_default_train", lambda: rec), \
                mock.patch("sys.stderr", new_callable=lambda: __import__("io").StringIO()) as err, \
                mock.patch("sys.stdout", new_callable=lambda: __import__("io").StringIO()):
            code = cli.main(["sweep", str(path), "--out", str(out), "--no-progress"])
        summaries = [json.loads(p.read_text()) for p in out.glob("*/summary.json")]
        if code == 0:
            assert len(summaries) == len(rec.calls) and all(s["status"] == "completed" for s in summaries)
            return
        message = one_line(err.getvalue())
        assert code == 2, message
        assert rec.calls == [] and not summaries and not (out / "summary.csv").exists(), message
        named = [n for k in  (*spec, *(base or {} if isinstance(base, dict) else {}),
                                  *(k for g in (grid if isinstance(grid, list) else [grid]) if isinstance(g, dict)
                                    for k in g)) for n in (str(k).strip(), repr(str(k).strip())[1:-1])]
        assert any(name.strip() and name.strip() in message for name in named) or "grid" in message \
            or str(path) in message, message


def test_known_crashers_are_one_line_errors(tmp_path, capsys):
    """Inputs that used to end in a traceback."""
    spec = tmp_path / "s.yaml"
    spec.write_text("base: {model: tiny, steps: 4, eval_every: 2}\ngrid: {seed: [0]}\n")
    with mock.patch.object(sweep, "_default_train", lambda: Recorder()):
        assert cli.main(["sweep", str(spec), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    with pytest.raises(ValueError, match=r"^lr='\[' is not a valid float"):
        from_dict({"lr": "["})
    with pytest.raises(ValueError, match=r"^steps=inf is not a valid int"):
        from_dict({"steps": float("inf")})


@pytest.mark.parametrize("settings, message", [
    (dict(loss="bernoulli:0.1", lossy_traffic="dp"), "no traffic can lose packets"),         # dp 1: no dp traffic
    (dict(loss="bernoulli:0.1", lossy_links="inter_node"), "no traffic can lose packets"),   # tp 2 on one node
    (dict(loss="bernoulli:0.1", lossy="fwd", lossy_traffic="tp_backward"), "no traffic can lose packets"),
    (dict(loss="bernoulli:0.1", tp_size=1), "no traffic can lose packets"),                   # one rank, no links
    (dict(loss="ge:rate=0.1,burst=4", tp_size=2, dp_size=2, ranks_per_node=4, lossy_links="inter_node"),
     "no traffic can lose packets"),                                                          # 4 ranks, 1 node
    (dict(dp_sync_every=4), "dp_sync_every=4 needs dp_size > 1"),
    (dict(tp_size=0), "tp_size=0 must be >= 1"),          # named as set, not as the network spec's ranks
])
def test_settings_that_would_do_nothing_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        from_dict(settings)


def test_loss_models_some_traffic_meets_are_accepted():
    for settings in (dict(loss="none", lossy_traffic="dp"),     # a loss-free baseline in any layout
                     dict(loss="none", lossy_links="inter_node"),
                     dict(loss="bernoulli:0.1", tp_size=4, ranks_per_node=2, lossy_links="inter_node"),
                     dict(loss="bernoulli:0.1", tp_size=2, dp_size=2, ranks_per_node=2, lossy_links="inter_node",
                          lossy_traffic="dp"),
                     dict(loss="bernoulli:0.1", tp_size=1, dp_size=2)):
        from_dict(settings)


def test_a_lossy_link_exists_exactly_when_some_pair_of_ranks_has_one():
    from lossysim.net.topology import LOSSY_LINKS, Topology
    for tp in range(1, 9):
        for per_node in (p for p in range(1, tp + 1) if tp % p == 0):
            for links in LOSSY_LINKS:
                topology = Topology(tp, per_node, links)
                pairs = [(s, d) for s in range(tp) for d in range(tp) if s != d]
                assert topology.has_lossy_link == any(topology.lossy(s, d) for s, d in pairs), (tp, per_node, links)


def _cli(argv, capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as stop:   # argparse's own refusals
        code = stop.code
    return code, one_line(capsys.readouterr().err)


def test_estimate_longer_than_the_models_positions_is_refused_before_any_work(tmp_path, capsys):
    code, err = _cli(["estimate", "tiny", "--tp-size", "2", "--seq", "1025", "--steps", "1", "--no-progress",
                      "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "seq=1025 exceeds model 'tiny''s 1024 positions" in err and "--seq <= 1024" in err
    assert not (tmp_path / "o").exists()
    from lossysim.estimate.shapes import load
    gpt2 = load("gpt2")
    gpt2.check_seq(1024)                                   # the limit itself is allowed
    with pytest.raises(ValueError, match="seq=1025 exceeds model 'gpt2''s 1024 positions"):
        gpt2.check_seq(1025)


def test_command_line_mistakes_are_one_line(tmp_path, capsys):
    trace = tmp_path / "trace.txt"
    trace.write_text("0110100\n")
    for iterations in ("0", "-3"):
        code, err = _cli(["fit", str(trace), "--iterations", iterations], capsys)
        assert code == 2 and f"--iterations {iterations}" in err and "at least 1" in err
    code, err = _cli(["estimate", "tiny", "--dtype", "int8"], capsys)
    assert code == 2 and "'int8'" in err and "bf16" in err and "lossysim estimate --help" in err


def test_a_mistyped_train_flag_is_refused_before_the_training_path_loads():
    probe = ("import sys\nfrom lossysim import cli\ntry:\n    cli.main(['train', '--stpes', '3'])\n"
             "except SystemExit as done:\n    print(done.code, sorted(m for m in sys.modules if m.startswith("
             "('transformers', 'lossysim.run.experiment', 'lossysim.run.build'))))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.stdout.split() == ["2", "[]"], done.stdout + done.stderr[-2000:]
    assert done.stderr.splitlines() == ["lossysim train: error: unrecognized arguments: --stpes 3 (did you mean "
                                        "--steps?) (see lossysim train --help)"]


@pytest.mark.parametrize("argv, said", [
    (["budget", "--out", "x", "--familes", "tp"], "--familes tp (did you mean --families?)"),
    (["train", "--tp_size", "2"], "--tp_size 2 (did you mean --tp-size?)"),
    (["estimate", "tiny", "--bogus"], "--bogus"),
    (["estimate", "--model", "tiny"], "--model (model takes no flag: lossysim estimate MODEL ...)")])
def test_a_mistyped_flag_is_named_by_its_command_with_the_nearest_flag(argv, said, capsys):
    code, err = _cli(argv, capsys)
    assert (code, err) == (2, f"lossysim {argv[0]}: error: unrecognized arguments: {said} "
                              f"(see lossysim {argv[0]} --help)")


@pytest.mark.parametrize("settings, message", [
    (dict(nic="tcp", sockets=0), "sockets=0 must be a whole number from 1 to 64"),
    (dict(nic="tcp", sockets=65), "sockets=65 must be a whole number from 1 to 64"),   # NCCL's MAX_SOCKETS
    (dict(nic="tcp", sockets="many"), "sockets"),
    (dict(nic="tcp", congestion="vegas"), "congestion='vegas' must be one of cubic, reno, bbr"),
    (dict(nic="irn", congestion="cubic"), "congestion=cubic: only a TCP nic has a congestion window"),
])
def test_socket_counts_and_window_settings_out_of_range_are_one_line(settings, message, tmp_path, capsys):
    with pytest.raises(ValueError, match=message):
        from_dict(settings)
    argv = [f"--{key.replace('_', '-')}={value}" for key, value in settings.items()]
    code, err = _cli(["estimate", "tiny", "--tp-size", "2", "--steps", "1", "--no-progress", *argv,
                      "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and message.split(" must")[0].split(":")[0] in err
    assert not (tmp_path / "o").exists()


# -- settings that do nothing, suggestions that are refused, packet sizes ----------------------------------------
def _estimate_args(*argv):
    import argparse
    from lossysim.estimate import grid as estimate_grid
    parser = argparse.ArgumentParser()
    estimate_grid.add_arguments(parser)
    return estimate_grid.config_of(parser.parse_args(["tiny-moe", *argv]))


def _suggested(message: str, after: str) -> list[str]:
    """The choices a refusal lists after ``after`` ("use one of a, b", "use a or b=c or d")."""
    tail = message.split(after, 1)[1].split(" (")[0]
    return [item.strip() for part in tail.replace("one of ", "").split(" or ") for item in part.split(",")]


def test_sockets_with_an_rdma_nic_are_refused_and_its_suggestions_work(tmp_path, capsys):
    # an RDMA queue pair is one connection: --sockets 1,16 gave two identical rows
    code, err = _cli(["estimate", "tiny", "--tp-size", "2", "--seq", "128", "--steps", "1", "--no-progress",
                      "--nic", "irn", "--sockets", "1,16", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "sockets=16: only a TCP nic has sockets (nic=irn)" in err
    assert not (tmp_path / "o").exists()
    suggested = _suggested(err, "; use ")
    assert suggested == ["sockets=1", "nic=tcp", "tcp-bbr"], err
    from_dict(dict(nic="irn", sockets=1))
    for nic in ("tcp", "tcp-bbr"):
        assert from_dict(dict(nic=nic, sockets=16)).network_spec().connections == 2 * 16
    with pytest.raises(ValueError, match=r"^congestion=cubic: only a TCP nic .*; use nic=tcp or tcp-bbr$"):
        from_dict(dict(nic="irn", congestion="cubic"))


@pytest.mark.parametrize("model, argv", [("tiny", []), ("tiny-moe", []), ("tiny-moe", ["--dp-size", "2"])])
def test_a_routing_skew_nothing_routes_over_is_refused(model, argv, tmp_path, capsys):
    # a dense model (ep 1 only) or experts all on one rank: the row recorded routing_skew 0.0
    code, err = _cli(["estimate", model, "--tp-size", "2", "--seq", "128", "--steps", "1", "--no-progress",
                      "--routing-skew", "1.2", *argv, "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "--routing-skew 1.2" in err and "--ep-size > 1" in err, err
    assert not (tmp_path / "o").exists()
    assert _estimate_args("--dp-size", "2", "--ep-size", "2", "--routing-skew", "1.2").ep_size == 2   # what works


def test_a_bad_set_value_is_refused_where_a_flag_replaces_it(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("steps: abc\n")
    for argv, named in ((["--set", "steps=abc", "--steps", "3"], "steps='abc'"),
                        (["--config", str(config), "--steps", "3"], "steps='abc'"),
                        (["--set", "payload_bytes=big", "--set", "payload_bytes=1450"], "payload_bytes='big'")):
        calls = []
        with mock.patch.object(train_module, "run_experiment", fake_experiment(calls)):
            code, err = _cli(["train", "--no-progress", *argv], capsys)
        assert code == 2 and calls == [] and named in err and "not a valid int" in err, (argv, err)
    calls = []
    with mock.patch.object(train_module, "run_experiment", fake_experiment(calls)):
        assert cli.main(["train", "--no-progress", "--set", "steps=5", "--steps", "3"]) == 0
    assert [c.steps for c in calls] == [3]     # a good one is still replaced by the flag


@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_bad_microbatch_count_in_the_estimate_names_its_flag(value, capsys):
    code, err = _cli(["estimate", "tiny", "--tp-size", "2", "--seq", "128", "--steps", "1", "--no-progress",
                      "--microbatches", value], capsys)
    assert code == 2 and f"--microbatches {value} must be >= 1" in err and "batch_size" not in err, err


CONTEXTS = [dict(dp_size=2, dp_mode="fsdp"), dict(dp_size=2, dp_mode="fsdp", transport="deadline"),
            dict(pp_size=2), dict(model="tiny-moe", dp_size=2, ep_size=2), dict(cp_size=2)]


@pytest.mark.parametrize("context", CONTEXTS)
def test_every_recovery_a_refusal_suggests_is_accepted_there(context):
    from lossysim.net.recovery import RECOVERY_POLICIES
    refused = 0
    for name in RECOVERY_POLICIES:
        try:
            from_dict({**context, "recovery": name})
        except ValueError as err:
            if "does not act on" not in str(err):
                continue
            refused += 1
            suggested = _suggested(str(err), ": use ")
            assert suggested and name not in suggested, err
            for other in suggested:
                from_dict({**context, "recovery": other})   # raises if the suggestion is refused
    assert refused


def test_fsdps_refusal_of_error_feedback_suggests_only_what_fsdp_takes():
    with pytest.raises(ValueError, match=r"^dp_mode=fsdp: recovery=error_feedback does not act on reduce-scatters: "
                                         r"use one of zero, rescale$"):
        from_dict(dict(dp_size=2, dp_mode="fsdp", recovery="error_feedback"))


@pytest.mark.parametrize("setting", [dict(dp_mode="fsdp"), dict(pp_size=2, tp_size=1)])
def test_experts_train_beside_fsdp_and_pipeline_stages(setting):
    import torch
    from lossysim.ep.apply import check
    check(from_dict(dict(model="tiny-moe", dp_size=2, ep_size=2, **setting)), torch.device("cpu"))


@pytest.mark.parametrize("setting, timed", [(dict(activation_checkpointing=True), True),
                                            (dict(dp_sync_every=3), False)])
def test_trainings_refusals_beside_experts_suggest_settings_it_trains(setting, timed):
    import torch
    from lossysim.ep.apply import check
    config = from_dict(dict(model="tiny-moe", dp_size=2, ep_size=2, **setting))
    with pytest.raises(ValueError) as refused:
        check(config, torch.device("cpu"))
    message = one_line(str(refused.value))
    assert "pipelines" not in message and message.endswith("(lossysim estimate times the pair)") == timed, message
    suggested = _suggested(message, "; set ")
    assert len(suggested) == 2 and "ep_size=1" in suggested, message
    for choice in suggested:
        key, _, value = choice.partition("=")
        check(config.replace(**{key: value}), torch.device("cpu"))   # raises if training refuses it too


def test_a_payload_larger_than_any_links_frame_is_refused(tmp_path, capsys):
    from lossysim.net import LossyNetwork
    for payload in (1450, 4096, 9000):     # the default, RoCE's 4096 IB MTU, an Ethernet jumbo frame
        assert from_dict(dict(payload_bytes=payload)).network_spec().payload_bytes == payload
    for payload in (9001, 100_000_000):
        with pytest.raises(ValueError, match=rf"^payload_bytes={payload} is larger than any link's frame: at most 9000"):
            from_dict(dict(payload_bytes=payload))
        with pytest.raises(ValueError, match=rf"^payload_bytes={payload} "):
            LossyNetwork(2, payload_bytes=payload)
    code, err = _cli(["estimate", "tiny", "--tp-size", "2", "--seq", "128", "--steps", "1", "--no-progress",
                      "--payload-bytes", "100000000", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "payload_bytes=100000000" in err and "9000" in err and not (tmp_path / "o").exists()
