"""The blast radius of a fabric's lossy cables: for each, which ranks, groups and traffic classes cross it
and what share of each class's packets it carries (the estimate's ``blast_radius`` column and
``blast_radius`` in estimate.json). Counted off the networks an estimate simulated, from each link's packets
sent and the share of them whose routes cross the cable (``fabric.place.Placement.crosses``): on a fabric
every group that crosses a lossy cable is simulated, or (a uniform fabric's alike groups, sampled) each is
counted on its own cables with a simulated group's packets, so nothing is missed."""
from __future__ import annotations

from collections import defaultdict


class Blast:
    """Per lossy cable: the global ranks whose links cross it, the groups (class, first rank), and each
    class's packets on it."""

    def __init__(self):
        self.cables: dict[str, dict] = {}

    def add(self, cls: str, net, copies: float, place=None) -> None:
        """``net``'s packets, each link's on ``place``'s cables (default: its own; another group's alike)."""
        place = net.spec.cables if place is None else place
        if place is None or not place.losses:
            return
        sent = defaultdict(int)
        for row in net.channels.rows(net.topology.link_class):
            sent[row["src"], row["dst"]] += row["sent"]
        for (src, dst), count in sent.items():
            for cable, share in place.crosses(src, dst).items():
                entry = self.cables.setdefault(place.name(cable), {
                    "loss": place.model(cable).spec, "ranks": set(), "groups": set(), "packets": defaultdict(float)})
                entry["ranks"].update((place.ranks[src], place.ranks[dst]))
                entry["groups"].add((cls, place.ranks[0]))
                entry["packets"][cls] += count * share * copies

    def table(self, sent: dict) -> list[dict]:
        """One record per lossy cable crossed, ``sent``: each class's packets in all (the same steps)."""
        out = []
        for name, entry in sorted(self.cables.items()):
            ranks = sorted(entry["ranks"])
            groups = defaultdict(int)
            for cls, _ in sorted(entry["groups"]):   # sorted: a set's order differs between processes
                groups[cls] += 1
            out.append({"cable": name, "loss": entry["loss"], "ranks": len(ranks), "ranks_first": ranks[:16],
                        "groups": dict(groups),
                        "share": {cls: packets / sent[cls] if sent.get(cls) else 0.0
                                  for cls, packets in sorted(entry["packets"].items())}})
        return out


def describe(table: list[dict], most: int = 4) -> str:
    """The column: ``leaf3-spine1 (bernoulli:0.001): 16 ranks; dp 2 groups 0.39% of its packets; ...``."""
    parts = []
    for entry in table[:most]:
        classes = "; ".join(f"{cls} {entry['groups'].get(cls, 0)} group{'s' * (entry['groups'].get(cls, 0) != 1)} "
                            f"{100 * share:.3g}%" for cls, share in entry["share"].items())
        parts.append(f"{entry['cable']} ({entry['loss']}): {entry['ranks']} ranks; {classes}")
    more = f" (+{len(table) - most} cables)" if len(table) > most else ""
    return " | ".join(parts) + more
