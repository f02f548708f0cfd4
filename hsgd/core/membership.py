"""Membership views: a `Plan` says, for one epoch, the live members of every cluster in inner-rank
order, each cluster's leader (its outer rank: the cluster's position in `outer_clusters`), and
which clusters take part in outer sync. `live_plan` builds one with the round machine's rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hsgd.core.topology import Topology


@dataclass(frozen=True)
class Plan:
    epoch: int
    members: dict[int, tuple[str, ...]]  # cluster in quorum -> live replica ids in inner-rank order
    leaders: dict[int, str]  # cluster in quorum -> leader id

    @property
    def outer_clusters(self) -> tuple[int, ...]:
        """The clusters in quorum, in outer-rank order."""
        return tuple(sorted(self.members))

    @property
    def live(self) -> tuple[str, ...]:
        return tuple(rid for c in sorted(self.members) for rid in self.members[c])


def leader_of(members: tuple[str, ...], current: str | None) -> str:
    """The leader rule, the one place it is written: a cluster's leader is sticky — it stays while
    it is a live member — and a missing one is replaced by the first (lowest-index) live member.
    `members`: the cluster's live members in index order (never empty)."""
    return current if current in members else members[0]


def quorum_problem(counts: list[int], min_replicas_per_cluster: int | Sequence[int], min_clusters: int) -> str | None:
    """`counts`: live replicas per cluster, in cluster order; `min_replicas_per_cluster`: one floor for all, or each
    site's (Topology.floors). None when training may go on, else a one-line reason."""
    floors = (
        [min_replicas_per_cluster] * len(counts)
        if isinstance(min_replicas_per_cluster, int)
        else list(min_replicas_per_cluster)
    )
    in_quorum = sum(n >= floor for n, floor in zip(counts, floors, strict=True))
    if in_quorum >= min_clusters:
        return None
    listed = ", ".join(f"c{c}={n}" for c, n in enumerate(counts))
    needed = floors[0] if len(set(floors)) <= 1 else "its site's min_replicas"
    return f"only {in_quorum} cluster(s) with >= {needed} live replicas ({listed}); min_clusters={min_clusters}"


def live_plan(topology: Topology, live, leaders: dict[int, str], epoch: int, min_replicas_per_cluster: int = 1) -> Plan:
    """The plan of `live` replicas, leaders by leader_of (`leaders` is updated); a cluster below its
    quorum floor is left out (its replicas wait, then heal)."""
    members, chosen = {}, {}
    for cluster in range(topology.clusters):
        here = tuple(rid for rid in topology.cluster_members(cluster) if rid in live)
        if len(here) >= max(1, topology.min_replicas_of(cluster, min_replicas_per_cluster)):
            members[cluster] = here
            chosen[cluster] = leaders[cluster] = leader_of(here, leaders.get(cluster))
    return Plan(epoch=epoch, members=members, leaders=chosen)
