"""Link events through the estimate: ``link_event`` on a job's fabric fails a collective at the retry
budget's time, ends a call later by the outage and the pending timer, costs a flap what its schedule
predicts, slows exactly the steps whose flows cross a cable at half speed; bad input is one line, exit 2;
without events a row is as it was."""
from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest

from lossysim.config import IDENTITY_AT_DEFAULT_OMITTED
from lossysim.config.fabric import link_events
from lossysim.estimate import events as link_events_module
from lossysim.estimate.shapes import load
from lossysim.estimate.simulate import estimate
from lossysim.estimate.workload import Workload, job_config
from lossysim.run.names import config_key, normalise
from lossysim.timing.retransmission import ib_timeout_s, rc_give_up_s

# dp 2 on nodes 0 and 1 of a 4-node fabric: the ring's flows cross node0's NIC cable, never node2's
FABRIC = "leaf-spine:nodes=4,leaves=2,spines=2"
NIC_CABLE = "node0.nic0-leaf0"
STEPS = 1000
TAU = ib_timeout_s(20)


@pytest.fixture(scope="module")
def job():
    """One estimate of a 1B model's step (about 0.23 s: 1,000 steps reach past the events), its job kept
    so every case runs its events through the same step."""
    config = job_config("llama-3.2-1b", 1, "bf16", None, tp_size=1, dp_size=2, ranks_per_node=1, fabric=FABRIC,
                        transport="retransmit", nic="irn", link_event=f"{NIC_CABLE}:down:at=1,for=1",
                        event_steps=STEPS)
    seen = {}
    original = link_events_module.columns

    def keep(config, job, row):
        seen["job"] = job
        return original(config, job, row)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(link_events_module, "columns", keep)
        row = estimate(load("llama-3.2-1b"), config, Workload(2048), steps=1)
    return config, seen["job"], row


def _columns(job, **settings) -> dict:
    config, the_job, row = job
    return link_events_module.columns(dataclasses.replace(config, **settings).validate(), the_job, row)


def _step(job):
    _, _, row = job
    return row["compute_s"], row["step_mean_s"] - row["compute_s"]


def _met(job, at: float) -> tuple[int, float]:
    """The step in progress at ``at``, and when the outage meets its call (at once, or at its start)."""
    c, m = _step(job)
    k = math.floor(at / (c + m))
    return k, max(at, k * (c + m) + c)


@pytest.mark.parametrize("timeout", [20, 18])
def test_a_cable_down_past_the_budget_fails_the_collective_at_the_budgets_time(job, timeout):
    c, m = _step(job)
    config = job[0]
    out = _columns(job, link_event=f"{NIC_CABLE}:down:at=10,for=100", ib_timeout=timeout)
    k, met = _met(job, 10.0)
    failed_at = met + rc_give_up_s(timeout)
    assert round(rc_give_up_s(timeout), 1) == {20: 34.4, 18: 8.6}[timeout]
    # restart_s, then the steps since the checkpoint restart_lost_steps back again; the cable is up by then
    resumed = max(0, k - config.restart_lost_steps)
    assert out["event_failures"] == out["event_restarts"] == 1
    assert out["event_job_s"] == pytest.approx(failed_at + config.restart_s + (STEPS - resumed) * (c + m))
    assert out["event_restart_s"] == pytest.approx(config.restart_s + failed_at - k * (c + m) + (k - resumed) * (c + m))
    assert out["event_flows"] == f"{NIC_CABLE}: dp 4 flows"     # 2 channels each way of the ring


@pytest.mark.parametrize("outage", [1.0, 20.0])
def test_a_shorter_outage_ends_the_call_later_by_the_outage_and_the_pending_timer(job, outage):
    c, m = _step(job)
    out = _columns(job, link_event=f"{NIC_CABLE}:down:at=10,for={outage}")
    _, met = _met(job, 10.0)
    held = math.ceil((10.0 + outage - met) / TAU) * TAU        # the first retry after the cable is back
    assert out["event_failures"] == 0 and out["event_calls_later"] == 1
    assert out["event_stalled_s"] == pytest.approx(held)
    assert out["event_job_s"] == pytest.approx(STEPS * (c + m) + held)


def test_a_flap_costs_what_its_schedule_predicts(job):
    """Down 2 s every 60 s from 10 s for 150 s: onsets at 10, 70 and 130 s, each met by a call (the compute
    is shorter than the 2 s down) that then waits one ACK timeout."""
    c, m = _step(job)
    out = _columns(job, link_event=f"{NIC_CABLE}:flap:at=10,period=60,down=2,for=150")
    onsets = len([t for t in (10, 70, 130) if t < 10 + 150])
    assert out["event_calls_later"] == onsets and out["event_failures"] == 0
    assert out["event_job_s"] == pytest.approx(STEPS * (c + m) + onsets * TAU)


def test_half_speed_slows_exactly_the_steps_whose_flows_cross_it(job):
    c, m = _step(job)
    slowed = _columns(job, link_event=f"{NIC_CABLE}:speed:at=0,fraction=0.5")
    # the NIC cable carries the whole of its direction's ring: at half speed every call takes twice as long
    assert slowed["event_steps_slowed"] == STEPS
    assert slowed["event_job_s"] == pytest.approx(STEPS * (c + 2 * m))
    apart = _columns(job, link_event="node2.nic0-leaf1:speed:at=0,fraction=0.5")
    assert apart["event_steps_slowed"] == 0 and apart["event_job_s"] == pytest.approx(STEPS * (c + m))
    assert apart["event_flows"] == "node2.nic0-leaf1: no flows"


