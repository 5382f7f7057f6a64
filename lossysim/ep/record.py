"""What a run records of its experts (``lossysim.ep.axis`` names this module): the all-to-alls' packets in
the metrics rows, summary.json's ``expert_parallel``, their traffic and collectives, the checkpoint state."""
from __future__ import annotations

from .axis import EP_CLASSES


def train_row(ep, state) -> dict:
    """Replica 0's expert all-to-alls (``ep_dispatch``, ``ep_combine``, both directions; every TP rank's
    group): packets sent and lost so far, and their loss rate over the lossy ones (``observed_loss_rate_ep``)."""
    row, sent_lossy, lost_lossy = {}, 0, 0
    for name, rows in ep.summaries().items():
        row[f"packets_sent_{name}"] = sum(r["sent"] for r in rows)
        row[f"packets_lost_{name}"] = sum(r["lost"] for r in rows)
        sent_lossy += sum(r["sent"] for r in rows if r["configured_loss_rate"] > 0)
        lost_lossy += sum(r["lost"] for r in rows if r["configured_loss_rate"] > 0)
    row["observed_loss_rate_ep"] = lost_lossy / sent_lossy if sent_lossy else 0.0
    return row


def summary(ep, config, state) -> dict:
    """summary.json's ``expert_parallel``: the layout, replica 0's all-to-alls per class by direction and link
    class, and their seconds per step."""
    return {"ep_size": config.ep_size, "edp_size": config.dp_size * config.cp_size // config.ep_size, **train_row(ep, state),
            "packets_by_class": ep.summaries(by=("direction", "link_class")),
            "ep_s_per_step": state.ep_s / max(state.step, 1)}


def traffic(ep) -> dict:
    """Each class's network (replica 0's first group's: its lossy directions) and replica 0's groups'
    summaries (dist: gathered over the TP group)."""
    found = ep.summaries()
    return {name: ([ep.groups[0].train[name]], [rows]) for name, rows in found.items()}


def collectives(ep) -> dict:
    """``ep_dispatch.tp{t}``, ``ep_combine.tp{t}``: replica 0's all-to-alls, TP position t's group (this
    process's alone on ``dist``); with pipeline stages each stage's, ``ep_dispatch.stage{s}.tp{t}``."""
    out: dict = {}
    stages = ep.replica_groups[0] if ep.replica_groups else {}
    for stage, groups in sorted(stages.items()):
        where = f".stage{stage}" if len(stages) > 1 else ""
        for t, group in enumerate(groups):
            for name, network in group.train.items():
                out.setdefault(name, []).append((f"{name}{where}.tp{t}", network))
    return out


def carriers(ep, every: bool = False) -> dict:
    """The networks summary.json's ``fabric`` counts the blast radius on: each class's, replica 0's first
    group's (``run.fabric_record``); ``every``: every group's, and every expert-data group's bucket networks
    (``expert_bucket``: the clocks shared cables stretch)."""
    if ep.mesh.ep <= 1:
        return {}
    groups = ep.groups if every else ep.groups[:1]
    out = {name: [g.train[name] for g in groups] for name in EP_CLASSES}
    if every:
        out["expert_bucket"] = [n for edp in ep.edp for n in edp.networks]
    return out


def save(parts):
    return parts.ep.state_dict() if parts.ep is not None else None


def load(parts, saved) -> None:
    if parts.ep is not None:
        parts.ep.load_state_dict(saved)
