"""Heals ("max committed wins": who copies state from whom, in a round and at the run's end), and
between rounds: which round runs next, when a checkpoint is due, who evaluates and who writes the
final model, which rounds a restarted supervisor still owes the record."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hsgd.core.topology import Topology, parse_replica_id


@dataclass(frozen=True)
class HealAssignment:
    target: str
    source: str
    scope: str  # "full" | "global"


def assign_cluster_heals(
    members: dict[str, tuple[int, int]], donors: dict[str, tuple[int, int]]
) -> list[HealAssignment]:
    """The heals of one cluster, after any change. `members`: its live members' (round, step), in
    id order; `donors`: replicas of other clusters it may take the global state from.

    A member behind its cluster's furthest (round, step) heals `full` (everything: params, inner
    optimizer, global params, outer state, counters) from the furthest, so no completed step is
    thrown away. A cluster with nobody at the top round (of members and donors alike) heals `global`
    (global params, outer state, round: it restarts the round, its inner progress is gone) from the
    lowest-id holder elsewhere. Sources are chosen by (progress, replica id), never start order: the
    same reports give the same assignments."""
    if not members:
        return []
    top_round = max(p[0] for p in (*members.values(), *donors.values()))
    at_top = [rid for rid, p in members.items() if p[0] == top_round]
    if at_top:
        # furthest step first, then lowest id: a deterministic source
        source = min(at_top, key=lambda r: (-members[r][1], parse_replica_id(r)))
        return [HealAssignment(rid, source, "full") for rid, p in members.items() if p < members[source]]
    source = min(
        (rid for rid, p in donors.items() if p[0] == top_round and rid not in members),
        key=parse_replica_id,
        default=None,
    )
    return [] if source is None else [HealAssignment(rid, source, "global") for rid in members]


def current_round(progress: Iterable[tuple[int, int]]) -> int:
    """The round to run next: the furthest committed round any live replica holds."""
    return max((r for r, _ in progress), default=0)


def due(rounds_done: int, every: int, total_rounds: int) -> bool:
    """A checkpoint or evaluation after round rounds_done - 1 committed? Every `every` rounds, and
    after the last (every=0: the last only; checkpoint.every=0 means none: its caller checks)."""
    return bool(every) and rounds_done % every == 0 or rounds_done == total_rounds


def evaluation_order(topology: Topology, live: dict[str, tuple[int, int]], leaders: dict[int, str]) -> list[str]:
    """The replicas to ask for the eval loss, in turn until one answers: those at the furthest
    committed round first (a cluster that sat out may hold NaN params), leaders first among them,
    then by global index."""
    top = current_round(live.values())
    leading = set(leaders.values())
    return sorted(live, key=lambda rid: (live[rid][0] != top, rid not in leading, topology.global_index(rid)))


def model_writers(live: dict[str, tuple[int, int]]) -> list[str]:
    """The replicas that may write the final model, in turn: those at the furthest committed round, by id."""
    top = current_round(live.values())
    return sorted(rid for rid, (r, _) in live.items() if r == top)


def unrecorded_rounds(rounds_done: int, recorded: Iterable[int]) -> list[int]:
    """Committed rounds (below rounds_done) with no metrics record: a supervisor died between a
    commit and its record; its successor records them late."""
    return sorted(set(range(rounds_done)) - set(recorded))


def heals_at_rest(topology: Topology, live: dict[str, tuple[int, int]]) -> dict[int, list[HealAssignment]]:
    """Between rounds (the run's end): per cluster, the heals that bring every live member to the
    furthest committed round — inside the cluster when a member holds it, else from another
    cluster's donor (`global`), as at a round's start."""
    top = current_round(live.values())
    # the one donor any cluster would take (assign_cluster_heals picks the lowest id): one donor,
    # not all, keeps this O(replicas) at 10,000 replicas
    donor = min((rid for rid, p in live.items() if p[0] == top), key=parse_replica_id, default=None)
    donors = {donor: live[donor]} if donor is not None else {}  # (ignored by a cluster that holds the round)
    heals = {
        c: assign_cluster_heals({rid: live[rid] for rid in topology.cluster_members(c) if rid in live}, donors)
        for c in range(topology.clusters)
    }
    return {c: h for c, h in heals.items() if h}
