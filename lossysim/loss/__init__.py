"""Packet-loss models stepped once per packet as Linux netem steps them, their specs, and traces."""
from .four_state import FourState
from .gilbert_elliott import GilbertElliott
from .models import Bernoulli, LossModel, NoLoss
from .spec import parse_loss_model
from .traces import Trace, load_trace, trace_runs

__all__ = ["Bernoulli", "FourState", "GilbertElliott", "LossModel", "NoLoss", "Trace", "load_trace", "trace_runs",
           "parse_loss_model"]
