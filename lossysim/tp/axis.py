"""Tensor parallelism declared once (``lossysim.axes``): its size and its traffic; everything else about
it (the network, packets, the clock) is every run's own."""
from ..axes import Axis, EstimateFlag, Family, Setting

AXIS = Axis(
    "tp", "TP", size="tp_size", mesh="tp",
    settings=(Setting("tp_size", int, 2, "tensor-parallel degree", flag="--tp-size", minimum=1,
                      estimate=EstimateFlag("tensor-parallel degree (default 8; with --trace 1)", unset=8)),),
    traffic=("tp",), link_events=False,
    # tp 3 for SmolLM2's 9 query and 3 kv heads; the trade's job (a dense 8B) takes tp 2
    budget=(Family("tp", "TP activations and gradients", "tp_forward,tp_backward", dict(tp_size=3),
                   job=dict(tp_size=2), order=0),))
