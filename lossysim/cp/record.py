"""What a run records of its context parallelism (``lossysim.cp.axis`` names this module): the key/value
exchanges' packets in the metrics rows, summary.json's ``context_parallel``, their traffic and collectives.
Its saved state is the model's own (``ContextParallel``'s networks ride in the checkpoint's model)."""
from __future__ import annotations

from ..net.stats import class_row


class _Summarised:
    """Another TP rank's context group as a row counts it: its summary and lossy directions."""

    def __init__(self, summary: list, lossy):
        self._summary, self.lossy = summary, lossy

    def summary(self) -> list:
        return self._summary


def _every_position(context, networks) -> list:
    """``networks`` as ``sim`` holds them: on ``dist`` with tp > 1, every TP position's (gathered over the
    TP group: a process runs its own position's context groups)."""
    if context.tp_group is None:
        return list(networks)
    import torch.distributed as dist
    every: list = [None] * dist.get_world_size(context.tp_group)
    dist.all_gather_object(every, [(n.summary(), n.lossy) for n in networks], group=context.tp_group)
    return [_Summarised(summary, lossy) for part in every for summary, lossy in part]


def train_row(context, state) -> dict:
    """The context groups' packets: keys and values (``cp_fwd``) and their gradients (``cp_bwd``) sent and
    lost so far, and the loss rate over their lossy directions (``observed_loss_rate_cp``), every TP
    position's."""
    return class_row("cp", _every_position(context, context.train_networks.cp))


def eval_row(context) -> dict:
    return class_row("cp", _every_position(context, context.eval_networks.cp))


def summary(context, config, state) -> dict:
    """summary.json's ``context_parallel``: the layout, what the exchanges added per step, and every
    context group's traffic per direction and link class."""
    return {"cp_size": config.cp_size, "cp_mode": config.cp_mode, "cp_s_per_step": state.cp_s / max(state.step, 1),
            **class_row("cp", _every_position(context, context.train_networks.cp)),
            "packets_by_group": [n.summary(by=("direction", "link_class")) for n in context.train_networks.cp]}


def traffic(context) -> dict:
    networks = context.train_networks.cp
    return {"cp": (networks, [n.summary() for n in networks])}


def carriers(context, every: bool = False) -> dict:
    """The networks summary.json's ``fabric`` counts the blast radius on (``run.fabric_record``); every
    context group's, so ``every`` changes nothing."""
    return {"cp": list(context.train_networks.cp)}


def collectives(context) -> dict:
    """``cp.tp{t}``: TP position t's context group."""
    return {"cp": [(f"cp.tp{t}", n) for t, n in zip(context.tp_positions, context.train_networks.cp)]}
