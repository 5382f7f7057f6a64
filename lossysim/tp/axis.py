"""Tensor parallelism declared once (``lossysim.axes``): its size and its traffic; everything else about
it (the network, packets, the clock) is every run's own."""
from ..axes import Axis, EstimateFlag, Setting

AXIS = Axis(
    "tp", "TP", size="tp_size", mesh="tp",
    settings=(Setting("tp_size", int, 2, "tensor-parallel degree", flag="--tp-size", minimum=1,
                      estimate=EstimateFlag("tensor-parallel degree (default 8; with --trace 1)", unset=8)),),
    traffic=("tp",), link_events=False)
