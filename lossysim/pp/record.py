"""What a run records of its pipeline (``lossysim.pp.axis`` names this module): the boundaries' packets in
the metrics rows, summary.json's ``pipeline``, the bubble, its traffic and collectives, its checkpoint state."""
from __future__ import annotations

from ..net.stats import class_row


def bubble(busy_s: float, pipeline_s: float, stages: int) -> float:
    """The stages' idle share of the schedule's time: 1 - busy / (stages x time)."""
    return 1.0 - busy_s / (stages * pipeline_s) if pipeline_s > 0 else 0.0


def train_row(pipeline, state) -> dict:
    """The boundaries' packets: activations (``pp_fwd``) and their gradients (``pp_bwd``) sent and lost so
    far, and the loss rate over their lossy directions (``observed_loss_rate_pp``)."""
    return class_row("pp", pipeline.boundary_networks())


def eval_row(pipeline) -> dict:
    return class_row("pp", [b.network for b in pipeline.eval_boundaries])


def summary(pipeline, config, state) -> dict:
    """summary.json's ``pipeline``: the layout (stages, schedule, micro-batches, blocks per stage, rank
    order), the bubble and the boundary sends' time per step, and every boundary's and stage's traffic."""
    steps = max(state.step, 1)
    return {"pp_size": config.pp_size, "pp_schedule": config.pp_schedule, "microbatches": config.n_microbatches,
            "stage_layers": list(pipeline.layout),
            "bubble": bubble(state.pp_busy_s, state.pipeline_s, pipeline.stages),
            "pipeline_s_per_step": state.pipeline_s / steps, "pp_s_per_step": state.pp_s / steps,
            **class_row("pp", pipeline.boundary_networks()),
            "packets_by_boundary": [n.summary(by=("direction", "link_class")) for n in pipeline.boundary_networks()],
            "packets_by_stage": [n.summary() for n in pipeline.networks]}


def traffic(pipeline) -> dict:
    networks = pipeline.boundary_networks()
    return {"pp": (networks, [n.summary() for n in networks])}


def collectives(pipeline) -> dict:
    """``pp.boundary{b}``: the sends of stage b to b+1."""
    return {"pp": [(f"pp.boundary{b}", n) for b, n in enumerate(pipeline.boundary_networks())]}


def save(parts):
    return {**parts.pipeline.state_dict(), "replicated_rng": [g.rng_state() for g in parts.model.groups[1:]]}


def load(parts, saved) -> None:
    parts.pipeline.load_state_dict(saved)
    for group, rng in zip(parts.model.groups[1:], saved["replicated_rng"], strict=True):
        group.load_rng_state(rng)
