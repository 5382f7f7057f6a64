"""The fabric's settings as one block: the config keys (``FABRIC_KEYS``, fields of ``ExperimentConfig`` and
``NetworkSpec`` alike), the flags ``train``, ``sweep`` and ``estimate`` take for them, and the check of a
fabric against the layout (docs/fabric.md)."""
from __future__ import annotations

import math

from ..fabric.events import REROUTE_S, LinkSchedule, load_link_events, parse_link_event
from ..fabric.place import ROUTINGS, fabric_of

# flag -> (config key, help, argparse action)
FABRIC_FLAGS = {
    "--fabric": ("fabric", "the fabric under the nodes: none (every rank pair its own link, as before), superpod:SU, "
                           "leaf-spine:nodes=N[,rails=R,leaves=L,spines=S,oversubscription=X] or a .yaml file", None),
    "--bad-link": ("bad_link", "a lossy cable and its loss, CABLE:LOSS, e.g. leaf3-spine1:bernoulli:1e-3 "
                               "(repeatable); with a fabric, --loss is every cable's", "append"),
    "--corrupt-share": ("corrupt_share", "a share of the fabric's cables lossy at CorrOpt's measured rates "
                                         "(Zhuo et al. 2017), drawn at the seed", None),
    "--qps-per-connection": ("qps_per_connection", "queue pairs per connection, each hashed apart "
                                                   "(NCCL_IB_QPS_PER_CONNECTION, default 1)", None),
    "--pxn": ("pxn", "true or false: NCCL's PXN moves cross-rail traffic over NVLink first (default true)", None),
    "--shared-cables": ("shared_cables", "true or false: flows of one collective step share a cable's bandwidth in "
                                         "the estimate's loss-free times (default true; false: each flow its own "
                                         "link's, as before the fabric's collisions were charged)", None),
    "--routing": ("routing", f"how flows take paths: {', '.join(ROUTINGS)} (spray: each packet its own path)", None),
    "--link-event": ("link_event", "a cable down, flapping or slowed in time: CABLE:down:at=T,for=D, "
                                   "CABLE:flap:at=T,period=P,down=D[,for=W], CABLE:speed:at=T,fraction=F[,for=D] "
                                   "or a .yaml list of them (repeatable)", "append"),
    "--reroute": ("reroute", f"how routes go around a dead switch cable: {', '.join(REROUTE_S)} (default ecmp: 1 s, "
                             "RFC 7938)", None),
    "--ib-timeout": ("ib_timeout", "NCCL_IB_TIMEOUT for a cable's outage (default 20: 34.4 s to give up; 18: 8.6 s)",
                     None),
    "--event-steps": ("event_steps", "estimate: the steps the job runs through its link events (default 1000)", None),
}
FABRIC_KEYS = tuple(key for key, _, _ in FABRIC_FLAGS.values())
CHOICES = {"--reroute": tuple(REROUTE_S)}   # refused by argparse, as --hours refused it before


def add_fabric_arguments(parser) -> None:
    group = parser.add_argument_group("fabric (docs/fabric.md)")
    for flag, (key, help_text, action) in FABRIC_FLAGS.items():
        group.add_argument(flag, dest=key, help=help_text, **({"action": action} if action else {}),
                           **({"choices": CHOICES[flag]} if flag in CHOICES else {}))


def fabric_overrides(args) -> dict:
    """The fabric keys the flags set (``--bad-link``'s and ``--link-event``'s entries joined by ``;``, as the
    config keeps them)."""
    out = {}
    for key in FABRIC_KEYS:
        value = getattr(args, key, None)
        if value is not None:
            out[key] = ";".join(value) if isinstance(value, list) else value
    return out


def link_events(text) -> list:
    """``link_event``'s entries (separated by ``;``; an entry ending in .yaml or .yml is a file of them)."""
    out = []
    for entry in (e.strip() for e in str(text or "").split(";")):
        if entry.lower().endswith((".yaml", ".yml")):
            out += load_link_events(entry)
        elif entry:
            out.append(parse_link_event(entry))
    return out


def event_schedule(config, run_s: float = math.nan) -> LinkSchedule:
    """The config's link events on its fabric over a run of ``run_s`` seconds; NaN (a run whose length is
    not known yet): every check but the run's end (a cable the fabric lacks, contradicting overlaps)."""
    events = link_events(config.link_event)
    fabric = fabric_of(str(config.fabric).strip())
    if math.isnan(run_s):
        run_s = 1.0 + max((e.at + (0.0 if math.isinf(e.duration) else e.duration) for e in events), default=0.0)
    return LinkSchedule(fabric, events, run_s)


def check_fabric(config) -> None:
    """A fabric must hold the layout's nodes and rails, and its link events name its cables and agree:
    a one-line ValueError naming the setting."""
    if config.reroute not in REROUTE_S:
        raise ValueError(f"reroute={config.reroute!r} must be one of {', '.join(REROUTE_S)}")
    if config.event_steps < 1:
        raise ValueError(f"event_steps={config.event_steps} must be >= 1")
    if not 0 <= config.ib_timeout <= 31:
        raise ValueError(f"ib_timeout={config.ib_timeout} must be 0 to 31 (NCCL_IB_TIMEOUT)")
    if str(config.fabric).strip().lower() in ("none", ""):
        if str(config.link_event or "").strip():
            raise ValueError("link_event needs a fabric: set fabric (superpod:SU, leaf-spine:nodes=N,..., or a .yaml file)")
        return
    fabric = fabric_of(str(config.fabric).strip())
    mesh = config.mesh()
    if mesh.nodes > fabric.nodes:
        raise ValueError(f"fabric={config.fabric} has {fabric.nodes} nodes; the layout {mesh.name} needs {mesh.nodes}")
    if mesh.per_node % fabric.rails and fabric.rails % mesh.per_node:
        raise ValueError(f"fabric={config.fabric} has {fabric.rails} NICs (rails) a node: ranks_per_node="
                         f"{mesh.per_node} must be a multiple or a divisor of it")
    event_schedule(config)


def training_refusal(config):
    """Why ``train`` refuses ``config`` (None if it does not): link events training does not run yet
    (``net.cable_events.refusal``), since a run that took them and did nothing with them would read as a
    fabric that never failed."""
    from ..axes import AXES
    from ..net.cable_events import refusal
    return refusal(config, tuple(axis.size for axis in AXES if not axis.link_events and axis.size))
