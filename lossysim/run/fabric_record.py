"""summary.json's ``fabric``: the run's fabric settings and the blast radius of its lossy cables (which
ranks, groups and traffic classes cross each, and its share of each class's packets), counted off the
networks this process holds (replica 0's TP, pipeline, expert and context networks, every data-parallel
group's it holds: sim, all of them), as the estimate counts its groups (``estimate.blast``). The fabric is
no axis: ``run.summary`` adds this section beside the axes' own. ``slowdown``: each class's factor for the
flows its concurrent groups share cables with (``estimate.collisions``), which the estimate multiplies its
loss-free time by, and which training's clock multiplies each of those networks' loss-free seconds by
(``stretch_clocks``: replica 0's TP, pipeline, expert and context networks, every data-parallel one and
every expert-data-parallel group's, the experts' buckets', as the estimate stretches ``expert_bucket``)."""
from __future__ import annotations

from ..axes import AXES
from ..estimate import collisions
from ..estimate.blast import Blast


def fabric_summary(parts, config) -> dict:
    carriers = _carriers(parts, config)
    blast, sent = Blast(), {}
    for cls, networks in carriers.items():
        for net in networks:
            blast.add(cls, net, 1)
            sent[cls] = sent.get(cls, 0) + net.totals()["sent"]
    spec = parts.train_net.spec
    return {"fabric": spec.fabric, "bad_link": list(spec.bad_link), "corrupt_share": spec.corrupt_share,
            "routing": spec.routing, "qps_per_connection": spec.qps_per_connection, "pxn": spec.pxn,
            "lossy_cables": len(spec.cables.losses) if spec.cables is not None else 0,
            "blast_radius": blast.table(sent), "slowdown": collisions.summary(config)}


def stretch_clocks(parts, config) -> dict[str, float]:
    """Each class's networks' clocks set to multiply their loss-free seconds by the class's collision factor
    (``collisions.summary``), so training's step clock charges shared cables as the estimate does; the
    factors set (empty without a fabric or with ``shared_cables`` off: every clock as it was). The dense
    gradients' networks take the data-parallel flows' factor and the experts' buckets' (``expert_bucket``)
    the expert-data groups' (``edp``), each its own as the estimate's time keys do (the ``dp`` class's
    column is the larger of the two)."""
    flows = collisions.factors(config)
    if not flows:   # no fabric, or shared_cables off
        return {}
    by = {**collisions.summary(config), "expert_bucket": flows.get("edp", 1.0)}
    if config.dp_class in by:
        by[config.dp_class] = flows.get("dp", 1.0)
    networks = _carriers(parts, config, every=True)
    for cls, nets in networks.items():
        for net in nets:
            net.time.stretch = by.get(cls, 1.0)
    return {cls: by.get(cls, 1.0) for cls, nets in networks.items() if nets}


def _carriers(parts, config, every: bool = False) -> dict:
    """Each class's networks: those the blast radius counts, or with ``every`` each group's."""
    pipeline, dp = parts.pipeline, parts.dp
    carriers = {"tp": [parts.train_net] if pipeline is None else list(pipeline.networks),
                "pp": list(pipeline.boundary_networks()) if pipeline is not None else [],
                config.dp_class: list(dp.networks) if dp.grouped else []}
    for axis in AXES:   # every other axis's networks, from its ``record`` module's ``carriers`` (the order: none)
        part = getattr(parts, axis.part, None) if axis.part else None
        hooks = axis.hooks() if part is not None else None
        if hasattr(hooks, "carriers"):
            carriers.update(hooks.carriers(part, every=every))
    return carriers
