"""What a run records of its data parallelism (``lossysim.dp.axis`` names this module): the metrics rows'
packets and drift, summary.json's ``data_parallel``, its traffic and collectives, its checkpoint state."""
from __future__ import annotations


def _traffic(dp) -> dict:
    """Data-parallel packets (DDP's gradient buckets; FSDP's gathers and reduce-scatters) sent and lost so
    far over every data-parallel group, and their loss rate."""
    sent = lost = 0
    for summary in dp.summaries():
        for entry in summary:
            sent, lost = sent + entry["sent"], lost + entry["lost"]
    return {"packets_sent_dp": sent, "packets_lost_dp": lost, "observed_loss_rate_dp": lost / sent if sent else 0.0}


def train_row(dp, state) -> dict:
    """A train row's data-parallel columns: traffic and the replicas' drift (kept in ``state``)."""
    drift = dp.drift()
    state.drift.append(drift)
    return {**_traffic(dp), "drift": drift}


def eval_row(dp) -> dict:
    """Replica 0 is evaluated; how far the others are from it."""
    return {"drift": dp.drift()}


def summary(dp, config, state) -> dict:
    """summary.json's ``data_parallel``: layout, buckets, traffic per link class, drift and time."""
    by_class: dict = {}
    for found in dp.summaries(by=("link_class",)):
        for entry in found:
            merged = by_class.setdefault(entry["link_class"], {"sent": 0, "lost": 0})
            merged["sent"] += entry["sent"]
            merged["lost"] += entry["lost"]
    for merged in by_class.values():
        merged["observed_loss_rate"] = merged["lost"] / merged["sent"] if merged["sent"] else 0.0
    return {"dp_size": config.dp_size, "tp_size": config.tp_size, "buckets": len(dp.buckets),
            "bucket_mb": config.dp_bucket_mb, "overlap": config.dp_overlap, "sync_every": config.dp_sync_every,
            "lossy_traffic": config.lossy_traffic, **_traffic(dp), "packets_by_class": by_class,
            **({"mode": config.dp_mode} if config.dp_mode != "ddp" else {}),
            "drift_final": dp.drift(), "drift_max": max(state.drift, default=0.0),
            "dp_s_per_step": state.dp_s / max(state.step, 1)}


def traffic(dp) -> dict:
    """summary.json's ``traffic``: the class (DDP's ``dp`` or FSDP's ``fsdp``), its networks and every
    data-parallel group's summaries."""
    return {"fsdp" if dp.fsdp else "dp": (dp.networks, dp.summaries())}


def collectives(dp) -> dict:
    """summary.json's ``collectives``: ``dp.tp{t}`` (TP position t's data-parallel group; this process's
    alone on ``dist``; ``dp.stage{s}.tp{t}`` with stages), ``fsdp.`` under FSDP."""
    kind = "fsdp" if dp.fsdp else "dp"
    return {kind: [(f"{kind}.tp{t}" if len(dp.stage_networks) == 1 else f"{kind}.stage{s}.tp{t}", n)
                   for s, stage in enumerate(dp.stage_networks) for t, n in enumerate(stage)]}


def save(parts):
    return parts.dp.state_dict() if parts.dp.grouped else None


def load(parts, saved) -> None:
    if parts.dp.grouped:
        parts.dp.load_state_dict(saved)
