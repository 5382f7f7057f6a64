"""Pipeline parallelism: the model's blocks cut into consecutive stages, micro-batches run through them
under a schedule (GPipe or 1F1B), and the clock of that schedule.

Its names are imported on first use (PEP 562): ``config`` reads the package's declaration
(``axis.py``) before the modules below can be imported.
"""
from ..util import lazy_exports

_EXPORTS = {"SCHEDULES": ".schedule", "Op": ".schedule", "PipelineTiming": ".schedule",
            "pipeline_time": ".schedule", "pipeline_ends": ".schedule", "stage_ops": ".schedule",
            "timeline_plot": ".schedule",
            "Pipeline": ".stages", "apply_pp": ".stages", "stage_layout": ".stages"}
__all__ = ["SCHEDULES", "Op", "PipelineTiming", "pipeline_time", "pipeline_ends", "stage_ops", "timeline_plot",
           "Pipeline", "apply_pp", "stage_layout"]

__getattr__ = lazy_exports(__name__, _EXPORTS)
