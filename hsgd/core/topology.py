"""Who is who: a replica id is `c<cluster>r<index>` (`c0r0`, `c1r1`); its global index,
`cluster * replicas_per_cluster + index`, drives data sharding and every random stream of the
replica and never changes when it restarts (a restarted replica reads the same data stream).
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass

_REPLICA_ID = re.compile(r"^c(\d+)r(\d+)$")


def replica_id(cluster: int, index: int) -> str:
    # interned: every holder of an id (roster, calls, the round machine's tables) shares one string
    # object, so a lookup in a 10,000-entry table matches by identity without reading the key
    return sys.intern(f"c{cluster}r{index}")


def parse_replica_id(rid: str) -> tuple[int, int]:
    """'c1r0' -> (1, 0). Raises ValueError for anything else."""
    match = _REPLICA_ID.fullmatch(str(rid))
    if not match:
        raise ValueError(f"not a replica id: {rid!r}; expected c<cluster>r<index>, e.g. c0r1")
    return int(match.group(1)), int(match.group(2))


@dataclass(frozen=True)
class Topology:
    clusters: int
    replicas_per_cluster: int

    @property
    def num_replicas(self) -> int:
        return self.clusters * self.replicas_per_cluster

    def replica_ids(self) -> list[str]:
        return [replica_id(c, r) for c in range(self.clusters) for r in range(self.replicas_per_cluster)]

    def cluster_members(self, cluster: int) -> list[str]:
        return [replica_id(cluster, r) for r in range(self.replicas_per_cluster)]

    def global_index(self, rid: str) -> int:
        cluster, index = parse_replica_id(rid)
        return cluster * self.replicas_per_cluster + index

    def cluster_of(self, rid: str) -> int:
        return parse_replica_id(rid)[0]
