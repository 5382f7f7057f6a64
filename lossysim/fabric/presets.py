"""Fabrics users name: NVIDIA's DGX SuperPOD, a two-tier leaf-spine, or a YAML file of switches and cables.

``superpod:SU`` follows the SuperPOD reference architecture (B200 RA, "Larger DGX SuperPOD component
counts"; H100 alike): a scalable unit is 32 nodes x 8 rails, rail-optimized (node n's NIC r goes to its
SU's leaf for rail r), non-blocking (node-leaf, leaf-spine and spine-core cables each equal the GPU
count). Switches per SU count: 2 SU 16 leaf / 8 spine; 4: 32 / 16; 8: 64 / 32; 16: 128 / 128 / 64 core;
32: 256 / 256 / 128; 64: 512 / 512 / 256. The reference gives counts, not wiring; the wiring here is
the plainest that meets them, stated so a figure can be traced to it:

- two tiers (2-8 SU): every leaf reaches every spine, 32 / spines parallel cables each;
- three tiers (16-64 SU): the spines form 8 rail planes of SU spines; a leaf reaches min(SU, 32) spines
  of its rail's plane (at 64 SU, SUs alternate between the plane's two halves), 32 uplinks in all; spine
  j of a plane has 32 uplinks, one to each core of group ``j mod (cores / 32)``, so every core joins every
  plane and traffic between planes (or halves) turns at a core.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import yaml

from .graph import Fabric, nic

SUPERPOD_SU = (2, 4, 8, 16, 32, 64)
SU_NODES, SU_RAILS, LEAF_UPLINKS = 32, 8, 32
DEFAULT_GBPS = 400.0      # NDR InfiniBand / 400G RoCE: the H100 SuperPOD's NICs


def superpod(su: int, gbps: float = DEFAULT_GBPS) -> Fabric:
    if su not in SUPERPOD_SU:
        raise ValueError(f"superpod:{su} must be {', '.join(map(str, SUPERPOD_SU))} scalable units "
                         "(the SuperPOD reference's tables)")
    leaf = [[f"leaf{s * SU_RAILS + r}" for r in range(SU_RAILS)] for s in range(su)]
    links = [(nic(n, r), leaf[n // SU_NODES][r], gbps, 1) for n in range(su * SU_NODES) for r in range(SU_RAILS)]
    if su <= 8:
        spines = [f"spine{j}" for j in range(4 * su)]
        links += [(low, high, gbps, LEAF_UPLINKS // len(spines)) for row in leaf for low in row for high in spines]
        return Fabric(f"superpod:{su}", su * SU_NODES, SU_RAILS, [*sum(leaf, []), *spines], links)
    plane = [[f"spine{r * su + j}" for j in range(su)] for r in range(SU_RAILS)]
    reach = min(su, LEAF_UPLINKS)
    for s in range(su):
        block = (s % (su // reach)) * reach
        links += [(leaf[s][r], plane[r][block + j], gbps, LEAF_UPLINKS // reach)
                  for r in range(SU_RAILS) for j in range(reach)]
    cores = [f"core{c}" for c in range(4 * su)]
    groups = len(cores) // LEAF_UPLINKS
    links += [(plane[r][j], cores[(j % groups) * LEAF_UPLINKS + k], gbps, 1)
              for r in range(SU_RAILS) for j in range(su) for k in range(LEAF_UPLINKS)]
    return Fabric(f"superpod:{su}", su * SU_NODES, SU_RAILS, [*sum(leaf, []), *sum(plane, []), *cores], links)


def leaf_spine(nodes: int, rails: int = 1, leaves: Optional[int] = None, spines: int = 1,
               oversubscription: float = 1.0, gbps: float = DEFAULT_GBPS) -> Fabric:
    """Two tiers: ``leaves`` (default one per rail) in ``leaves / rails`` groups of consecutive nodes,
    rail-optimized (a group's leaf for rail r takes its nodes' NIC r); each leaf's uplinks (its nodes
    over ``oversubscription``) spread evenly over every spine."""
    leaves = rails if leaves is None else leaves
    for name, value in (("nodes", nodes), ("rails", rails), ("leaves", leaves), ("spines", spines)):
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise ValueError(f"leaf-spine {name}={value!r} must be a whole number >= 1")
    if leaves % rails or nodes % (leaves // rails):
        raise ValueError(f"leaf-spine leaves={leaves} must be a multiple of rails={rails} whose groups "
                         f"({leaves} / {rails}) divide nodes={nodes}")
    per_leaf = nodes // (leaves // rails)
    uplinks = per_leaf / oversubscription
    if oversubscription <= 0 or uplinks != int(uplinks) or int(uplinks) % spines:
        raise ValueError(f"leaf-spine: a leaf's {per_leaf} nodes over oversubscription={oversubscription} "
                         f"must be a whole multiple of spines={spines} uplinks")
    names = [f"leaf{g * rails + r}" for g in range(leaves // rails) for r in range(rails)]
    links = [(nic(n, r), names[(n // per_leaf) * rails + r], gbps, 1) for n in range(nodes) for r in range(rails)]
    tops = [f"spine{j}" for j in range(spines)]
    links += [(low, high, gbps, int(uplinks) // spines) for low in names for high in tops]
    text = f"leaf-spine:nodes={nodes},rails={rails},leaves={leaves},spines={spines}" + \
        (f",oversubscription={oversubscription:g}" if oversubscription != 1 else "")
    return Fabric(text, nodes, rails, [*names, *tops], links)


def load_fabric(path) -> Fabric:
    """A YAML file: ``nodes``, ``rails`` (default 1), ``gbps`` (default 400), ``switches`` (names, lowest
    tier first) and ``cables``: ``[a, b]``, ``[a, b, count]``, ``[a, b, count, gbps]`` or
    ``{a:, b:, count:, gbps:}``, each a physical cable (both directions)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"fabric file {path}: {str(error).splitlines()[0]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("cables"), list) or "nodes" not in data:
        raise ValueError(f"fabric file {path}: expected a mapping with nodes, switches and a list of cables")
    unknown = sorted(set(data) - {"name", "nodes", "rails", "gbps", "switches", "cables"})
    if unknown:
        raise ValueError(f"fabric file {path}: unknown key {unknown[0]!r} (nodes, rails, gbps, switches, cables)")
    speed = float(data.get("gbps", DEFAULT_GBPS))
    links = []
    for i, entry in enumerate(data["cables"]):
        if isinstance(entry, dict):
            entry = [entry.get("a"), entry.get("b"), entry.get("count", 1), entry.get("gbps", speed)]
        if not isinstance(entry, list) or not 2 <= len(entry) <= 4 or not all(isinstance(e, str) for e in entry[:2]):
            raise ValueError(f"fabric file {path}: cable {i} must be [a, b, count, gbps] or {{a, b, count, gbps}}")
        a, b, count, gbps = entry + [1, speed][len(entry) - 2:]
        if isinstance(count, bool) or not isinstance(count, int) or count < 1 or not float(gbps) > 0:
            raise ValueError(f"fabric file {path}: cable {i} ({a}-{b}) needs a count >= 1 and gbps > 0")
        links.append((a, b, float(gbps), count))
    try:
        return Fabric(str(data.get("name", path.name)), int(data["nodes"]), int(data.get("rails", 1)),
                      [str(s) for s in data.get("switches") or []], links)
    except (TypeError, ValueError) as error:
        raise ValueError(f"fabric file {path}: {error}") from None


