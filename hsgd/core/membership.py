"""Membership views: a `Plan` says, for one epoch, the live members of every cluster in a fixed
order (their inner ranks), each cluster's leader (its outer rank is the cluster's position in
`outer_clusters`), and which clusters take part in outer sync. The round machine
(hsgd/core/round.py) keeps the live view during a round and hands out Plans for fault targeting
and status; every process group is configured under a prefix that names level and epoch, so a
group of an old epoch can never be joined by mistake.

`Membership` builds a Plan from a set of live replicas with the same rules (sticky leaders, a dead
leader replaced by the lowest-index live replica, clusters below quorum on standby, nothing
depending on the order replicas started in); tools, tests and simulations use it where no round
machine runs.
"""
from __future__ import annotations

from dataclasses import dataclass

from hsgd.core.topology import Topology, parse_replica_id


@dataclass(frozen=True)
class Plan:
    epoch: int
    members: dict[int, tuple[str, ...]]  # cluster in quorum -> live replica ids in inner-rank order
    leaders: dict[int, str]  # cluster in quorum -> leader id
    outer_clusters: tuple[int, ...]  # clusters in quorum, in outer-rank order
    standby: tuple[str, ...] = ()  # live replicas of clusters below quorum: they wait, then heal

    @property
    def live(self) -> tuple[str, ...]:
        return tuple(rid for c in sorted(self.members) for rid in self.members[c])

    def inner_rank(self, rid: str) -> int:
        return self.members[parse_replica_id(rid)[0]].index(rid)

    def outer_rank(self, cluster: int) -> int:
        return self.outer_clusters.index(cluster)

    def is_leader(self, rid: str) -> bool:
        return self.leaders.get(parse_replica_id(rid)[0]) == rid

    def inner_prefix(self, cluster: int) -> str:
        return f"epoch{self.epoch}/inner/c{cluster}"

    def outer_prefix(self) -> str:
        return f"epoch{self.epoch}/outer"


def live_per_cluster(topology: Topology, live) -> list[int]:
    """How many of the `live` replica ids each cluster has, in cluster order (quorum_problem's
    `counts`); an id of no cluster of `topology` counts nowhere."""
    counts = [0] * topology.clusters
    for rid in live:
        cluster = topology.cluster_of(rid)
        if 0 <= cluster < topology.clusters:
            counts[cluster] += 1
    return counts


def quorum_problem(counts: list[int], min_replicas_per_cluster: int, min_clusters: int) -> str | None:
    """`counts`: live replicas per cluster. None when training may go on, else a one-line reason."""
    in_quorum = sum(n >= min_replicas_per_cluster for n in counts)
    if in_quorum >= min_clusters:
        return None
    listed = ", ".join(f"c{c}={n}" for c, n in enumerate(counts))
    return (f"only {in_quorum} cluster(s) with >= {min_replicas_per_cluster} live replicas ({listed}); "
            f"min_clusters={min_clusters}")


def live_plan(topology: Topology, live, leaders: dict[int, str], epoch: int,
              min_replicas_per_cluster: int = 1) -> Plan:
    """The plan of `live` replicas: members in index order, sticky leaders (a missing one replaced
    by the lowest-index member; `leaders` is updated), clusters below quorum on standby."""
    members, chosen, standby = {}, {}, []
    for cluster in range(topology.clusters):
        here = tuple(rid for rid in topology.cluster_members(cluster) if rid in live)
        if len(here) < max(1, min_replicas_per_cluster):
            standby.extend(here)
            continue
        members[cluster] = here
        if leaders.get(cluster) not in here:
            leaders[cluster] = here[0]
        chosen[cluster] = leaders[cluster]
    return Plan(epoch=epoch, members=members, leaders=chosen, outer_clusters=tuple(members), standby=tuple(standby))


class QuorumLost(RuntimeError):
    """Fewer clusters in quorum than `min_clusters`."""


class Membership:
    def __init__(self, topology: Topology, *, min_replicas_per_cluster: int = 1, min_clusters: int = 1,
                 epoch: int = 0):
        self.topology = topology
        self.min_replicas_per_cluster = min_replicas_per_cluster
        self.min_clusters = min_clusters
        self.live: set[str] = set()
        self.leaders: dict[int, str] = {}
        self.epoch = epoch
        self._changed = True

    def mark_alive(self, rid: str) -> bool:
        """Returns True if this changed membership."""
        if rid in self.live:
            return False
        self.live.add(rid)
        self._changed = True
        return True

    def mark_dead(self, rid: str) -> bool:
        if rid not in self.live:
            return False
        self.live.discard(rid)
        cluster = self.topology.cluster_of(rid)
        if self.leaders.get(cluster) == rid:
            del self.leaders[cluster]
        self._changed = True
        return True

    def force_new_epoch(self) -> None:
        """A collective failed: every group of the current epoch is unusable, even if nobody died."""
        self._changed = True

    def members_of(self, cluster: int) -> tuple[str, ...]:
        return tuple(rid for rid in self.topology.cluster_members(cluster) if rid in self.live)

    def clusters_in_quorum(self) -> tuple[int, ...]:
        return tuple(c for c in range(self.topology.clusters)
                     if len(self.members_of(c)) >= self.min_replicas_per_cluster)

    def quorum_problem(self) -> str | None:
        """None when training may go on, else a one-line reason."""
        return quorum_problem([len(self.members_of(c)) for c in range(self.topology.clusters)],
                              self.min_replicas_per_cluster, self.min_clusters)

    def plan(self) -> Plan:
        """The plan for the current membership; bumps the epoch if membership changed."""
        if self._changed:
            self.epoch += 1
            self._changed = False
        return live_plan(self.topology, self.live, self.leaders, self.epoch, self.min_replicas_per_cluster)
