"""Context parallelism declared once (``lossysim.axes``): its settings and flags, its key/value traffic,
its counters, summary.json's ``context_parallel``, the columns summary.csv reads off it and its report
section."""
from ..axes import Axis, Column, Counter, EstimateFlag, Section, Setting
from ..util import one_of

CP_MODES = ("ring", "allgather")   # Megatron's p2p ring of K/V blocks; Llama 3's all-gathered K/V

AXIS = Axis(
    "cp", "CP", size="cp_size", mesh="cp",
    settings=(
        Setting("cp_size", int, 1, "context-parallel ranks: every sequence cut into 2 x cp chunks "
                                   "(world = tp x cp x pp x dp)",
                flag="--cp-size", minimum=1, identity_at_default=False,
                estimate=EstimateFlag("context-parallel ranks: every sequence cut into 2 x cp chunks (default 1)",
                                      default=1)),
        Setting("cp_mode", str, "ring", f"how context ranks get each other's keys and values: {one_of(CP_MODES)}",
                flag="--cp-mode", choices=CP_MODES, identity_at_default=False,
                estimate=EstimateFlag("ring (K/V blocks passed around, Megatron's) or allgather (Llama 3's) "
                                      "(default ring)", default="ring")),
    ),
    traffic=("cp",),
    counters=(Counter("cp_s", 0.0, "what its exchanges add beside attention", per_step="cp_s_per_step"),
              Counter("cp_s_ideal_nic", 0.0, "... the same under the ideal nic")),
    summary="context_parallel",
    columns=(Column("observed_loss_rate_cp", "observed_loss_rate_cp"), Column("cp_s_per_step", "cp_s_per_step")),
    section=Section(
        "Context parallelism", "Every setting, the runs with sequences split over context ranks (`cp`) beside "
                               "the others. ",
        "`CP per step`: what the key/value exchanges add to a step. `observed CP loss`: lost / sent packets on "
        "their lossy traffic in training. \"–\": the setting has cp 1."),
    part="context", record="lossysim.cp.record")