def test_with_drop_an_outage_holds_nothing_and_drops_the_calls_it_meets():
    config = job_config("llama-3.2-1b", 1, "bf16", None, tp_size=1, dp_size=2, ranks_per_node=1, fabric=FABRIC,
                        link_event=f"{NIC_CABLE}:down:at=10,for=1", event_steps=STEPS)
    row = estimate(load("llama-3.2-1b"), config, Workload(2048), steps=1)
    c, m = row["compute_s"], row["step_mean_s"] - row["compute_s"]
    met = [k for k in range(STEPS) if k * (c + m) + c < 11 and (k + 1) * (c + m) > 10]
    assert row["event_calls_dropped"] == len(met) > 0 and row["event_failures"] == row["event_calls_later"] == 0
    assert row["event_job_s"] == pytest.approx(STEPS * (c + m))


def test_without_events_the_row_and_the_run_identity_are_as_before(job):
    config, _, row = job
    bare = job_config("llama-3.2-1b", 1, "bf16", None, tp_size=1, dp_size=2, ranks_per_node=1, fabric=FABRIC,
                      transport="retransmit", nic="irn")
    assert not any(k.startswith("event_") or k in ("link_event", "reroute", "ib_timeout") for k in
                   link_events_module.columns(bare, None, row))
    # at their defaults the keys stay out of a run's identity (sweeps written before them find their runs);
    # given, they are part of it, a lossless run with events included (an outage loses packets)
    assert {"link_event", "reroute", "ib_timeout", "event_steps"} <= set(IDENTITY_AT_DEFAULT_OMITTED)
    assert config_key(bare) != config_key(config)
    free = dataclasses.replace(bare, transport="drop", nic="roce-gbn")
    key = lambda c: config_key(normalise(c))   # noqa: E731
    assert key(dataclasses.replace(config, nic="roce-gbn")) != key(config)
    assert key(free) == key(dataclasses.replace(free, nic="irn"))   # lossless, no events: one run


def test_events_in_a_yaml_file_and_as_a_list(tmp_path):
    path = tmp_path / "events.yaml"
    path.write_text(f"- {NIC_CABLE}:down:at=5,for=2\n- {{cable: leaf0-spine1, kind: flap, at: 0, period: 30, down: 1}}\n")
    assert [e.kind for e in link_events(f"{path};leaf1-spine0:speed:at=0,fraction=0.5")] == ["down", "flap", "speed"]
    config = job_config("tiny", 1, "bf16", None, tp_size=1, dp_size=2, ranks_per_node=1, fabric=FABRIC,
                        link_event=[str(path), "leaf1-spine0:speed:at=0,fraction=0.5"])
    assert config.link_event == f"{path};leaf1-spine0:speed:at=0,fraction=0.5"


ESTIMATE = [sys.executable, "-m", "lossysim", "estimate", "tiny", "--seq", "64", "--tp-size", "1", "--dp-size", "2",
            "--gpus-per-node", "1", "--steps", "1", "--threads", "1", "--no-progress", "--fabric", FABRIC]


@pytest.mark.parametrize("flags, message", [
    (["--link-event", "node9.nic0-leaf0:down:at=1,for=1"], "(nearest: node1.nic0-leaf0"),
    (["--link-event", f"{NIC_CABLE}:down:at=5"], "falls outside the run"),
    (["--link-event", f"{NIC_CABLE}:flap:at=0,period=10,down=1", "--link-event", f"{NIC_CABLE}:down:at=2,for=3"],
     "overlap and contradict"),
    (["--link-event", f"{NIC_CABLE}:wobble:at=1"], "KIND one of down, flap, speed"),
    (["--reroute", "bgp"], "invalid choice"),
])
def test_bad_link_events_at_the_cli_are_one_line_exit_2(flags, message):
    result = subprocess.run([*ESTIMATE, *flags], capture_output=True, text=True)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("event, message", [("leaf7-spine0:down:at=0,for=1", "not in fabric"),
                                            (f"{NIC_CABLE}:down:at=0,for=1", "training does not run link events")])
def test_train_refuses_link_events_in_one_line(tmp_path, event, message):
    result = subprocess.run([sys.executable, "-m", "lossysim", "train", "--set", "dp_size=2", "--set", "ranks_per_node=1",
                             "--set", f"fabric={FABRIC}", "--link-event", event, "--threads", "1",
                             "--out", str(tmp_path / "run")], capture_output=True, text=True)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_the_estimate_prints_what_the_events_do():
    result = subprocess.run([*ESTIMATE, "--transport", "retransmit", "--nic", "irn", "--event-steps", "100000",
                             "--link-event", f"{NIC_CABLE}:down:at=30,for=100"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    line = next(l for l in result.stdout.splitlines() if l.startswith("link events"))
    assert f"{NIC_CABLE}: dp 4 flows" in line and "1 collectives failed" in line and "1 restarts" in line


def test_a_sweep_refuses_link_events_before_any_run_trains(tmp_path):
    spec = tmp_path / "events.yaml"
    spec.write_text(f"name: events\nmodel: tiny\nsteps: 2\ndp_size: 2\nranks_per_node: 1\nfabric: {FABRIC}\n"
                    "grid:\n  - seed: [0]\n")
    result = subprocess.run([sys.executable, "-m", "lossysim", "sweep", str(spec), "--out", str(tmp_path / "out"),
                             "--link-event", f"{NIC_CABLE}:down:at=0,for=1", "--threads", "1", "--no-progress"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "training does not run link events" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out" / "events").exists()
