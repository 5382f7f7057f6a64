"""Data parallelism (DDP or FSDP) declared once (``lossysim.axes``): its settings and flags, its traffic,
its counters, summary.json's ``data_parallel`` and the columns summary.csv reads off it."""
import math

from ..axes import Axis, Column, Counter, EstimateFlag, Family, Setting
from ..util import one_of

DP_MODES = ("ddp", "fsdp")


def _bucket(value) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"dp_bucket_mb={value} must be a positive number of MiB")


AXIS = Axis(
    "dp", "DP", size="dp_size", mesh="dp", spans=("cp_size",),   # the gradients' group: dp x cp
    settings=(
        Setting("dp_size", int, 1, "data-parallel replicas of the tensor-parallel group (world = tp x dp)",
                flag="--dp-size", minimum=1, identity_at_default=False,
                estimate=EstimateFlag("data-parallel replicas (default 1; with --trace and no layout: the world, "
                                      "or the pipeline's stages if it sends)")),
        Setting("dp_mode", str, "ddp", f"{one_of(DP_MODES)} (ddp: replicas hold whole parameters; fsdp: ZeRO-3, "
                                       "parameters sharded and gathered)",
                flag="--dp-mode", choices=DP_MODES, identity_at_default=False,
                estimate=EstimateFlag("ddp or fsdp (default ddp)", default="ddp")),
        Setting("dp_bucket_mb", float, 25.0, "DDP gradient bucket cap, MiB (PyTorch DDP's bucket_cap_mb)",
                check=_bucket, identity_at_default=False,
                estimate=EstimateFlag("DDP bucket (FSDP unit) MiB (default 25)", default=25.0)),
        Setting("dp_overlap", bool, True, "bucket all-reduces overlap the backward pass, as DDP's do",
                identity_at_default=False,
                estimate=EstimateFlag("buckets wait for the backward to end (default: they overlap it, as DDP's do)",
                                      default=True, name="--no-dp-overlap")),
        Setting("dp_sync_every", int, 0, "reliable broadcast of replica 0's parameters every K steps (0: never)",
                minimum=0, identity_at_default=False),
    ),
    traffic=("dp", "fsdp"),
    counters=(Counter("dp_s", 0.0, "seconds the buckets (and syncs) add", per_step="dp_s_per_step",
                      clock=("sim_time_s", "sim_time_s_ideal_nic"), clock_order=1),
              Counter("drift", (), "every train row's replica drift")),
    summary="data_parallel",
    columns=(Column("replicas", "dp_size", number=False), Column("drift", "drift_final"), Column("drift_max", "drift_max"),
             Column("observed_loss_rate_dp", "observed_loss_rate_dp"), Column("dp_s_per_step", "dp_s_per_step")),
    part="dp", record="lossysim.dp.record",
    budget=(Family("dp", "DP gradient buckets", "dp", dict(tp_size=1, dp_size=2), order=5),
            Family("fsdp", "FSDP gathers and reduce-scatters", "dp", dict(tp_size=1, dp_size=2, dp_mode="fsdp"),
                   order=6)))
