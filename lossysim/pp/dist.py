"""Pipeline stages on ``backend: dist``: one process per rank, real point-to-point sends between stages.

A process is TP rank t of stage s (``Mesh.position``). It builds the whole model as every process does
and runs only its stage's blocks: the other stages' blocks hand their input on untouched, and stay as
built (they get no gradients, so the optimiser never moves them). On stage s > 0 the embeddings'
output only gives the shape of what arrives: the hidden states entering the stage's first block are
what TP rank t of stage s-1 sent (``torch.distributed.recv``), after boundary s-1's network applied its
losses to them on this, the receiving, side. The input of stage s+1's first block is sent to TP rank t
of stage s+1 and the forward stops there; the backward starts from the gradient stage s+1 sends back
(the receiver, here, applies its losses). The last stage computes the loss and hands the logits,
losses (and, when evaluating, final hidden states) to every stage of its pipeline.

Every process runs the micro-batches one after another, as ``sim`` does: micro-batch 0's forward
through every stage, its backward, then micro-batch 1's. So each boundary's network draws its sends
in ``sim``'s order; a process draws every TP rank's send of a boundary it touches, its own link's with
the data (``LossyNetwork.send``) and the others' without (``simulate(pair=...)``), so both stages of a
boundary keep its streams, counters and clock as ``sim``'s one network. The clock's per-stage and
per-boundary seconds, the gradient norm's per-parameter squares and the statistics of the networks a
process does not run cross a reliable channel (gathers over torch.distributed), so every process
computes ``sim``'s clock, clipping and metrics rows, bit for bit.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..config import ExperimentConfig
from ..mesh import Mesh
from ..net import LossyNetwork
from ..tp import TensorParallelModel, gather_full_model
from ..tp.plans import plan_for
from ..util import stream_seed, swapped
from .stages import Boundary, Pipeline, cut_stages, on_hidden_states, parameter_stages


class _StageDone(Exception):
    """This stage's forward is over: its output went to the next stage (``hidden``)."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("stage done")
        self.hidden = hidden


class _AwaitGradient(torch.autograd.Function):
    """forward: the last stage's loss, backward: this stage's output's gradient, from the next stage."""

    @staticmethod
    def forward(ctx, hidden, loss, link):
        ctx.link, ctx.like = link, (hidden.shape, hidden.dtype, hidden.device)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):   # (``grad``, the loss's, is already in what the last stage sends)
        return ctx.link.receive_gradient(*ctx.like), None, None


@dataclass
class _Link:
    """This process's sends: boundary ``stage - 1`` from ``previous`` (a global rank), boundary ``stage``
    to ``next`` (None where there is no such stage). A recomputed forward (activation checkpointing)
    gets again what the stage received, nothing received, drawn or timed (``recording``, ``replaying``)."""
    before: Optional[Boundary]
    after: Optional[Boundary]
    tp_rank: int
    previous: Optional[int]
    next: Optional[int]
    _record: Optional[dict] = None
    _replay: Optional[dict] = None

    def recording(self, record: dict):
        return swapped(self, "_record", record)

    def replaying(self, record: dict):
        return swapped(self, "_replay", record)

    def _draw(self, boundary: Boundary, direction: str, message: torch.Tensor, mine: bool) -> torch.Tensor:
        """Every TP rank's send over ``boundary`` in ``sim``'s order; ``mine``: this process receives its
        own link's ``message`` and applies the losses. What arrived on its link."""
        def send(t, src, dst):
            if mine and t == self.tp_rank:
                return boundary.network.send(boundary.site, direction, message, src, dst)
            boundary.network.simulate(boundary.site, direction, message.numel(), message.dtype, "send",
                                      message.device, pair=(src, dst))
            return None
        return boundary.timed(direction, send)[self.tp_rank]

    def receive(self, stand_in: torch.Tensor) -> torch.Tensor:
        """The stage's input: what the previous stage sent in place of ``stand_in`` (the embeddings'
        output, of the same shape). A leaf of this stage's graph, whose gradient goes back."""
        if self._replay is not None:
            return self._replay["received"].popleft()
        buffer = torch.empty_like(stand_in, memory_format=torch.contiguous_format)
        dist.recv(buffer, self.previous)
        received = self._draw(self.before, "fwd", buffer, mine=True)
        if torch.is_grad_enabled():
            received = received.detach().requires_grad_()
            received.register_hook(self.return_gradient)
        if self._record is not None:
            self._record["received"].append(received)
        return received

    def return_gradient(self, grad: torch.Tensor) -> None:
        dist.send(grad.contiguous(), self.previous)
        self._draw(self.before, "bwd", grad, mine=False)

    def send(self, hidden: torch.Tensor):
        """The forward's end: the next stage's input sent, and the forward stopped (``_StageDone``)."""
        dist.send(hidden.detach().contiguous(), self.next)
        self._draw(self.after, "fwd", hidden, mine=False)
        raise _StageDone(hidden)

    def receive_gradient(self, shape, dtype, device) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buffer, self.next)
        return self._draw(self.after, "bwd", buffer, mine=True)


