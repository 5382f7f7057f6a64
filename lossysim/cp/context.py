"""``apply_cp``: a tensor-parallel model's sequences split over a context group, keys and values over the
lossy network.

Each context rank holds its chunks of every sequence (``layout``): the model's blocks run on its local
tokens at their global positions, and each attention module gathers the other ranks' keys and values
through the group's network (``exchange``, ``attention``). Around the blocks, hooks make the HF model's own
forward do it (torchtitan's ``apply_cp`` wraps the model the same way):

- the base model's input: every sequence padded on the right to 2 x cp chunks and cut into the ranks'
  local sequences, with their global positions (``position_ids``);
- the final norm's output: every rank's final hidden states in sequence order again (``rank_hidden``,
  what evaluation reads);
- the head's output (the LM head, the classifier's ``score``; the base model's own for a model without
  one): every rank's local logits in sequence order, cut back to the input's length, so HF's loss and the
  classifier's last-token pooling read the whole sequence.

``sim`` runs every context rank in one process: a TP rank's rows hold its context ranks' local sequences
(``[tp, cp, batch]``), the TP group is a ``ContextGroup`` (each context rank's TP traffic on that rank's
own TP network, its matmuls and its replicated modules run on its own rows with its own views of the
parameters), and a parameter's gradient is the context ranks' gradients summed, rank by rank. ``dist``
runs one: the other ranks' logits and hidden states arrive by a reliable all-gather. The context ranks'
gradients are summed as Megatron sums them, in the data-parallel all-reduce over dp x cp (one replica's
too: over the context group), through its lossy network (``lossysim.dp``; ``sim`` keeps each context
rank's apart: ``group.Gradients``), so both backends end a step with the same bits. With pipeline stages each
stage's blocks exchange over that stage's context groups (docs/context.md).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import timing
from ..models import cost
from ..net import LossyNetwork
from . import attention, clock, layout
from .exchange import Exchange, exchanged
from .group import ContextGroup, Gradients


@dataclass
class Networks:
    """One set of a replica's context-parallel networks (training's or evaluation's), stage by stage (one
    stage without a pipeline): ``cp``: the context group's of each TP position this process runs; ``tp``:
    (``sim``) the TP groups' of context ranks 1.. (context rank 0's is the TP model's own network, or its
    stage's). On ``dist`` with stages a process runs its own stage's; the others' mirror their owners'
    (``lossysim.pp.dist``)."""
    cp: list[LossyNetwork]
    tp: list[LossyNetwork] = field(default_factory=list)
    stages: int = 1

    def of_stage(self, kind: str, stage: int) -> list[LossyNetwork]:
        networks = getattr(self, kind)
        per = len(networks) // self.stages
        return networks[stage * per:(stage + 1) * per]

    def all(self) -> list[LossyNetwork]:
        return [*self.cp, *self.tp]

    def state_dict(self) -> dict:
        return {"cp": [n.state_dict() for n in self.cp], "tp": [n.state_dict() for n in self.tp]}

    def load_state_dict(self, state: dict) -> None:
        for networks, saved in ((self.cp, state["cp"]), (self.tp, state["tp"])):
            for network, entry in zip(networks, saved, strict=True):
                network.load_state_dict(entry)


class ContextParallel(nn.Module):
    """A TP model's context parallelism: ``cp`` ranks in ``mode``, this process running context ranks
    ``contexts`` (``sim``: all) of TP positions ``tp_positions`` (``sim``: all); its networks (``train``,
    ``evaluation``: chosen by the module's training flag) and their saved state (``get_extra_state``: a
    checkpoint's model holds it); on ``dist`` the context process group.

    ``take_seconds`` gives what the exchanges of the forwards and backwards since the last take added to
    them (``clock.exposed``), with the run's nic and the ideal one."""

    def __init__(self, cp: int, mode: str, contexts: list[int], tp_positions: list[int], train: Networks,
                 evaluation: Optional[Networks], pad_token_id: int, hidden: int, tp_size: int, compute,
                 group=None):
        super().__init__()
        self.cp, self.mode, self.contexts, self.tp_positions = cp, mode, list(contexts), list(tp_positions)
        self.tp_size = tp_size
        self.train_networks, self.eval_networks = train, evaluation
        self.pad_token_id, self.hidden, self.compute, self.group = pad_token_id, hidden, compute, group
        own = contexts[0] if group is not None else None
        self.stages = train.stages
        self._exchanges = {True: [Exchange(mode, n, group, own) for n in train.cp],
                           False: [] if evaluation is None else [Exchange(mode, n, group, own, record=False)
                                                                 for n in evaluation.cp]}
        self._batch = self._seq = self._padded = 0
        self._keys = None            # this forward's (valid keys [batch, keys], key positions, query positions)
        self.on_hidden: Callable[[torch.Tensor], None] = lambda hidden: None
        self.views: dict = {}        # this forward's per-rank views of replicated parameters (``ContextGroup``)
        # sim: each context rank's gradients, for the dp x cp all-reduce
        self.gradients: Optional[Gradients] = None
        self.tp_group = None         # dist with tp > 1: the TP ranks whose context groups sim records together

    # -- which networks -------------------------------------------------------------------------------
    @property
    def active(self) -> Networks:
        if not self.training and self.eval_networks is None:
            raise RuntimeError("this replica has no evaluation networks: evaluation runs replica 0")
        return self.train_networks if self.training else self.eval_networks

    @contextlib.contextmanager
    def evaluating(self):
        """An evaluation: its networks' counters start from zero (the model's eval mode selects them)."""
        for network in self.eval_networks.all() if self.eval_networks is not None else []:
            network.reset_stats()
        yield

    def get_extra_state(self) -> dict:
        return {"train": self.train_networks.state_dict(),
                "eval": None if self.eval_networks is None else self.eval_networks.state_dict()}

    def set_extra_state(self, state: dict) -> None:
        self.train_networks.load_state_dict(state["train"])
        if self.eval_networks is not None:
            self.eval_networks.load_state_dict(state["eval"])

    # -- the hooks --------------------------------------------------------------------------------------
    @property
    def _local(self) -> int:
        return len(self.tp_positions)

    def enter(self, module, args, kwargs):
        """The base model's input (every local TP rank's copy of whole sequences) as the local context
        ranks hold it, padded to 2 x cp chunks, with global positions."""
        ids = kwargs.pop("input_ids", None)
        if ids is None and args:
            ids, args = args[0], args[1:]
        if ids is None or kwargs.get("inputs_embeds") is not None:
            raise ValueError("context parallelism cuts input_ids into chunks: call the model with input_ids")
        rows, seq = ids.shape
        padded = layout.padded(seq, self.cp)
        mask = kwargs.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        extra = (0, padded - seq)
        ids, mask = F.pad(ids, extra, value=self.pad_token_id), F.pad(mask, extra, value=0)
        self._batch, self._seq, self._padded = rows // self._local, seq, padded
        where = layout.positions(padded, self.cp, ids.device)
        valid = mask.view(self._local, self._batch, padded)[0].bool()      # TP ranks' rows are copies
        keys = where.reshape(-1)
        self._keys = (valid[:, keys], keys, where[self.contexts])
        self.views = {}

        def cut(x: torch.Tensor) -> torch.Tensor:
            return layout.split(x, self.cp, self.contexts, self._local)
        kwargs.update(input_ids=cut(ids), attention_mask=cut(mask),
                      position_ids=cut(torch.arange(padded, device=ids.device).expand(rows, padded)))
        if kwargs.get("token_type_ids") is not None:
            kwargs["token_type_ids"] = cut(F.pad(kwargs["token_type_ids"], extra, value=0))
        return args, kwargs

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Local rows (``[local TP ranks * contexts * batch, L, ...]``) as whole sequences cut back to the
        input's length: ``[local TP ranks * batch, seq, ...]``."""
        if self.group is None:
            return layout.gather(local, self.cp, self._local, self._seq)
        return _Gathered.apply(local, self.group, self.cp, self.contexts[0], self._seq)

    def leave(self, module, args, output):
        """The head's output (or a headless model's) in sequence order."""
        if isinstance(output, torch.Tensor):
            return self.gather(output)
        output.last_hidden_state = self.gather(output.last_hidden_state)
        return output

    def keep_hidden(self, module, args, output) -> None:
        with torch.no_grad():
            self.on_hidden(self.gather(output.detach()))

    # -- attention ------------------------------------------------------------------------------------
    def _stage_exchanges(self, training: bool, stage: int) -> list[Exchange]:
        exchanges = self._exchanges[training]
        per = len(exchanges) // self.stages
        return exchanges[stage * per:(stage + 1) * per]

    def attend(self, site: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: Optional[float], dropout: float, window: Optional[int], stage: int = 0) -> torch.Tensor:
        """HF's attention for this process's rows: keys and values exchanged over each TP position's
        context group of the block's ``stage`` (``exchange``), then attention over every origin's keys
        (``attention``)."""
        R, C, P = self._local, len(self.contexts), self.cp
        N, kv_heads, L, d = key.shape
        B = N // (R * C)
        blocks = torch.stack([key, value], 1).view(R, C, B, 2, kv_heads, L, d).transpose(2, 3)
        shape = (2, B, kv_heads, L, d)
        held, lost = [], []
        for t, exchange in enumerate(self._stage_exchanges(self.training, stage)):
            got, missed = exchanged(exchange, site, blocks[t].reshape(C, -1))        # [C, P, n]
            held.append(got.view(C, P, *shape))
            if missed is not None and exchange.network.recovery.masks_keys:
                per_packet, _ = exchange.network.packets(got.shape[-1], got.dtype)
                lost.append(attention.lost_keys(missed, per_packet, shape))       # [C, P, B, kv, L]
        every = torch.stack(held)                                           # [R, C, P, 2, B, kv, L, d]

        def merged(i: int) -> torch.Tensor:   # [R, C, P, B, kv, L, d] -> [N, kv, P * L, d]
            return every[:, :, :, i].permute(0, 1, 3, 4, 2, 5, 6).reshape(N, kv_heads, P * L, d)
        valid, k_pos, q_pos = self._keys
        ok = attention.allowed(q_pos, k_pos, valid, window)                 # [C, B, L, P * L]
        ok = ok[None, :, :, None].expand(R, C, B, 1, L, P * L)
        if lost:
            gone = torch.stack(lost).permute(0, 1, 3, 4, 2, 5).reshape(R, C, B, kv_heads, 1, P * L)
            gone = gone.repeat_interleave(query.shape[1] // kv_heads, dim=3)
            ok = ok & ~gone
        ok = ok.reshape(N, ok.shape[3], L, P * L)
        return attention.attend(query, merged(0), merged(1), ok, scaling, dropout), None

    # -- the clock -------------------------------------------------------------------------------------
    def take_seconds(self) -> dict[str, list[float]]:
        """Per direction, [comm_s, comm_s_ideal_nic]: what the training exchanges since the last take
        added beside their attention (``clock.exposed``), the slowest TP position's per call site, every
        stage's summed (``take_stage_seconds``)."""
        stages = self.take_stage_seconds()
        out = {}
        for direction, per_stage in stages.items():
            total = per_stage[0]
            for more in per_stage[1:]:
                total = [total[k] + more[k] for k in (0, 1)]
            out[direction] = total
        return out

    def take_stage_seconds(self) -> dict[str, list[list[float]]]:
        """``take_seconds`` per pipeline stage: each stage's exchanges' (zeros where this process ran none)."""
        out = {}
        for direction in ("fwd", "bwd"):
            step = self.compute.seconds(clock.attention_step_flops(self._batch, self._padded, self.hidden,
                                                                   self.tp_size, self.cp, direction))
            out[direction] = []
            for stage in range(self.stages):
                per_position = [exchange.take_rounds(direction) for exchange in self._stage_exchanges(True, stage)]
                total = [0.0, 0.0]
                for calls in zip(*per_position):      # one call site's exchange at every TP position
                    for k in (0, 1):
                        total[k] += max(clock.exposed(self.mode, [r[k] for r in rounds], step) for rounds in calls)
                out[direction].append(total)
        return out


class _Gathered(torch.autograd.Function):
    """``dist``: every context rank's local rows (all-gathered, reliable) in sequence order; backward:
    this rank's share of the gradient."""

    @staticmethod
    def forward(ctx, local, group, cp, own, seq):
        ctx.cp, ctx.own, ctx.padded = cp, own, local.shape[1] * cp
        every = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(every, local.contiguous(), group=group)
        return layout.gather(torch.cat(every), cp, 1, seq)

    @staticmethod
    def backward(ctx, grad):
        whole = F.pad(grad, (0, 0) * (grad.dim() - 2) + (0, ctx.padded - grad.shape[1]))
        return layout.split(whole, ctx.cp, [ctx.own], 1).contiguous(), None, None, None, None


def _head(model: nn.Module, kind: str) -> nn.Module:
    """The module whose output is the model's per-token result: the LM head, the classifier, or (no head)
    the base model itself."""
    if kind == "lm":
        return model.get_output_embeddings()
    if kind == "cls":
        return model.score
    return model.base_model


def apply_cp(tp_model, config, mesh, rank: int = 0, replica: int = 0, groups: Optional[dict] = None,
             compute: Union[timing.Compute, timing.Measured, None] = None) -> Optional[ContextParallel]:
    """A run's context parallelism (torchtitan's ``apply_cp``, after ``apply_tp``): ``tp_model`` (replica
    ``replica``'s; ``sim``: every context rank, ``dist``: global ``rank``'s, ``groups`` its process groups)
    split over ``config.cp_size`` context ranks in ``config.cp_mode``, its exchanges timed with
    ``compute``. None when cp_size is 1."""
    if config.cp_size == 1:
        return None
    attention.register()
    model, plan, kind = tp_model.model, tp_model.plan, tp_model.kind
    settings, evaluation = config.network_settings(), config.network_settings(evaluation=True)
    lossy = config.lossy_directions("cp")
    distributed = groups is not None
    stages = range(mesh.pp)
    if distributed:   # (every stage's context group at this TP position: the others' mirror their owners')
        at = mesh.coordinates(rank)
        contexts, positions = [at["cp"]], [at["tp"]]

        def built(values: dict, r: int) -> Networks:
            return Networks([LossyNetwork(mesh.network_spec("cp", mesh.rank(dp=r, tp=at["tp"], pp=s), values,
                                                            lossy)) for s in stages], stages=mesh.pp)
        train, evaluated = built(settings, replica), built(evaluation, 0)
    else:
        contexts, positions = list(range(mesh.cp)), list(range(mesh.tp))

        def built(values: dict, r: int) -> Networks:
            return Networks([LossyNetwork(mesh.network_spec("cp", mesh.rank(dp=r, tp=t, pp=s), values, lossy))
                             for s in stages for t in positions],
                            [LossyNetwork(mesh.network_spec("tp", mesh.rank(dp=r, pp=s, cp=c), values))
                             for s in stages for c in contexts[1:]], stages=mesh.pp)
        train = built(settings, replica)
        evaluated = built(evaluation, 0) if replica == 0 else None
    _, hidden = cost.dims(model.config)
    context = ContextParallel(mesh.cp, config.cp_mode, contexts, positions, train, evaluated,
                              model.config.pad_token_id or 0, hidden, mesh.tp,
                              compute or timing.parse_compute(config.compute), groups["cp"][rank] if distributed else None)
    base = model.base_model
    base.register_forward_pre_hook(context.enter, with_kwargs=True)
    base.get_submodule(plan.final_norm).register_forward_hook(context.keep_hidden)
    _head(model, kind).register_forward_hook(context.leave)
    for i, block in enumerate(base.get_submodule(plan.blocks)):
        stage = at["pp"] if distributed else _stage_of(block, tp_model.groups)
        block.get_submodule(plan.attention).lossysim_context = attention.Site(f"{plan.blocks}.{i}.{plan.attention}.kv",
                                                                               context, stage)
    model.config._attn_implementation = attention.NAME

    def on_hidden(whole: torch.Tensor) -> None:
        tp_model.rank_hidden = whole.reshape(context._local, -1, *whole.shape[1:])
    context.on_hidden = on_hidden
    # The context ranks' gradients are summed in the data-parallel all-reduce over dp x cp (Megatron's;
    # lossysim.dp), through its lossy network, one replica's too.
    if not distributed:
        context.gradients = Gradients(mesh.cp)
        for stage, group in enumerate(tp_model.groups):
            ContextGroup.attach(group, context, stage)
    if distributed and mesh.tp > 1:
        context.tp_group = groups["tp"][rank]
    tp_model.context = context
    pipeline = getattr(tp_model, "pipeline", None)
    if pipeline is not None:   # dist: the other stages' context groups mirror their owners'
        pipeline.extras = {"train": [train.of_stage("cp", s) for s in stages],
                           "eval": [evaluated.of_stage("cp", s) for s in stages]}
    return context


def _stage_of(block: nn.Module, groups: list) -> int:
    """The pipeline stage whose TP group (``groups``, stage by stage) runs ``block`` (``sim``)."""
    for module in block.modules():
        group = getattr(module, "group", None)
        for stage, candidate in enumerate(groups):
            if group is candidate:
                return stage
    return 0
