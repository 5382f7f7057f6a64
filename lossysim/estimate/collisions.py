"""Shared cables in the loss-free time: on a fabric, the flows of one collective step that cross the same
cable share its bandwidth, so each traffic class's loss-free seconds are stretched by the load its
concurrent groups put on the most loaded cable they cross (``fabric.load.slowdown``: that cable's seconds
over the busiest NIC cable's, which is what the fabric-free network model charges). The repairs are kept
as simulated: a message's [with loss, loss-free] seconds (l, f) become (l + (x - 1) f, x f).

Concurrent means the groups of one axis that run the same collective at once across the job, every group
of the axis (all stages, replicas and TP positions): every DP (or FSDP) ring at once, every TP ring, every
context ring, every ep group's all-to-all, the experts' buckets over every expert-data group, and a
pipeline tick's sends over every boundary at once (activations one way, gradients the other, the slower
direction's factor). Each collective's flows are a ring's (each rank to its successor, in the group's order)
split over the spec's channels, or, where a group's all-reduce runs as a tree (``trees``: TP's, DDP's
buckets' and the experts' buckets' under ``algorithm=tree``, the buckets' where ``auto``'s NCCL pick is the
tree at ``dp_bucket_mb``), a tree's (``fabric.load.tree_flows``: NCCL's double binary tree of the group's
nodes, a chain within each); an all-to-all's every pair's, uniform. The routes
are the networks' own (the same hash seed, queue pairs, PXN and spraying as the cables' losses), so the
factor is this seed's draw, not a mean over hashes.

With no fabric ``factors`` is empty and nothing is touched: every figure as before.
"""
from __future__ import annotations

import functools
from typing import Optional

from .. import traffic
from ..fabric.load import all_to_all_flows, ring_flows, send_flows, slowdown, tree_flows

BYTES = 64 * 2**20   # a flow's bytes: the factor is a ratio, so they cancel but for a packet's rounding

# the time keys of data-parallel traffic (a class of axis dp times its messages under these) -> their flows
DP_KEYS = {"bucket": "dp", "gather": "dp", "expert_bucket": "edp"}
DP_FLOWS = {"dp": ("dp", "edp")}   # the experts' buckets are data-parallel traffic


def keys() -> dict[str, str]:
    """A time key of ``Job.run``'s step -> the flows whose factor stretches it: every class of another axis
    is timed under its own name, on its axis's flows."""
    return {**{c.name: c.axis for c in traffic.CLASSES if c.axis != "dp"}, **DP_KEYS}


def class_flows() -> dict[str, tuple[str, ...]]:
    """A traffic class's column -> the flows its time keys take (in the classes' order)."""
    return {c.name: DP_FLOWS.get(c.name, (c.axis,)) for c in traffic.CLASSES}


def factors(config) -> dict[str, float]:
    """Per flows (``tp``, ``pp``, ``cp``, ``dp``, ``ep``, ``edp``): the factor its loss-free seconds are
    multiplied by on ``config``'s fabric (1.0 where the axis has one rank); empty without a fabric or with
    ``shared_cables`` off (every flow its own link's bandwidth: the sensitivity to this assumption)."""
    spec = config.network_spec()
    if spec.cables is None or not config.shared_cables:
        return {}
    return dict(_factors(spec.cables.routes, config.mesh(), spec.cables.channels, trees(config)))


def trees(config) -> tuple[str, ...]:
    """The flows (``tp``, ``dp``, ``edp``) whose all-reduce runs as a tree: every one under ``algorithm=tree``
    (DDP's buckets: FSDP's gathers and reduce-scatters run on rings), and under ``auto`` the buckets' whose
    group NCCL's tuner (``net.transfer.choose``) runs as a tree at ``dp_bucket_mb``; none otherwise (the ring,
    the default, NVLS)."""
    ddp = ("dp", "edp") if config.dp_class == "dp" else ("edp",)
    if config.algorithm == "tree":
        return ("tp", *ddp)
    if config.algorithm != "auto":
        return ()
    from ..net.transfer import choose   # (the network stage's: imported where it is asked)
    mesh, settings = config.mesh(), config.network_settings()
    bucket = int(config.dp_bucket_mb * (1 << 20))
    out = []
    for name in ddp:
        if mesh.size(name) > 1:
            spec = mesh.network_spec(name, 0, settings, config.dp_lossy())
            if choose(spec, "all_reduce", bucket, spec.payload_bytes).algorithm == "tree":
                out.append(name)
    return tuple(out)


