"""The refusals of traces that are not one job's (``estimate.trace``): ranks whose distributedInfo, or
whose calls, disagree."""
from __future__ import annotations

from collections import Counter

from .trace_events import RankTrace


def one_job(path, ranks: dict) -> bool:
    """Refuse ``ranks`` (rank -> RankTrace, read from ``path``) that are not one whole job's traces, in the
    order a user fixes them: an empty trace, two jobs' distributedInfo, ranks missing, no call understood,
    two jobs' calls, a mirrored pipeline. Whether the one trace given stands for its peers (mirrored)."""
    first = next(iter(ranks.values()))
    empty = [r.path for r in ranks.values() if not r.steps]
    if empty:
        raise ValueError(f"{empty[0]}: the trace holds no events: profile at least one step")
    for r in ranks.values():
        _same_job(first, r)
    mirrored = len(ranks) == 1 and first.world > 1
    if not mirrored and len(ranks) != first.world:
        missing = sorted(set(range(first.world)) - set(ranks))
        raise ValueError(f"--trace {path}: ranks {_span(missing)} of {first.world} have no trace: give every "
                         "rank's, or one file whose peers mirror it")
    if not any(step for r in ranks.values() for step in r.calls):
        unknown = sum((r.unknown for r in ranks.values()), Counter())
        raise ValueError(f"--trace {path}: not one communication call understood, nothing to estimate (not "
                         f"understood: {_counted(unknown) or 'none, the trace holds no communication events'})")
    _same_calls(ranks, first.groups)
    if mirrored and any(c.kind in ("send", "recv") for step in first.calls for c in step):
        raise ValueError(f"{first.path}: one rank's trace with sends and receives: a pipeline's ranks differ, "
                         "give every rank's trace (a folder)")
    return mirrored


def _same_job(first: RankTrace, r: RankTrace) -> None:
    """Refuse two ranks' traces whose distributedInfo is not one job's: its world, backend, process groups."""
    names = sorted(set(first.groups) | set(r.groups))
    group = next((n for n in names if first.groups.get(n) != r.groups.get(n)), None)
    for what, mine, theirs in (("world_size", r.world, first.world), ("backend", r.backend, first.backend),
                               (f"process group {group}'s ranks", r.groups.get(group), first.groups.get(group))):
        if mine != theirs:
            raise ValueError(f"{r.path} and {first.path} are not one job's traces: {what} {mine} against "
                             f"{theirs}: give the traces of one job")


def _same_calls(ranks: dict, groups: dict) -> None:
    """Refuse ranks whose calls are not one job's: the members of a group make the same collectives on it,
    and a send's peer receives from its sender (and a receive's peer sends). The kinds of call, not their
    counts: a call the profiler's window cut off at one rank is no disagreement. Traces of two jobs on the
    same world and groups (one's all-reduces, the other's sends) differ here."""
    kinds, p2p = Counter(), Counter()
    for r in ranks.values():
        for call in (c for step in r.calls for c in step):
            if call.kind in ("send", "recv"):
                p2p[r.rank, call.kind, call.peer] += 1
            else:
                kinds[r.rank, call.group, call.kind] += 1
    for name, members in groups.items():
        traced = [m for m in members if m in ranks]
        mine = {m: sorted(k for (r, g, k) in kinds if (r, g) == (m, name)) for m in traced}
        for m in traced[1:]:
            if mine[m] != mine[traced[0]]:
                raise ValueError(f"{ranks[m].path} and {ranks[traced[0]].path} are not one job's traces: on "
                                 f"process group {name} rank {m} makes {', '.join(mine[m]) or 'no collective'}, rank "
                                 f"{traced[0]} {', '.join(mine[traced[0]]) or 'none'}: give the traces of one job")
    for rank, kind, peer in sorted(p2p):
        mirror = "recv" if kind == "send" else "send"
        if peer in ranks and (peer, mirror, rank) not in p2p:
            does, never = ("sends to", "receives from") if kind == "send" else ("receives from", "sends to")
            raise ValueError(f"{ranks[rank].path} and {ranks[peer].path} are not one job's traces: rank {rank} "
                             f"{does} rank {peer}, which never {never} it: give the traces of one job")


def _counted(unknown: Counter) -> str:
    return "; ".join(f"{name} x{n}" for name, n in unknown.most_common(3)) + ("; ..." if len(unknown) > 3 else "")


def _span(ranks: list) -> str:
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
