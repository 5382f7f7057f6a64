"""The fabric's settings as one block: the config keys (``FABRIC_KEYS``, fields of ``ExperimentConfig`` and
``NetworkSpec`` alike), the flags ``train``, ``sweep`` and ``estimate`` take for them, and the check of a
fabric against the layout (docs/fabric.md)."""
from __future__ import annotations

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
    "--routing": ("routing", f"how flows take paths: {', '.join(ROUTINGS)} (spray: each packet its own path)", None),
}
FABRIC_KEYS = tuple(key for key, _, _ in FABRIC_FLAGS.values())


def add_fabric_arguments(parser) -> None:
    group = parser.add_argument_group("fabric (docs/fabric.md)")
    for flag, (key, help_text, action) in FABRIC_FLAGS.items():
        group.add_argument(flag, dest=key, help=help_text, **({"action": action} if action else {}))


def fabric_overrides(args) -> dict:
    """The fabric keys the flags set (``--bad-link``'s entries joined by ``;``, as the config keeps them)."""
    out = {}
    for key in FABRIC_KEYS:
        value = getattr(args, key, None)
        if value is not None:
            out[key] = ";".join(value) if isinstance(value, list) else value
    return out


def check_fabric(config) -> None:
    """A fabric must hold the layout's nodes and rails: a one-line ValueError naming the setting."""
    if str(config.fabric).strip().lower() in ("none", ""):
        return
    fabric = fabric_of(str(config.fabric).strip())
    mesh = config.mesh()
    if mesh.nodes > fabric.nodes:
        raise ValueError(f"fabric={config.fabric} has {fabric.nodes} nodes; the layout {mesh.name} needs {mesh.nodes}")
    if mesh.per_node % fabric.rails and fabric.rails % mesh.per_node:
        raise ValueError(f"fabric={config.fabric} has {fabric.rails} NICs (rails) a node: ranks_per_node="
                         f"{mesh.per_node} must be a multiple or a divisor of it")