@functools.lru_cache(maxsize=32)   # a grid's rows share their layout and routes: worked out once
def _factors(routes, mesh, channels: int, tree_axes: tuple = ()) -> tuple:
    # every other axis's classes' flows over its groups (a ring's or an all-to-all's, ``TrafficClass.flows``;
    # a tree's where ``tree_axes`` names the axis)
    make = {"ring": ring_flows, "all_to_all": all_to_all_flows}

    def reduce(axis: str):   # an axis's all-reduce flows: a ring's, or NCCL's trees'
        return functools.partial(tree_flows, ranks_per_node=routes.per_node) if axis in tree_axes else ring_flows
    own = {c.axis: c.flows for c in traffic.CLASSES
           if c.axis not in ("dp", "pp") and c.axis in mesh.sizes and c.flows in make}
    flows = {axis: functools.partial(reduce(axis) if kind == "ring" else make[kind], mesh.groups(axis), BYTES,
                                     channels) for axis, kind in own.items()}
    sizes = {axis: mesh.size(axis) for axis in own}
    gradients = _dp_groups(mesh)
    flows.update(dp=lambda: reduce("dp")(gradients, BYTES, channels),
                 edp=lambda: reduce("edp")(mesh.groups("edp"), BYTES, channels))
    # without experts there are no expert-data groups (an expert group of 1: they would be the gradients' own)
    experts = len(mesh.group("edp", 0)) < len(gradients[0])
    sizes.update(dp=len(gradients[0]), edp=len(mesh.group("edp", 0)) if experts else 1)
    out = {name: slowdown(routes, make()) if sizes[name] > 1 else 1.0 for name, make in flows.items()}
    if mesh.pp > 1:
        ticks = [(g[s], g[s + 1]) for g in mesh.groups("pp") for s in range(len(g) - 1)]
        out["pp"] = max(slowdown(routes, send_flows(ticks, BYTES, channels)),
                        slowdown(routes, send_flows([(d, s) for s, d in ticks], BYTES, channels)))
    else:
        out["pp"] = 1.0
    return tuple(out.items())


def _dp_groups(mesh) -> list[list[int]]:
    """The gradients' groups (dp x cp, Megatron's data-parallel group with context parallelism)."""
    return [list(g) for g in dict.fromkeys(tuple(mesh.group("dp_cp", r)) for r in range(mesh.world))]


def stretched(times: dict, by: dict[str, float]) -> dict:
    """One step's ``Job.run`` times with every key's loss-free seconds multiplied by its flows' factor
    (``by``, from ``factors``) and its repairs kept; the keys a part of the job stretches itself
    (``Job.STRETCHED``: the context rounds, before their overlap with attention) not here. ``by`` empty:
    ``times`` itself."""
    if not by:
        return times
    from .job import Job   # which imports the parts, one of which imports this module
    own = Job.STRETCHED
    out = dict(times)
    for key, flows in keys().items():
        x = by.get(flows, 1.0)
        if key in out and key not in own and x != 1.0:
            out[key] = _stretch(out[key], x)
    return out


def _stretch(times, x: float):
    """``times`` (nested lists ending in [with loss, loss-free] pairs) with each pair (l, f) as
    (l + (x - 1) f, x f)."""
    if times is None:
        return None
    if len(times) == 2 and all(isinstance(t, (int, float)) for t in times):
        return [times[0] + (x - 1.0) * times[1], x * times[1]]
    return [_stretch(t, x) for t in times]


def stretch_rounds(rounds: list, x: Optional[float]) -> list:
    """A context exchange's rounds ([with loss, loss-free] seconds each) stretched as ``_stretch`` does."""
    return rounds if not x or x == 1.0 else [_stretch(r, x) for r in rounds]


def classes_of(config) -> tuple[str, ...]:
    """The job's traffic classes, as the estimate's job counts them (``Job.classes``): those whose axis has more
    than one rank, data-parallel traffic DDP's or FSDP's."""
    sizes = config.mesh().sizes
    return tuple(c.name for c in traffic.CLASSES if sizes[c.axis] > 1
                 and (c.axis != "dp" or c.name == config.dp_class))


def summary(config) -> dict:
    """summary.json's ``fabric`` ``slowdown``: each of the run's classes' factor on its fabric, as the estimate
    multiplies its loss-free time by it and training's clock its networks' (``run.fabric_record.stretch_clocks``)."""
    per = columns(factors(config), classes_of(config))
    return {cls: per[f"{cls}_fabric_slowdown"] for cls in classes_of(config)}


def columns(by: dict[str, float], classes) -> dict:
    """The row's columns on a fabric: ``<class>_fabric_slowdown`` for every class (1.0 without its traffic),
    the largest of its flows' factors, and ``fabric_slowdown``, the job's classes' in one line."""
    present = set(classes)
    per = {cls: max((by.get(f, 1.0) for f in flows), default=1.0) if cls in present else 1.0
           for cls, flows in class_flows().items()}
    line = ", ".join(f"{cls} {per[cls]:.3g}x" for cls in per if cls in present)
    return {"fabric_slowdown": line, **{f"{cls}_fabric_slowdown": per[cls] for cls in per}}
