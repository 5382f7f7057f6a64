"""One replica of the TP group: its model, optimiser, schedule and pipeline, and what it carries from step
to step (``lossysim.dp.replicas`` joins the replicas)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..pp.stages import Pipeline, parameter_stages


@dataclass
class Replica:
    """One replica of the TP group: its model (whose TP network is its own), optimiser and schedule, and
    with pipeline stages its ``Pipeline`` (every stage's and boundary's networks)."""
    model: Any            # a TensorParallelModel
    optimizer: Any
    scheduler: Any
    pipeline: Optional[Pipeline] = None

    def state_dict(self) -> dict:
        """What this replica carries from step to step: weights, optimiser moments, schedule, its TP
        network (chains, streams, counters, recovery memory) and its replicated dropout stream; its later
        stages' and boundaries' networks and streams."""
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "network": self.model.network.state_dict(),
                 "replicated_rng": self.model.group.rng_state()}
        if self.pipeline is not None:
            state["pp"] = {**self.pipeline.state_dict(),
                           "replicated_rng": [g.rng_state() for g in self.model.groups[1:]]}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.model.network.load_state_dict(state["network"])
        self.model.group.load_rng_state(state["replicated_rng"])
        if self.pipeline is not None:
            self.pipeline.load_state_dict(state["pp"])
            for group, rng in zip(self.model.groups[1:], state["pp"]["replicated_rng"], strict=True):
                group.load_rng_state(rng)

    def stage_of_parameters(self) -> list[int]:
        """The pipeline stage holding each of the model's parameters, in ``parameters()`` order (all 0
        without stages)."""
        params = list(self.model.parameters())
        if self.pipeline is None:
            return [0] * len(params)
        owner = parameter_stages(self.model.model, self.pipeline.layout)
        return [owner[id(p)] for p in params]