@dataclass
class DistPipeline(Pipeline):
    """This process's stage of a pipeline (``stage``, TP rank ``tp_rank``): every stage's and boundary's
    networks, as ``Pipeline``; those this process does not run (not its stage's, not a boundary of it)
    mirror their owner's state after every step and evaluation (``gathered``, ``evaluating``)."""
    stage: int = 0
    tp_rank: int = 0
    rank: int = 0          # this process's global rank (its pipeline: the ranks alike it but in their stage)
    mesh: Optional[Mesh] = None
    group: Any = None      # this pipeline's process group (one rank per stage)
    link: Optional[_Link] = None
    # other networks per stage that a stage's process runs (``train``, ``eval``: context groups), mirrored too
    extras: Optional[dict] = None

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def _rank(self, stage: int) -> int:
        return self.mesh.moved(self.rank, pp=stage)

    def from_last(self, value):
        """``value`` as the last stage holds it, on every stage of this pipeline (reliable)."""
        box = [value]
        dist.broadcast_object_list(box, src=self._rank(self.stages - 1), group=self.group)
        return box[0]

    def _all(self, value) -> list:
        """Every stage's ``value``, stage by stage, over this pipeline's ranks (reliable)."""
        every = [None] * self.stages
        dist.all_gather_object(every, value, group=self.group)
        return every

    # -- what a process does not run, from those that do ---------------------------------------------
    def _extras(self, kind: str) -> list[list[LossyNetwork]]:
        return self.extras[kind] if self.extras else [[] for _ in range(self.stages)]

    def _own(self, networks: list[LossyNetwork], boundaries: list[Boundary], kind: str = "train") -> dict:
        return {"stage": _light(networks[self.stage].state_dict()),
                "boundary": None if self.last else _light(boundaries[self.stage].network.state_dict()),
                "extras": [_light(n.state_dict()) for n in self._extras(kind)[self.stage]]}

    def _mirror(self, every: list[dict], networks: list[LossyNetwork], boundaries: list[Boundary],
                kind: str = "train") -> None:
        for s, owned in enumerate(every):
            if s != self.stage:
                networks[s].load_state_dict(owned["stage"])
                for network, state in zip(self._extras(kind)[s], owned["extras"], strict=True):
                    network.load_state_dict(state)
            if owned["boundary"] is not None and s not in (self.stage - 1, self.stage):
                boundaries[s].network.load_state_dict(owned["boundary"])

    def gathered(self, stages: dict) -> dict:
        """Each stage's forward and backward seconds per micro-batch and each boundary's sends, from
        the processes that ran them; the networks this process does not run take their owners' state."""
        mine = {"forward": [row[self.stage] for row in stages["forward"]],
                "backward": [row[self.stage] for row in stages["backward"]],
                "activation": None if self.last else stages["activation"][self.stage],
                "gradient": None if self.last else stages["gradient"][self.stage],
                "networks": self._own(self.networks, self.boundaries)}
        every = self._all(mine)
        for phase in ("forward", "backward"):
            for i, row in enumerate(stages[phase]):
                row[:] = [owned[phase][i] for owned in every]
        for kind in ("activation", "gradient"):
            stages[kind] = [owned[kind] for owned in every[:-1]]
        self._mirror([owned["networks"] for owned in every], self.networks, self.boundaries)
        return stages

    @contextlib.contextmanager
    def evaluating(self, groups):
        """This stage's group and every boundary on their evaluation networks; afterwards the
        evaluation networks this process does not run take their owners' state."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(swapped(groups[0], "network", self.eval_networks[self.stage]))
            for boundary, evaluation in zip(self.boundaries, self.eval_boundaries):
                stack.enter_context(swapped(boundary, "network", evaluation.network))
                stack.enter_context(swapped(boundary, "seconds", evaluation.seconds))
            yield
        every = self._all(self._own(self.eval_networks, self.eval_boundaries, "eval"))
        self._mirror(every, self.eval_networks, self.eval_boundaries, "eval")

    def across_stages(self, values: list, device) -> list:
        every = self._all([v.detach().cpu() for v in values])
        return [value.to(device) for values_of in every for value in values_of]

    def full_model(self, tp_model) -> nn.Module:
        """The whole trained HF model on the first process (every process takes part): each stage's
        parameters from its TP rank 0."""
        full = gather_full_model(tp_model)
        owner = parameter_stages(full, self.layout)
        mine = {name: p.detach().cpu() for name, p in full.named_parameters() if owner[id(p)] == self.stage} \
            if self.rank == self.mesh.rank(pp=self.stage) else {}   # its stage's first rank
        every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, every, dst=0)
        if every is not None:
            with torch.no_grad():
                for owned in every:
                    for name, tensor in owned.items():
                        full.get_parameter(name).copy_(tensor)
        return full


def _light(state: dict) -> dict:
    """A network's state without what its recovery policy keeps per link (the receiver's alone)."""
    return {**state, "channels": {key: {**entry, "recovery": None} for key, entry in state["channels"].items()}}


class PipelineStage(TensorParallelModel):
    """A ``TensorParallelModel`` that runs one stage (``pipeline``: a ``DistPipeline``): called like the
    model, it returns the last stage's logits and loss on every stage; a stage before the last
    backpropagates that loss through the gradient the next stage sends back."""
    pipeline: DistPipeline

    def forward(self, **inputs):
        pipeline = self.pipeline
        try:
            out = super().forward(**inputs)
        except _StageDone as done:
            out, hidden = None, done.hidden
        evaluating = not self.training
        if pipeline.last:
            pipeline.from_last((self.rank_logits.detach(), None if self.rank_losses is None else
                                self.rank_losses.detach(), self.rank_hidden.detach() if evaluating else None))
            return out
        self.rank_logits, self.rank_losses, rank_hidden = pipeline.from_last(None)
        if evaluating:
            self.rank_hidden = rank_hidden
        loss = None
        if self.rank_losses is not None:
            loss = self.rank_losses[0]
            if torch.is_grad_enabled() and hidden.requires_grad:
                loss = _AwaitGradient.apply(hidden, loss, pipeline.link)
        key = "last_hidden_state" if self.kind == "model" else "logits"
        return SimpleNamespace(loss=loss, **{key: self.rank_logits[0]})

    @torch.no_grad()
    def disagreement(self) -> dict:
        return self.pipeline.from_last(super().disagreement() if self.pipeline.last else None)


def apply_dist_pp(model: nn.Module, config: ExperimentConfig, mesh: Mesh, train_net: LossyNetwork,
                  eval_net: LossyNetwork, rank: int) -> Optional[DistPipeline]:
    """Cut ``model``'s blocks into stages (``cut_stages``; None for one stage) for global rank ``rank``'s
    process: the other stages' blocks hand their input on, its stage's first block receives from the
    previous stage and the next stage's first block sends to it. ``attach`` it to the TP model."""
    at = mesh.coordinates(rank)
    stage, tp_rank = at["pp"], at["tp"]
    pipeline = cut_stages(model, config, mesh, train_net, eval_net, (mesh.alike(rank, "tp", "pp"),))
    if pipeline is None:
        return None
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is embeddings.weight:
        raise ValueError(f"pp_size={config.pp_size} with backend=dist: the model's head is tied to its "
                         "embeddings (first and last stage); use backend=sim")
    p = pipeline.stages
    link = _Link(pipeline.boundaries[stage - 1] if stage else None,
                 pipeline.boundaries[stage] if stage < p - 1 else None, tp_rank,
                 mesh.moved(rank, pp=stage - 1) if stage else None,
                 mesh.moved(rank, pp=stage + 1) if stage < p - 1 else None)
    plan, _ = plan_for(model)
    base = model.base_model
    blocks = base.get_submodule(plan.blocks)
    first = sum(pipeline.layout[:stage])
    for i, block in enumerate(blocks):
        if not first <= i < first + pipeline.layout[stage]:
            block.forward = _hand_on
    if stage:
        blocks[first].register_forward_pre_hook(on_hidden_states(link.receive),
                                                with_kwargs=True)
        # The embeddings only give what arrives its shape: their dropout must not draw from this stage's stream.
        for path in plan.base_dropouts:
            parent, _, leaf = path.rpartition(".")
            setattr(base.get_submodule(parent) if parent else base, leaf, nn.Identity())
    if stage < p - 1:
        blocks[first + pipeline.layout[stage]].register_forward_pre_hook(on_hidden_states(link.send),
                                                                         with_kwargs=True)
    fields = {f.name: getattr(pipeline, f.name) for f in dataclasses.fields(Pipeline)}
    return DistPipeline(**fields, stage=stage, tp_rank=tp_rank, rank=rank, mesh=mesh, link=link)


def attach(pipeline: DistPipeline, tp_model: TensorParallelModel, group, seed: int) -> PipelineStage:
    """``tp_model`` (this stage's TP group, on ``pipeline.networks[stage]``) as a ``PipelineStage`` of
    ``pipeline`` over ``group`` (its pipeline's process group); the stage's replicated dropout draws
    from the stream ``sim`` gives the stage (``seed``: the run's)."""
    pipeline.group = group
    if pipeline.stage:
        tp_model.group.seed = stream_seed(seed, f"pp.stage{pipeline.stage}", "replicated-dropout")
    tp_model.__class__ = PipelineStage   # the same modules, hooks and shards; a stage's forward
    tp_model.pipeline = pipeline
    tp_model.replayed = [*tp_model.replayed, pipeline.link]   # what it received, for a recomputed block
    return tp_model


def _hand_on(*args, **kwargs):
    """Another stage's block in this process: its input hidden states, untouched."""
    return args[0] if args else kwargs["hidden_states"]
