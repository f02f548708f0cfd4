"""Heal decisions ("max committed wins"): after any change, who copies state from whom. Pure.

A member behind its cluster's furthest (round, step) heals `full` (everything: params, inner
optimizer, global params, outer state, counters) from the furthest, so no completed step is thrown
away. A cluster with nobody at the top round heals `global` (global params, outer state, round: it
restarts the round, its inner progress is gone) from the lowest-id holder elsewhere. Sources are
chosen by (progress, replica id), never start order: the same reports give the same assignments.
"""
from __future__ import annotations

from dataclasses import dataclass

from hsgd.core.topology import parse_replica_id


@dataclass(frozen=True)
class HealAssignment:
    target: str
    source: str
    scope: str  # "full" | "global"


def assign_cluster_heals(members: dict[str, tuple[int, int]],
                         donors: dict[str, tuple[int, int]]) -> list[HealAssignment]:
    """The heals of one cluster. `members`: its live members' (round, step), in id order;
    `donors`: replicas of other clusters it may take the global state from when none of its own
    holds the top round (the top round of members and donors alike)."""
    if not members:
        return []
    top_round = max(p[0] for p in (*members.values(), *donors.values()))
    at_top = [rid for rid, p in members.items() if p[0] == top_round]
    if at_top:
        # furthest step first, then lowest id: a deterministic source
        source = min(at_top, key=lambda r: (-members[r][1], parse_replica_id(r)))
        return [HealAssignment(rid, source, "full") for rid, p in members.items() if p < members[source]]
    candidates = [rid for rid, p in donors.items() if p[0] == top_round and rid not in members]
    if not candidates:
        return []
    source = min(candidates, key=parse_replica_id)
    return [HealAssignment(rid, source, "global") for rid in members]
