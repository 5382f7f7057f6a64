"""Context parallelism declared once (``lossysim.axes``): its settings and flags, its key/value traffic,
its counters, summary.json's ``context_parallel``, the columns summary.csv reads off it, its report
section, the collective its policy must act on and its checks against other settings."""
from ..axes import Axis, Column, Counter, EstimateFlag, Family, Section, Setting
from ..util import one_of

CP_MODES = ("ring", "allgather")   # Megatron's p2p ring of K/V blocks; Llama 3's all-gathered K/V


def _pairs(config) -> None:
    """Context parallelism's settings against the others (``config/pairs.py`` runs it for every command)."""
    if config.cp_mode not in CP_MODES:
        raise ValueError(f"cp_mode={config.cp_mode!r} must be {one_of(CP_MODES)}")
    cp = config.cp_size
    if config.recovery == "mask" and cp == 1:
        raise ValueError("recovery=mask leaves lost keys out of attention: it needs cp_size > 1 (on other "
                         "traffic it is zero); use recovery=zero")
    if cp == 1:
        return
    _split(config.max_length, cp, "max_length")
    if config.dp_mode == "fsdp":   # its shards would span dp x cp (torchtitan's dp_shard_cp), one replica's too
        raise ValueError(f"cp_size={cp} with dp_mode=fsdp: FSDP's gathers beside context parallelism are not "
                         "modelled; use dp_mode=ddp")
    if config.activation_checkpointing:
        raise ValueError(f"cp_size={cp} with activation_checkpointing: a recomputed block's key/value "
                         "exchange is not modelled; set activation_checkpointing=false")


def _estimate_check(args) -> None:
    """The estimate's flags of context parallelism, before its config: ``--seq`` named by its flag (the config's
    sequence length is ``max_length``)."""
    if args.cp_size > 1:
        _split(args.seq, args.cp_size, "--seq")


def _split(seq: int, cp: int, name: str) -> None:
    """``cp.layout.check_length``'s refusal (that module is torch's; the declarations import none)."""
    if seq % (2 * cp):
        raise ValueError(f"{name}={seq} is not a multiple of 2 x cp_size = {2 * cp}: context parallelism cuts "
                         "every sequence into 2 x cp_size equal chunks")


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
    counters=(Counter("cp_s", 0.0, "what its exchanges add beside attention", per_step="cp_s_per_step",
                      clock=("sim_time_s",), clock_order=2),
              Counter("cp_s_ideal_nic", 0.0, "... the same under the ideal nic", clock=("sim_time_s_ideal_nic",),
                      clock_order=2)),
    summary="context_parallel",
    columns=(Column("observed_loss_rate_cp", "observed_loss_rate_cp"), Column("cp_s_per_step", "cp_s_per_step")),
    section=Section(
        "Context parallelism", "Every setting, the runs with sequences split over context ranks (`cp`) beside "
                               "the others. ",
        "`CP per step`: what the key/value exchanges add to a step. `observed CP loss`: lost / sent packets on "
        "their lossy traffic in training. \"–\": the setting has cp 1."),
    part="context", record="lossysim.cp.record", estimate="lossysim.cp.estimate", requires="kv_exchange",
    pairs=_pairs, estimate_check=_estimate_check, link_events=False,
    budget=(Family("cp_ring", "CP keys/values (ring)", "cp_forward,cp_backward",
                   dict(tp_size=1, cp_size=2, cp_mode="ring"), order=2),
            Family("cp_allgather", "CP keys/values (all-gather)", "cp_forward,cp_backward",
                   dict(tp_size=1, cp_size=2, cp_mode="allgather"), order=3)))