def _keywords(text: str, allowed: tuple[str, ...], what: str) -> dict[str, float]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key.strip() not in allowed or not value:
            raise ValueError(f"{what}: {part!r} must be key=value with key one of {', '.join(allowed)}")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"{what}: {key.strip()}={value!r} is not a number") from None
    return out


def parse_fabric(text) -> Optional[Fabric]:
    """``none`` (no fabric: every rank pair its own link, as before), ``superpod:SU[,gbps=G]``,
    ``leaf-spine:nodes=N[,rails=R,leaves=L,spines=S,oversubscription=X,gbps=G]`` or a YAML file's path."""
    if isinstance(text, Fabric):
        return text
    text = "none" if text is None else str(text).strip()
    kind, _, args = text.partition(":")
    if kind.lower() in ("none", ""):
        return None
    if kind.lower() == "superpod":
        su, _, rest = args.partition(",")
        if not su.strip().isdigit():
            raise ValueError(f"fabric={text!r}: superpod:SU takes a number of scalable units, e.g. superpod:8")
        return superpod(int(su), **_keywords(rest, ("gbps",), f"fabric={text!r}"))
    if kind.lower() == "leaf-spine":
        given = _keywords(args, ("nodes", "rails", "leaves", "spines", "oversubscription", "gbps"), f"fabric={text!r}")
        if "nodes" not in given:
            raise ValueError(f"fabric={text!r}: leaf-spine needs nodes=N")
        whole = {k: int(v) if k not in ("oversubscription", "gbps") and v == int(v) else v for k, v in given.items()}
        return leaf_spine(**whole)
    if text.endswith((".yaml", ".yml")):
        return load_fabric(text)
    raise ValueError(f"fabric={text!r} must be none, superpod:SU, leaf-spine:nodes=N,... or a .yaml file")
