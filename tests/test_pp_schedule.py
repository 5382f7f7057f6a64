"""The pipeline clock (lossysim/pp/schedule.py) against closed forms and hand-computed critical paths.

Hand-computed cases use small integer seconds: sums of small integers are exact in binary floating
point, so their times are compared exactly; closed forms over drawn floats use a relative tolerance of
1e-12 (a few roundings of sums of at most a few dozen terms)."""
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lossysim.pp import SCHEDULES, pipeline_ends, pipeline_time, stage_ops, timeline_plot

REL = 1e-12
seconds = st.floats(0.01, 10, allow_nan=False)


def _starts(timing) -> dict[tuple[int, str, int], tuple[float, float]]:
    return {(op.stage, op.kind, op.microbatch): (op.start, op.end) for op in timing.timeline}


@settings(max_examples=100, deadline=None)
@given(schedule=st.sampled_from(SCHEDULES), p=st.integers(1, 4), m=st.integers(1, 8), f=seconds, b=seconds)
def test_loss_free_equal_stages_take_m_plus_p_minus_1_slots(schedule, p, m, f, b):
    t = pipeline_time(schedule, p, m, f, b)
    assert t.step_s == pytest.approx((m + p - 1) * (f + b), rel=REL)
    assert t.busy_s == pytest.approx([m * (f + b)] * p, rel=REL)
    assert t.bubble_ratio == pytest.approx((p - 1) / m, rel=REL, abs=REL)
    assert t.bubble == pytest.approx((p - 1) / (m + p - 1), rel=REL, abs=REL)


@pytest.mark.parametrize("p", range(1, 5))
@pytest.mark.parametrize("m", range(1, 9))
def test_activations_alive_on_stage_0(p, m):
    assert pipeline_time("gpipe", p, m, 1, 1).peak_in_flight == m
    assert pipeline_time("1f1b", p, m, 1, 1).peak_in_flight == min(p, m)


def test_one_stage_runs_its_micro_batches_back_to_back():
    f, b = [[0.1, 0.2, 0.3, 0.7]], [[0.3, 0.2, 0.1, 0.11]]
    for schedule in SCHEDULES:
        t = pipeline_time(schedule, 1, 4, f, b)
        assert t.step_s == pytest.approx(sum(f[0]) + sum(b[0]), rel=REL)
        assert t.bubble == 0 and t.bubble_ratio == 0


