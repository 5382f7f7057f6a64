"""Expert parallelism declared once (``lossysim.axes``): its size and flags, its all-to-alls' traffic, its
counters, summary.json's ``expert_parallel``, the columns summary.csv reads off it and its report section."""
from ..axes import Axis, Column, Counter, EstimateFlag, Family, Section, Setting, WorkloadFlag


def _fits(shape, ep_size: int) -> None:
    """A one-line ValueError when ``ep_size`` cannot shard ``shape``'s experts (an estimate's ``Shape``)."""
    if ep_size == 1:
        return
    if shape.experts is None:
        raise ValueError(f"ep_size={ep_size} needs a mixture-of-experts model, not {shape.name}")
    if shape.experts.count % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide the {shape.experts.count} experts of {shape.name}")


def _estimate_check(args) -> None:
    """The estimate's flags of experts, before its config: a skew nothing routes over is refused (the row would
    record 0.0: it did nothing)."""
    if getattr(args, "routing_skew", 0.0) > 0 and args.ep_size == 1:
        raise ValueError(f"--routing-skew {args.routing_skew:g} needs experts spread over ranks: give a "
                         "mixture-of-experts model --ep-size > 1, or leave --routing-skew at 0")


def _skew(value) -> None:
    """The routing skew the estimate assumes (``Workload``'s): a finite number >= 0."""
    if isinstance(value, bool) or not (float(value) >= 0 and float(value) < float("inf")):
        raise ValueError(f"routing_skew={value!r} must be a finite number >= 0 (0: uniform)")


AXIS = Axis(
    "ep", "EP", size="ep_size", mesh="ep",
    settings=(Setting("ep_size", int, 1, "expert parallelism: an MoE's experts over this many data-parallel ranks "
                                         "(divides dp x cp; training with cp: a multiple of cp)",
                      flag="--ep-size", minimum=1, identity_at_default=False,
                      estimate=EstimateFlag("expert parallelism: a mixture of experts' experts over this many of the "
                                            "data-parallel ranks (divides dp x cp; default 1)", default=1)),),
    traffic=("ep_dispatch", "ep_combine"),
    # in the clock first of the axes' seconds; with stages a stage's all-to-alls are in its forward and
    # backward, so the schedule's step holds them
    counters=(Counter("ep_s", 0.0, "replica 0's all-to-alls' seconds", per_step="ep_s_per_step",
                      clock=("sim_time_s",), clock_order=0, scheduled=True),
              Counter("ep_s_ideal_nic", 0.0, "... under the ideal nic", clock=("sim_time_s_ideal_nic",),
                      clock_order=0, scheduled=True)),
    summary="expert_parallel",
    columns=(Column("observed_loss_rate_ep", "observed_loss_rate_ep"), Column("ep_s_per_step", "ep_s_per_step")),
    section=Section(
        "Expert parallelism", "Every setting, the runs with experts over ranks (`ep`) beside the others. ",
        "`EP per step`: what the all-to-alls (dispatch and combine, both ways) add to a step. `observed EP "
        "loss`: lost / sent packets on their lossy traffic in training. \"–\": the setting has ep 1."),
    part="ep", record="lossysim.ep.record", estimate="lossysim.ep.estimate", requires="all_to_all",
    fits=_fits, estimate_check=_estimate_check, link_events=False,
    # the routing the estimate assumes (training routes by its gate, measured): 0 uniform, z > 0 the experts'
    # popularity by Zipf's law with exponent z (``lossysim.ep.routing``)
    workload=(WorkloadFlag("routing_skew", "--routing-skew", float, 0.0,
                           "experts' popularity by Zipf's law with this exponent (default 0: uniform routing)",
                           check=_skew),),
    # the model upcycled into 4 experts over ep 2 (``models/upcycle.py``); the trade's job, a mixture of experts
    budget=(Family("ep", "EP dispatch and combine", "ep_dispatch,ep_dispatch_backward,ep_combine,ep_combine_backward",
                   dict(tp_size=1, dp_size=2, ep_size=2), upcycled=4, order=4),))

EP_CLASSES = tuple(c.name for c in AXIS.classes)   # an MoE block's all-to-alls: dispatch, then combine
