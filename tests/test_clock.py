"""The one step clock (lossysim/clock.py) against hand-computed steps: each axis's record summed on a
replica's stream, the buckets after the slowest replica, a pipeline's schedule and its sends. (That
training and the estimate end their steps alike on it: tests/test_estimate_job.py.)"""
import pytest

from lossysim.clock import Buckets, Compute, OnStream, Path, Schedule, Sends, step_time, stream
from lossysim.pp import pipeline_time


def test_one_replica_is_its_compute_plus_every_axis_on_its_stream():
    # 3 micro-batches of 3 s: 1 s forward, 2 s backward each; tp and ep serial on the stream, cp empty
    path = stream(Compute([3.0] * 3), OnStream("tp", [[(0.5, 1.0)] * 3]), OnStream("ep", [[(0.25, 0.25)] * 3]),
                  OnStream("cp"))
    assert path.forward == [[3 * (1.0 + 0.5 + 0.25)]] and path.backward == [[3 * (2.0 + 1.0 + 0.25)]]
    step = step_time([path])
    assert step.seconds == 9.0 + 3 * 2.0
    assert step.breakdown == {"compute_s": 9.0, "comm_s": 6.0, "dp_s": 0.0, "dp_after_s": 0.0}


def test_buckets_wait_for_the_slowest_replica_and_add_what_replica_0_does_not_run():
    fast = stream(Compute([3.0]), OnStream("tp", [[(0.5, 0.5)]]))       # 1.5 s forward, 2.5 s backward
    slow = stream(Compute([3.0]), OnStream("tp", [[(1.0, 0.5)]]))       # 2.0 s forward
    buckets = Buckets([[0.5, 1.0]], [[1.0, 0.5]], overlap=False, after=0.25)
    step = step_time([fast, slow], buckets)
    # without overlap every bucket follows the slowest backward: 2.0 + 2.5 + 1.5, less replica 0's 4.0
    assert step.breakdown["dp_s"] == 2.0
    assert step.seconds == 3.0 + 1.0 + 2.0 + 0.25
    overlapped = step_time([fast, slow], Buckets([[0.5, 1.0]], [[1.0, 0.5]], overlap=True))
    assert 0.0 < overlapped.breakdown["dp_s"] < step.breakdown["dp_s"]
    # a group of one (no bucket seconds) adds nothing
    assert step_time([fast], Buckets([[0.5, 1.0]])).breakdown["dp_s"] == 0.0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_pipelined_step_is_the_schedule_then_each_stages_buckets_after_its_last_backward(schedule):
    # two stages sharing each 6 s micro-batch: 1 s forward, 2 s backward a stage; sends of 0.5 s
    sends = Sends([[0.5, 0.5]], [[0.5, 0.5]])
    path = stream(Compute([6.0, 6.0], (0.5, 0.5)), OnStream("tp"), sends=sends)
    assert path.forward == [[1.0, 1.0]] * 2 and path.backward == [[2.0, 2.0]] * 2
    plan = Schedule(schedule, 2, 2)
    timing = pipeline_time(schedule, 2, 2, 1.0, 2.0, 0.5, 0.5)
    step = step_time([path], schedule=plan, pp_added=True)
    assert step.seconds == step.breakdown["pipeline_s"] == timing.step_s
    assert step.breakdown["pp_s"] == timing.step_s - pipeline_time(schedule, 2, 2, 1.0, 2.0).step_s > 0
    # stage 0's 10 s bucket, not overlapped, starts when its last backward ends: later than the schedule
    last = [op for op in timing.timeline if op.stage == 0 and op.kind == "B"][-1]
    bucketed = step_time([path], Buckets([[1.0], []], [[10.0], []], overlap=False), plan)
    assert bucketed.seconds == last.end + 10.0
    assert bucketed.breakdown["dp_s"] == last.end + 10.0 - timing.step_s


def test_a_replica_may_hand_its_passes_as_sums():
    """Training's replica without stages gives its forward and backward summed over micro-batches."""
    path = Path([[4.0]], [[6.0]], compute_s=7.0, comm_s=3.0)
    other = Path([[5.0]], [[6.0]])
    step = step_time([path, other], Buckets([[1.0]], [[2.0]], overlap=False))
    assert step.breakdown["dp_s"] == 5.0 + 6.0 + 2.0 - 10.0 and step.seconds == 10.0 + 3.0


def test_fsdp_gathers_with_stages_delay_each_stages_first_forward_and_join_dp_s():
    """GPipe over 2 stages, 2 micro-batches of 1 s forward and 2 s backward a stage, free sends: stage 1's
    one unit gathered in 3 s before its forward (not overlapped) makes its first forward 4 s. Without the
    gathers: stage 1's forwards end at 3, its backwards at 7, stage 0's at 9; with them, 6, 10 and 12."""
    path = stream(Compute([6.0, 6.0], (0.5, 0.5)), sends=Sends([[0.0, 0.0]], [[0.0, 0.0]]))
    plan = Schedule("gpipe", 2, 2)
    buckets = Buckets([[1.0], [1.0]], [[0.0], [0.0]], gather=[[], [3.0]], overlap=False)
    step = step_time([path], buckets, plan, pp_added=True)
    assert step.breakdown["pipeline_s"] == 9.0 and step.seconds == 12.0
    assert step.breakdown["dp_s"] == 3.0 and step.breakdown["pp_s"] == 0.0
    assert step.seconds == pipeline_time("gpipe", 2, 2, [[1.0, 1.0], [4.0, 1.0]], [[2.0, 2.0]] * 2).step_s
    # one unit: its prefetch (one unit ahead) hides nothing, so overlap gives the same step
    assert step_time([path], Buckets([[1.0], [1.0]], [[0.0], [0.0]], gather=[[], [3.0]]), plan).seconds == 12.0
    # without seconds for the gathers the schedule is the step
    assert step_time([path], Buckets([[1.0], [1.0]], [[0.0], [0.0]]), plan).seconds == 9.0