def test_schedule_orders():
    assert stage_ops("gpipe", 2, 3) == ((("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)),) * 2
    # Megatron: stage s warms up with min(p-s-1, m) forwards, alternates, then cools down
    assert stage_ops("1f1b", 3, 4) == (
        (("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)),
        (("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)),
        (("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)),
    )
    assert stage_ops("1f1b", 3, 1) == ((("F", 0), ("B", 0)),) * 3


# p=2, m=3, forward 1 s, backward 2 s. Loss-free 1F1B runs
#   stage 0: F0 [0,1] F1 [1,2] B0 [4,6] F2 [6,7] B1 [7,9]  B2 [10,12]
#   stage 1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7] F2 [7,8] B2 [8,10]
# Micro-batch 1's activation arrives d late: F(1,1) starts at x = max(4, 2 + d) (2 s of slack: stage 1
# is busy with B0 until 4), then stage 1 runs B1 [x+1, x+3], F2 [x+3, x+4] (F(0,2) ended at 7 <= x+3),
# B2 [x+4, x+6]; stage 0's B1 waits for B(1,1): [x+3, x+5], its B2 for B(1,2): [x+6, x+8].
@pytest.mark.parametrize("d", [0, 1, 2, 3, 10])
def test_1f1b_late_activation_delays_only_its_micro_batch_and_what_follows(d):
    t = pipeline_time("1f1b", 2, 3, 1, 2, activation_s=[[0, d, 0]])
    x = max(4, 2 + d)
    assert t.timeline[0] == (0, "F", 0, 0, 1)   # (stage, kind, micro-batch, start, end)
    assert _starts(t) == {
        (0, "F", 0): (0, 1), (0, "F", 1): (1, 2), (0, "B", 0): (4, 6), (0, "F", 2): (6, 7),
        (0, "B", 1): (x + 3, x + 5), (0, "B", 2): (x + 6, x + 8),
        (1, "F", 0): (1, 2), (1, "B", 0): (2, 4), (1, "F", 1): (x, x + 1), (1, "B", 1): (x + 1, x + 3),
        (1, "F", 2): (x + 3, x + 4), (1, "B", 2): (x + 4, x + 6),
    }
    assert t.step_s == 12 + max(0, d - 2)
    assert 12 <= t.step_s <= 12 + d


# GPipe has no slack there: stage 1 runs its forwards back to back, so from F(1,1) on everything on
# stage 1 moves by d, and stage 0's backwards with it; micro-batch 0's forwards do not move.
@pytest.mark.parametrize("d", [0, 1, 3])
def test_gpipe_late_activation_moves_the_rest_of_its_stage(d):
    t = pipeline_time("gpipe", 2, 3, 1, 2, activation_s=[[0, d, 0]])
    assert _starts(t) == {
        (0, "F", 0): (0, 1), (0, "F", 1): (1, 2), (0, "F", 2): (2, 3),
        (0, "B", 0): (6 + d, 8 + d), (0, "B", 1): (8 + d, 10 + d), (0, "B", 2): (10 + d, 12 + d),
        (1, "F", 0): (1, 2), (1, "F", 1): (2 + d, 3 + d), (1, "F", 2): (3 + d, 4 + d),
        (1, "B", 0): (4 + d, 6 + d), (1, "B", 1): (6 + d, 8 + d), (1, "B", 2): (8 + d, 10 + d),
    }
    assert t.step_s == 12 + d


# A late gradient goes the other way: micro-batch 0's gradient reaches stage 0 d late, so stage 0's B0
# starts at 4 + d and its F2 after it; stage 1's work before F2 (which waits for that F2) is untouched.
@pytest.mark.parametrize("d", [0, 1, 3])
def test_1f1b_late_gradient_delays_its_receiver_not_its_sender(d):
    t = pipeline_time("1f1b", 2, 3, 1, 2, gradient_s=[[d, 0, 0]])
    assert _starts(t) == {
        (0, "F", 0): (0, 1), (0, "F", 1): (1, 2), (0, "B", 0): (4 + d, 6 + d), (0, "F", 2): (6 + d, 7 + d),
        (0, "B", 1): (7 + d, 9 + d), (0, "B", 2): (10 + d, 12 + d),
        (1, "F", 0): (1, 2), (1, "B", 0): (2, 4), (1, "F", 1): (4, 5), (1, "B", 1): (5, 7),
        (1, "F", 2): (7 + d, 8 + d), (1, "B", 2): (8 + d, 10 + d),
    }
    assert t.step_s == 12 + d


# Every message takes c. GPipe: F(s,i) starts at s(f+c) + i f (the chain and the stage agree), the last
# stage's backwards start once its forwards end at (p-1)(f+c) + m f, and B(s,j) starts (p-1-s)(b+c) + j b
# later: the step is (m+p-1)(f+b) + 2(p-1)c, one message each way per boundary on the critical path.
@settings(max_examples=100, deadline=None)
@given(p=st.integers(1, 4), m=st.integers(1, 8), f=seconds, b=seconds, c=seconds)
def test_gpipe_uniform_messages_add_one_round_trip_per_boundary(p, m, f, b, c):
    t = pipeline_time("gpipe", p, m, f, b, c, c)
    assert t.step_s == pytest.approx((m + p - 1) * (f + b) + 2 * (p - 1) * c, rel=REL)


# 1F1B's steady state waits for the round trip: at p=2, m=3 stage 0's F2 follows its B0, which waits for
# B(1,0) + c, and stage 1's F2 waits for that F2 + c; working the max of each start by hand (every
# choice goes the same way for any f, b, c >= 0) gives 4(f+b) + 4c, against GPipe's 4(f+b) + 2c.
@settings(max_examples=100, deadline=None)
@given(f=seconds, b=seconds, c=seconds)
def test_1f1b_uniform_messages_at_two_stages_three_micro_batches(f, b, c):
    assert pipeline_time("1f1b", 2, 3, f, b, c, c).step_s == pytest.approx(4 * (f + b) + 4 * c, rel=REL)
    assert pipeline_time("gpipe", 2, 3, f, b, c, c).step_s == pytest.approx(4 * (f + b) + 2 * c, rel=REL)


@settings(max_examples=50, deadline=None)
@given(p=st.integers(1, 4), f=seconds, b=seconds, c=seconds)
def test_one_micro_batch_is_the_same_chain_in_both_schedules(p, f, b, c):
    expected = p * (f + b) + 2 * (p - 1) * c
    for schedule in SCHEDULES:
        assert pipeline_time(schedule, p, 1, f, b, c, c).step_s == pytest.approx(expected, rel=REL)


def test_a_number_a_row_per_stage_and_a_full_array_are_the_same_input():
    full = pipeline_time("1f1b", 3, 2, [[1, 1], [2, 2], [3, 3]], [[4, 4], [5, 5], [6, 6]],
                         [[0.5, 0.5], [0.5, 0.5]], [[0.25, 0.25]] * 2)
    assert pipeline_time("1f1b", 3, 2, [1, 2, 3], [4, 5, 6], [0.5, 0.5], [0.25, 0.25]) == full
    assert pipeline_time("1f1b", 3, 2, [1, 2, 3], [4, 5, 6], 0.5, 0.25) == full


@pytest.mark.parametrize("kwargs, match", [
    (dict(schedule="interleaved"), r"^pp_schedule='interleaved' must be one of gpipe, 1f1b$"),
    (dict(stages=0), r"^pp_size=0 must be an integer >= 1$"),
    (dict(stages=2.0), r"^pp_size=2.0 must be"),
    (dict(microbatches=0), r"^microbatches=0 must be an integer >= 1$"),
    (dict(forward_s=[1, 2]), r"^forward_s must be a number, 3 numbers or a 3 x 2 array, got shape \(2,\)$"),
    (dict(backward_s=[[1, 2, 3]] * 3), r"^backward_s must be .* got shape \(3, 3\)$"),
    (dict(activation_s=[1, 2, 3]), r"^activation_s must be a number, 2 numbers or a 2 x 2 array"),
    (dict(gradient_s=[[0, 0], [0, 1], [0, 0]]), r"^gradient_s must be .* got shape \(3, 2\)$"),
    (dict(forward_s=-1.0), r"^forward_s must be finite seconds >= 0, got -1.0 at \[0, 0\]$"),
    (dict(gradient_s=[[0, 0], [0, -2]]), r"^gradient_s must be finite seconds >= 0, got -2.0 at \[1, 1\]$"),
    (dict(activation_s=float("nan")), r"^activation_s must be finite seconds >= 0, got nan"),
    (dict(backward_s="slow"), r"^backward_s must be numbers of seconds, got 'slow'$"),
])
def test_bad_input_is_one_line_naming_the_key(kwargs, match):
    args = dict(schedule="1f1b", stages=3, microbatches=2, forward_s=1.0, backward_s=2.0) | kwargs
    with pytest.raises(ValueError, match=match):
        pipeline_time(**args)


@st.composite
def _cases(draw):
    p, m = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    grid = lambda rows: [[draw(st.floats(0, 3)) for _ in range(m)] for _ in range(rows)]  # noqa: E731
    return draw(st.sampled_from(SCHEDULES)), p, m, grid(p), grid(p), grid(p - 1), grid(p - 1)


@settings(max_examples=200, deadline=None)
@given(case=_cases(), extra=seconds, which=st.integers(0, 10**6))
def test_timeline_keeps_every_dependency_and_one_op_per_stage_at_a_time(case, extra, which):
    schedule, p, m, f, b, act, grad = case
    t = pipeline_time(schedule, p, m, f, b, act, grad)
    ops = _starts(t)
    assert len(t.timeline) == len(ops) == 2 * p * m
    for s, order in enumerate(stage_ops(schedule, p, m)):
        stage = [op for op in t.timeline if op.stage == s]
        assert [(op.kind, op.microbatch) for op in stage] == list(order)
        free = 0.0
        for op in stage:
            assert op.end == op.start + (f if op.kind == "F" else b)[s][op.microbatch]
            if op.kind == "F":
                ready = 0.0 if s == 0 else ops[s - 1, "F", op.microbatch][1] + act[s - 1][op.microbatch]
            elif s == p - 1:
                ready = ops[s, "F", op.microbatch][1]
            else:
                ready = ops[s + 1, "B", op.microbatch][1] + grad[s][op.microbatch]
            # never before its stage is free or its input is there, and never idle once both hold
            assert op.start == max(free, ready)
            free = op.end
    assert t.step_s == max(op.end for op in t.timeline)
    assert t.busy_s == pytest.approx([sum(f[s]) + sum(b[s]) for s in range(p)], rel=REL)
    # the step is 1-Lipschitz in every message: a message made later never shortens it, nor delays it by
    # more than the extra time
    if p > 1:
        later = [row[:] for row in act]
        later[which % (p - 1)][which % m] += extra
        slower = pipeline_time(schedule, p, m, f, b, later, grad).step_s
        assert t.step_s <= slower <= t.step_s + extra + 1e-9   # 1e-9: roundings of sums below 100 s


def test_gantt_chart(tmp_path):
    t = pipeline_time("1f1b", 3, 4, 1, 2, 0.25, 0.25)
    path = timeline_plot(t, tmp_path / "plot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.figure import Figure
    ax = Figure().add_subplot()
    assert timeline_plot(t, ax) is ax
    assert len(ax.patches) == 2 * 3 * 4
    assert sorted(text.get_text() for text in ax.texts) == sorted(
        f"{op.kind}{op.microbatch}" for op in t.timeline)


def test_the_figures_docs_pipeline_md_quotes():
    """docs/pipeline.md quotes these steps (p=4, m=8, f=1, b=2, messages 0.25 s, one repaired
    activation 2 s longer); a change to the clock must update them."""
    doc = " ".join((Path(__file__).resolve().parents[1] / "docs" / "pipeline.md").read_text().split())
    late = [[0.25] * 8, [0.25] * 3 + [2.25] + [0.25] * 4, [0.25] * 8]
    free = pipeline_time("1f1b", 4, 8, 1, 2).step_s
    gpipe, one_f_one_b = (pipeline_time(s, 4, 8, 1, 2, 0.25, 0.25).step_s for s in ("gpipe", "1f1b"))
    repaired = pipeline_time("1f1b", 4, 8, 1, 2, late, 0.25).step_s
    assert (free, gpipe, one_f_one_b, repaired) == (33, 34.5, 37, 39)   # quarter seconds: exact
    assert f"GPipe takes {gpipe:g} s and 1F1B takes {one_f_one_b:g} s, against {free:g} s" in doc
    assert f"the step grows from {one_f_one_b:g} s to {repaired:g} s" in doc


def _event_loop(schedule, p, m, f, b, act, grad):
    """The clock as a list scheduler sweeping the stages until every op has run, each op started once its
    input's end is known: the reference the one-pass clock must equal to the last bit."""
    orders, end, free, busy, nxt, ops = stage_ops(schedule, p, m), {}, [0.0] * p, [0.0] * p, [0] * p, []
    while len(end) < 2 * p * m:
        for s in range(p):
            while nxt[s] < len(orders[s]):
                kind, i = orders[s][nxt[s]]
                if kind == "F":
                    ready = 0.0 if s == 0 else end.get((s - 1, "F", i))
                    ready = ready if s == 0 or ready is None else ready + act[s - 1][i]
                else:
                    ready = end.get((s, "F", i)) if s == p - 1 else end.get((s + 1, "B", i))
                    ready = ready if s == p - 1 or ready is None else ready + grad[s][i]
                if ready is None:
                    break
                start = max(free[s], ready)
                seconds = (f if kind == "F" else b)[s][i]
                free[s], busy[s] = start + seconds, busy[s] + seconds
                end[s, kind, i] = free[s]
                ops.append((s, kind, i, start, free[s]))
                nxt[s] += 1
    return max(free), busy, sorted(ops)


@settings(max_examples=60, deadline=None)
@given(schedule=st.sampled_from(SCHEDULES), p=st.integers(1, 6), m=st.integers(1, 9), seed=st.integers(0, 2**32 - 1))
def test_one_pass_in_dependency_order_is_the_event_loop_to_the_bit(schedule, p, m, seed):
    import numpy as np
    rng = np.random.default_rng(seed)
    f, b = rng.exponential(1.0, (p, m)), rng.exponential(2.0, (p, m))
    act, grad = rng.exponential(0.3, (max(p - 1, 1), m))[:p - 1], rng.exponential(0.3, (max(p - 1, 1), m))[:p - 1]
    t = pipeline_time(schedule, p, m, f, b, act if p > 1 else 0.0, grad if p > 1 else 0.0)
    step, busy, ops = _event_loop(schedule, p, m, f.tolist(), b.tolist(), act.tolist(), grad.tolist())
    assert t.step_s == step and list(t.busy_s) == busy
    assert sorted((op.stage, op.kind, op.microbatch, op.start, op.end) for op in t.timeline) == ops


@settings(max_examples=60, deadline=None)
@given(schedule=st.sampled_from(SCHEDULES), p=st.integers(1, 6), m=st.integers(1, 9), r=st.integers(1, 5),
       seed=st.integers(0, 2**32 - 1))
def test_every_replicas_ends_at_once_are_each_replicas_schedule_to_the_bit(schedule, p, m, r, seed):
    """``pipeline_ends`` (the step clock's: every replica at once) against ``pipeline_time`` replica by
    replica: the step's end and each stage's last backward, the same floats; ties (zero seconds) too."""
    import numpy as np
    rng = np.random.default_rng(seed)

    def seconds(rows, scale):   # some ops free, so maxima tie
        return rng.exponential(scale, (r, rows, m)) * (rng.random((r, rows, m)) < 0.8)
    f, b, act, grad = seconds(p, 1.0), seconds(p, 2.0), seconds(p - 1, 0.3), seconds(p - 1, 0.3)
    ends = pipeline_ends(schedule, p, m, f, b, act, grad)
    for k in range(r):
        t = pipeline_time(schedule, p, m, f[k], b[k], act[k] if p > 1 else 0.0, grad[k] if p > 1 else 0.0)
        assert ends.step_s[k] == t.step_s
        for s in range(p):
            last = [op for op in t.timeline if op.stage == s and op.kind == "B"][-1]
            assert (ends.last_backward[k, s, 0], ends.last_backward[k, s, 1]) == (last.start, last.end)
    free = pipeline_ends(schedule, p, m, f, b)
    assert all(free.step_s[k] == pipeline_time(schedule, p, m, f[k], b[k]).step_s for k in range(r))
