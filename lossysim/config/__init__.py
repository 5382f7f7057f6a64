"""Experiment configuration: one flat dataclass, loaded from YAML and CLI overrides (``experiment``: the
dataclass and its types; ``choices``: what a setting may be; ``pairs``: the checks between settings;
``load``: files, --set and older configs; ``execution``: threads and jobs, how a process runs).

Validated once here, at the edge, so the rest of the code can trust it.
"""
from .choices import (BACKENDS, DP_MODES, IDENTITY_AT_DEFAULT_OMITTED, NON_SEMANTIC,
                      PP_SCHEDULES, TRACKERS, parse_layout, parse_report_to)
from .execution import DEFAULT_THREADS, cores, default_jobs, set_threads
from .experiment import ExperimentConfig, coerce, from_dict
from .load import load_config, load_yaml, parse_overrides, save_yaml, upgrade

__all__ = ["DEFAULT_THREADS", "cores", "default_jobs", "set_threads", "BACKENDS", "DP_MODES",
           "IDENTITY_AT_DEFAULT_OMITTED", "NON_SEMANTIC",
           "PP_SCHEDULES", "TRACKERS", "ExperimentConfig", "coerce", "from_dict", "load_config", "load_yaml",
           "parse_layout", "parse_overrides", "parse_report_to", "save_yaml", "upgrade"]
