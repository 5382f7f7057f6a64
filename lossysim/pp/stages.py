"""Pipeline stages: a model's blocks cut into consecutive stages, and the sends between them.

``apply_pp`` cuts the blocks (``stage_layout``): the embeddings sit on the first stage, the final
norm and the head on the last. Each stage is tensor-parallel over a TP group of its own, with its own
``LossyNetwork`` (``Mesh.network_spec("tp", rank, settings)`` at its replica and stage; stage 0's is the run's
``train_net``, so a run with one stage keeps its streams). At boundary b, the input of stage b+1's
first block, ``send_to_next_stage`` moves the hidden states over boundary b's network
(``Mesh.network_spec("pp", ...)`` at stage b: its tp ranks, then stage b+1's): in ``sim`` they are
``[tp * rows, ...]``, every TP rank's copy, and TP rank t of stage b sends its full copy to TP rank t
of stage b+1 (network ranks t -> tp + t), the gradients coming back tp + t -> t. That is Megatron
without its scatter/gather optimisation (each rank sending 1/tp, re-gathered over the receiving
stage's TP links), which is not modelled.

Micro-batches run one after another through the whole model in one process, each one's forward and
then its backward: so boundary b's sends are issued in the order micro-batch 0's activation, micro-batch
0's gradient, micro-batch 1's activation, ... at every boundary, and each boundary network draws its
packets in that order (a one-process-per-stage backend must issue them in the same order to draw the
same bits, whatever order its schedule runs them in). The schedule (``pipeline_time``) times them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..config import ExperimentConfig, parse_layout
from ..mesh import Mesh
from ..models import cost
from ..net import LossyNetwork
from ..tp import gather_full_model
from ..tp.plans import plan_for
from ..util import swapped


def stage_layout(pp_layout: Optional[str], stages: int, layers: int) -> tuple[int, ...]:
    """Blocks per stage: ``pp_layout``'s counts, which must sum to ``layers``; None: an even split,
    refused when ``stages`` does not divide ``layers``."""
    if pp_layout is None:
        if layers % stages:
            raise ValueError(f"pp_size={stages} does not divide the model's {layers} layers: set pp_layout "
                             "(blocks per stage, e.g. 1,3) for an uneven split")
        return (layers // stages,) * stages
    counts = parse_layout(pp_layout, stages)
    if sum(counts) != layers:
        raise ValueError(f"pp_layout={pp_layout!r} holds {sum(counts)} blocks, the model has {layers} layers")
    return counts


def parameter_stages(model: nn.Module, layout: tuple[int, ...]) -> dict[int, int]:
    """The stage holding each parameter (by ``id``): its block's, the embeddings on the first, the
    final norm and the head on the last (a head tied to the embeddings sits with them)."""
    plan, _ = plan_for(model)
    base = model.base_model
    stage_of = [s for s, count in enumerate(layout) for _ in range(count)]
    owner = {}
    for name, param in base.named_parameters():
        if name.startswith(f"{plan.blocks}."):
            owner[id(param)] = stage_of[int(name.split(".")[1])]
        else:
            owner[id(param)] = len(layout) - 1 if name.startswith(f"{plan.final_norm}.") else 0
    for param in model.parameters():   # the head (outside the base model) on the last stage
        owner.setdefault(id(param), len(layout) - 1)
    return owner


def stage_parameters(model: nn.Module, layout: tuple[int, ...], expert_scale: Optional[float] = None) -> list[float]:
    """Parameters (of the whole, unsharded model) each stage holds (``parameter_stages``), a head tied
    to the embeddings counted once, with them, as 6 N T counts it (``lossysim.models.cost``). With
    ``expert_scale`` the ones a token's step multiplies: a routed expert's count top-k / experts times
    ``expert_scale`` (``cost.active_parameters``'s tp size; the estimate's busiest rank's load times tp),
    so a stage of experts is charged its active compute, not its experts' size."""
    owner = parameter_stages(model, layout)
    routed = {} if expert_scale is None else cost.routed_experts(model)
    counts = [0] * len(layout)
    for param in model.parameters():
        counts[owner[id(param)]] += param.numel() * (routed[id(param)] * expert_scale if id(param) in routed else 1)
    return counts


class _SendToNextStage(torch.autograd.Function):
    """forward: send the activations to the next stage, backward: send their gradients back."""

    @staticmethod
    def forward(ctx, x, boundary):
        ctx.boundary = boundary
        return boundary.send(x, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return ctx.boundary.send(grad, "bwd"), None


@dataclass
class Boundary:
    """Boundary ``index`` between stage ``index`` and the next: its network and, per direction, the
    seconds of every send since ``take_seconds`` (a send's time is its slowest TP rank's: the ranks
    send side by side over links of their own).

    With activation checkpointing the next stage's first block, whose input this boundary delivers,
    runs its forward again in the backward: the stage kept what arrived (Megatron's stage input is the
    checkpoint's), so the recomputed forward gets it again, nothing sent, drawn or timed (``recording``,
    ``replaying``).

    With context parallelism (``sim``) every context rank's TP group sends its own rows (``[tp, cp,
    batch]``) over its own boundary network: ``network`` is context rank 0's, ``contexts`` the others'
    (counted, their time not charged: as TP's, the pipeline's clock is context rank 0's)."""
    index: int
    tp: int
    network: LossyNetwork
    seconds: dict = field(default_factory=lambda: {"fwd": [], "bwd": []})
    contexts: list = field(default_factory=list)
    _record: Optional[dict] = field(default=None, repr=False)
    _replay: Optional[dict] = field(default=None, repr=False)

    @property
    def site(self) -> str:
        return f"pp.boundary{self.index}"

    def send(self, x: torch.Tensor, direction: str) -> torch.Tensor:
        """Every TP rank's copy in ``x`` ([tp * rows, ...]) over its own link; what the receivers hold."""
        if self._replay is not None and direction == "fwd":
            return self._replay["received"].popleft()
        if self.contexts:
            copies = x.reshape(self.tp, 1 + len(self.contexts), -1, *x.shape[1:])
            first = self.timed(direction, lambda t, src, dst: self.network.send(self.site, direction, copies[t, 0],
                                                                                 src, dst))
            others = [[network.send(self.site, direction, copies[t, c + 1], *self._pair(t, direction))
                       for t in range(self.tp)] for c, network in enumerate(self.contexts)]
            received = torch.stack([torch.stack(per) for per in zip(first, *others)]).reshape(x.shape)
        else:
            copies = x.reshape(self.tp, -1, *x.shape[1:])
            out = self.timed(direction, lambda t, src, dst: self.network.send(self.site, direction, copies[t], src, dst))
            received = torch.stack(out).reshape(x.shape)
        if self._record is not None and direction == "fwd":
            self._record["received"].append(received.detach())
        return received

    def recording(self, record: dict):
        return swapped(self, "_record", record)

    def replaying(self, record: dict):
        return swapped(self, "_replay", record)

    def timed(self, direction: str, send) -> list:
        """``send(t, src, dst)`` for TP rank t = 0.. of the sending stage over its link (network ranks),
        in that order, the order every process draws them in; what they return. The slowest one's
        seconds are this message's."""
        slowest, out = [0.0, 0.0], []
        for t in range(self.tp):
            src, dst = self._pair(t, direction)
            before = self.network.clock()
            out.append(send(t, src, dst))
            after = self.network.clock()
            slowest = [max(slowest[0], after["comm_s"] - before["comm_s"]),
                       max(slowest[1], after["comm_s_ideal_nic"] - before["comm_s_ideal_nic"])]
        self.seconds[direction].append(slowest)
        return out

    def _pair(self, t: int, direction: str) -> tuple[int, int]:
        """TP rank t's link (network ranks): t -> tp + t forward, back backward."""
        return (t, self.tp + t) if direction == "fwd" else (self.tp + t, t)

    def take_seconds(self, direction: str) -> list[list[float]]:
        """[comm_s, comm_s_ideal_nic] of each send in ``direction`` since the last take, in order."""
        taken, self.seconds[direction] = self.seconds[direction], []
        return taken


def on_hidden_states(apply):
    """A forward pre-hook on a block: its input hidden states replaced by ``apply(hidden_states)``."""
    def hook(module, args, kwargs):
        if args:
            return (apply(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": apply(kwargs["hidden_states"])}
        raise TypeError(f"{type(module).__name__} got no hidden states to receive from the previous stage")
    return hook


@dataclass
class Pipeline:
    """A run's stages: blocks per stage, each stage's active parameters (unsharded, as the run's compute
    counts them: ``stage_parameters``), its TP network (stage 0's
    is the run's ``train_net``) and evaluation network, and the boundaries between them."""
    layout: tuple[int, ...]
    parameters: list[float]
    networks: list[LossyNetwork]
    eval_networks: list[LossyNetwork]
    boundaries: list[Boundary]
    eval_boundaries: list[Boundary]

    @property
    def stages(self) -> int:
        return len(self.layout)

    def boundary_networks(self) -> list[LossyNetwork]:
        return [b.network for b in self.boundaries]

    @contextlib.contextmanager
    def evaluating(self, groups):
        """Every stage group (``TensorParallelModel.groups``) and boundary on its evaluation network."""
        with contextlib.ExitStack() as stack:
            for group, network in zip(groups, self.eval_networks):
                stack.enter_context(swapped(group, "network", network))
            for boundary, evaluation in zip(self.boundaries, self.eval_boundaries):
                stack.enter_context(swapped(boundary, "network", evaluation.network))
                stack.enter_context(swapped(boundary, "contexts", evaluation.contexts))
                stack.enter_context(swapped(boundary, "seconds", evaluation.seconds))  # no step times them
            yield

    def gathered(self, stages: dict) -> dict:
        """A step's per-stage and per-boundary seconds (``run.step``), every stage's: here all of them
        ran in this process (``dist``: each process brings its own)."""
        return stages

    def across_stages(self, values: list, device) -> list:
        """Every stage's ``values`` (per-parameter sums of squares, a stage's in its parameter order),
        stage after stage, on ``device``: here this process's are all of them."""
        return values

    def full_model(self, tp_model) -> nn.Module:
        """The whole trained HF model (``gather_full_model``)."""
        return gather_full_model(tp_model)

    def state_dict(self) -> dict:
        """Stage 1.. and every boundary's networks (stage 0's are saved as the run's own); with context
        ranks, their boundaries' too."""
        state = {"stages": [n.state_dict() for n in self.networks[1:]],
                 "eval_stages": [n.state_dict() for n in self.eval_networks[1:]],
                 "boundaries": [b.network.state_dict() for b in self.boundaries],
                 "eval_boundaries": [b.network.state_dict() for b in self.eval_boundaries]}
        if any(b.contexts for b in self.boundaries):
            state["context_boundaries"] = [n.state_dict() for n in self._context_networks()]
        return state

    def _context_networks(self) -> list[LossyNetwork]:
        return [n for b in [*self.boundaries, *self.eval_boundaries] for n in b.contexts]

    def load_state_dict(self, state: dict) -> None:
        for key, networks in (("stages", self.networks[1:]), ("eval_stages", self.eval_networks[1:]),
                              ("boundaries", self.boundary_networks()),
                              ("eval_boundaries", [b.network for b in self.eval_boundaries]),
                              ("context_boundaries", self._context_networks())):
            for network, saved in zip(networks, state.get(key, []), strict=True):
                network.load_state_dict(saved)


def cut_stages(model: nn.Module, config: ExperimentConfig, mesh: Mesh, train_net: LossyNetwork,
               eval_net: Optional[LossyNetwork], firsts: tuple[int, ...] = (0,)) -> Optional[Pipeline]:
    """``model``'s blocks cut into ``config.pp_size`` stages (None for one stage): the layout, and the
    networks of the pipelines whose first ranks (TP rank 0 at stage 0) are ``firsts``: ``firsts[0]``'s every
    stage's (the first stage's are ``train_net`` and ``eval_net``) and every boundary's, and every boundary's
    of the others (sim's context ranks 1..: ``Boundary.contexts``). Evaluation runs on replica 0's networks
    (none for another replica's: ``eval_net`` None)."""
    if config.pp_size == 1:
        return None
    plan, _ = plan_for(model)
    blocks = model.base_model.get_submodule(plan.blocks)
    layout = stage_layout(config.pp_layout, config.pp_size, len(blocks))
    settings, evaluation = config.network_settings(), config.network_settings(evaluation=True)
    first = firsts[0]
    networks = [train_net] + [LossyNetwork(mesh.network_spec("tp", mesh.moved(first, pp=s), settings))
                              for s in range(1, config.pp_size)]
    eval_networks = [] if eval_net is None else \
        [eval_net] + [LossyNetwork(mesh.network_spec("tp", mesh.moved(first, dp=0, pp=s), evaluation))
                      for s in range(1, config.pp_size)]
    lossy = config.pp_lossy()

    # boundary b's network: "pp" at a rank of stage b (its TP group and stage b + 1's), per pipeline
    def boundary(b: int, values: dict, evaluated: bool) -> Boundary:
        at = {"pp": b, **({"dp": 0} if evaluated else {})}   # evaluation's: replica 0's
        nets = [LossyNetwork(mesh.network_spec("pp", mesh.moved(f, **at), values, lossy)) for f in firsts]
        return Boundary(b, mesh.tp, nets[0], contexts=nets[1:])
    boundaries = [boundary(b, settings, False) for b in range(config.pp_size - 1)]
    eval_boundaries = [] if eval_net is None else [boundary(b, evaluation, True) for b in range(config.pp_size - 1)]
    return Pipeline(layout, stage_parameters(model, layout, config.tp_size), networks, eval_networks, boundaries, eval_boundaries)


def apply_pp(model: nn.Module, config: ExperimentConfig, mesh: Mesh, train_net: LossyNetwork,
             eval_net: Optional[LossyNetwork], replica: int = 0) -> Optional[Pipeline]:
    """Cut ``model``'s blocks into ``config.pp_size`` stages (``cut_stages``; None for one stage), every
    stage in this process (``sim``): a boundary send on the input of every stage's first block but the
    first's. Called before ``apply_tp``, which puts each stage's blocks on its own TP group."""
    # every context rank's pipeline of the replica, each by its first rank (stage 0, TP rank 0), in rank order
    firsts = sorted({mesh.alike(r, "tp", "pp") for r in range(mesh.world) if mesh.coordinates(r)["dp"] == replica})
    pipeline = cut_stages(model, config, mesh, train_net, eval_net, tuple(firsts))
    if pipeline is None:
        return None
    plan, _ = plan_for(model)
    blocks = model.base_model.get_submodule(plan.blocks)
    for boundary in pipeline.boundaries:
        first = sum(pipeline.layout[:boundary.index + 1])
        blocks[first].register_forward_pre_hook(
            on_hidden_states(lambda x, boundary=boundary: _SendToNextStage.apply(x, boundary)), with_kwargs=True)
    return pipeline
