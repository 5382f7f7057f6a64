"""Pipeline parallelism declared once (``lossysim.axes``): its settings and flags, its traffic, its
counters, summary.json's ``pipeline``, the columns summary.csv reads off it and its report section."""
from typing import Optional

from ..axes import Axis, Column, Counter, EstimateFlag, Family, Section, Setting
from ..util import one_of

# torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B; 1f1b is Megatron's
# forward_backward_pipelining_without_interleaving (PipeDream-Flush). Timed by lossysim.pp.schedule.
PP_SCHEDULES = ("gpipe", "1f1b")


def _microbatches(value) -> None:
    if value is not None and value < 1:
        raise ValueError(f"microbatches={value} must be >= 1 (or null for pp_size)")


AXIS = Axis(
    "pp", "PP", size="pp_size", mesh="pp",
    settings=(
        Setting("pp_size", int, 1, "pipeline stages: the blocks cut into this many (world = tp x pp x dp)",
                flag="--pp-size", minimum=1, identity_at_default=False,
                estimate=EstimateFlag("pipeline stages (default 1)")),
        Setting("pp_schedule", str, "1f1b", f"how a step's micro-batches run through the stages: {one_of(PP_SCHEDULES)}",
                flag="--pp-schedule", choices=PP_SCHEDULES, identity_at_default=False,
                estimate=EstimateFlag("pipeline schedule (default 1f1b)", default="1f1b")),
        Setting("pp_layout", Optional[str], None, "blocks per stage, e.g. 1,3 (default: an even split)",
                flag="--pp-layout", identity_at_default=False,
                estimate=EstimateFlag("blocks per stage, e.g. 9,10,10,11 (default: an even split)")),
        Setting("microbatches", Optional[int], None,
                "micro-batches per step (default: pp_size): gradients accumulate over them",
                flag="--microbatches", check=_microbatches, identity_at_default=False,
                estimate=EstimateFlag("micro-batches per replica per step (default: from --global-batch, else pp "
                                      "size)")),
    ),
    traffic=("pp",),
    counters=(Counter("pipeline_s", 0.0, "the steps' schedule times, summed"),
              Counter("pipeline_s_ideal_nic", 0.0, "... the same steps' under the ideal nic"),
              Counter("pp_s", 0.0, "... what the boundary sends added to them"),
              Counter("pp_busy_s", 0.0, "... the stages' busy seconds (compute and TP traffic)")),
    summary="pipeline",
    columns=(Column("pp_bubble", "bubble"), Column("pipeline_s_per_step", "pipeline_s_per_step"),
             Column("pp_s_per_step", "pp_s_per_step"), Column("observed_loss_rate_pp", "observed_loss_rate_pp")),
    section=Section(
        "Pipeline parallelism", "Every setting, the runs with pipeline stages (`pp`) beside the others. ",
        "For a pipeline the clock is its schedule's critical path: compute, TP traffic and boundary sends, "
        "repairs included. `bubble`: the stages' idle share of the step. `PP per step`: what the boundary "
        "sends add to a step (the schedule less the same schedule with free sends). `observed PP loss`: lost "
        "/ sent packets on the boundaries' lossy traffic in training. \"–\": the setting has no stages.",
        extra={"bubble (%)": ("pp_bubble", 100)}, fragile=False),
    part="pipeline", record="lossysim.pp.record", requires="send",
    budget=(Family("pp", "PP activations and gradients", "pp_forward,pp_backward", dict(tp_size=1, pp_size=2),
                   order=1),))
