"""Pipeline parallelism: the model's blocks cut into consecutive stages, micro-batches run through them
under a schedule (GPipe or 1F1B), and the clock of that schedule."""
from .schedule import SCHEDULES, Op, PipelineTiming, pipeline_time, stage_ops, timeline_plot
from .stages import Pipeline, apply_pp, stage_layout

__all__ = ["SCHEDULES", "Op", "PipelineTiming", "pipeline_time", "stage_ops", "timeline_plot", "Pipeline",
           "apply_pp", "stage_layout"]
