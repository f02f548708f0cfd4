"""Who is who: sites (clusters), replica ids and the global replica index.

A cluster is a site: its replicas sync every step over the fast link. Sites may differ in size
(`topology.sites`, one entry per site) or all have `topology.replicas_per_cluster` replicas.
A replica id is `c<cluster>r<index>` (`c0r0`, `c1r1`).

The global replica index picks a replica's data and random streams. It comes from a table, never
from arithmetic on sizes: an id gets the next free index when it is first created, and keeps it
through restarts, heals, spare take-overs and resumes (the table lives in the supervisor's state
and every checkpoint manifest), so a site that grows or shrinks on a resume moves nobody else's
stream. A fresh table numbers the ids cluster by cluster (`c0r0` = 0, `c0r1` = 1, ...).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hsgd.config.schema import HsgdConfig

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


def assign_indices(ids: list[str], known: Mapping[str, int] | None = None) -> dict[str, int]:
    """The index table for `ids`: every id in `known` keeps its index (also one no longer in the
    topology, should it come back); a new id gets the next index after the largest ever given."""
    table = {sys.intern(str(rid)): int(i) for rid, i in (known or {}).items()}
    next_free = max(table.values(), default=-1) + 1
    for rid in ids:
        if rid not in table:
            table[rid], next_free = next_free, next_free + 1
    return table


@dataclass(frozen=True)
class Topology:
    """The sites and the index table: `Topology(clusters, replicas_per_cluster)`, or
    `Topology.of_sites(sizes)` where `replicas_per_cluster` is the largest site's size (`size(c)`)."""

    clusters: int
    replicas_per_cluster: int
    sizes: tuple[int, ...] = ()  # replicas per site; () = every site has replicas_per_cluster
    min_replicas: tuple[int | None, ...] = ()  # a site's own quorum floor (None: the run's)
    labels: tuple[str | None, ...] = ()  # Ray node label per site (None: anywhere)
    names: tuple[str | None, ...] = ()  # for the record only
    index_table: tuple[tuple[str, int], ...] = ()  # () = a fresh table (assign_indices)
    _index: dict = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        if not self.sizes:
            object.__setattr__(self, "sizes", (self.replicas_per_cluster,) * self.clusters)
        known = dict(self.index_table)
        table = assign_indices(self.replica_ids(), known)
        if table != known:
            object.__setattr__(self, "index_table", tuple(sorted(table.items(), key=lambda kv: kv[1])))
        object.__setattr__(self, "_index", table)

    @classmethod
    def of_sites(
        cls, sizes, *, min_replicas=(), labels=(), names=(), index_table: Mapping[str, int] | None = None
    ) -> Topology:
        sizes = tuple(int(n) for n in sizes)
        return cls(
            len(sizes),
            max(sizes, default=0),
            sizes,
            tuple(min_replicas),
            tuple(labels),
            tuple(names),
            tuple((index_table or {}).items()),
        )

    @property
    def num_replicas(self) -> int:
        return sum(self.sizes)

    @property
    def uniform(self) -> bool:
        return len(set(self.sizes)) <= 1

    def size(self, cluster: int) -> int:
        return self.sizes[cluster]

    def min_replicas_of(self, cluster: int, default: int) -> int:
        """Site `cluster`'s quorum floor: its own `min_replicas`, else the run's `default`."""
        own = self.min_replicas[cluster] if cluster < len(self.min_replicas) else None
        return default if own is None else int(own)

    def floor_field(self, cluster: int) -> str:
        """The config key that sets site `cluster`'s quorum floor (for messages)."""
        own = self.min_replicas[cluster] if cluster < len(self.min_replicas) else None
        return "supervisor.min_replicas_per_cluster" if own is None else f"topology.sites[{cluster}].min_replicas"

    def floors(self, default: int) -> list[int]:
        return [self.min_replicas_of(c, default) for c in range(self.clusters)]

    def label(self, cluster: int) -> str | None:
        return self.labels[cluster] if cluster < len(self.labels) else None

    def replica_ids(self) -> list[str]:
        return [replica_id(c, r) for c in range(self.clusters) for r in range(self.sizes[c])]

    def cluster_members(self, cluster: int) -> list[str]:
        return [replica_id(cluster, r) for r in range(self.sizes[cluster])]

    def global_index(self, rid: str) -> int:
        index = self._index.get(rid)
        if index is None:
            parse_replica_id(rid)  # a malformed id says so
            raise ValueError(f"{rid} is not a replica of this topology (sites of {list(self.sizes)})")
        return index

    def cluster_of(self, rid: str) -> int:
        return parse_replica_id(rid)[0]

    def with_site(self, replicas: int, *, label: str | None = None, name: str | None = None) -> Topology:
        """This topology with one more site, `c<clusters>`, of `replicas` replicas (a site joining a
        running run: hsgd/core/site_requests.py). Every id keeps its index; the new ids get the next
        free ones after the largest ever given (a drained site's ids keep theirs)."""

        def padded(values: tuple) -> tuple:
            return tuple(values) + (None,) * (self.clusters - len(values))

        return Topology.of_sites(
            (*self.sizes, int(replicas)),
            min_replicas=(*padded(self.min_replicas), None),
            labels=(*padded(self.labels), label),
            names=(*padded(self.names), name),
            index_table=dict(self.index_table),
        )

    def describe(self) -> dict:
        """The summary's `topology` field: the sites, their sizes, labels and names."""
        return {
            "sites": [
                {
                    "replicas": n,
                    "label": self.label(c),
                    "name": self.names[c] if c < len(self.names) else None,
                    "min_replicas": self.min_replicas[c] if c < len(self.min_replicas) else None,
                }
                for c, n in enumerate(self.sizes)
            ],
            "sizes": list(self.sizes),
            "replicas": self.num_replicas,
        }


def topology_of(cfg: HsgdConfig, index_table: Mapping[str, int] | None = None) -> Topology:
    """The run's topology from its config: `topology.sites` when set, else the uniform keys
    (`clusters` x `replicas_per_cluster`, `cluster_labels`). `index_table`: the table kept so far
    (the supervisor's state, a checkpoint's manifest) that the ids keep."""
    t = cfg.topology
    sites = list(getattr(t, "sites", None) or [])
    if sites:
        return Topology.of_sites(
            [s.replicas for s in sites],
            min_replicas=[s.min_replicas for s in sites],
            labels=[s.label for s in sites],
            names=[s.name for s in sites],
            index_table=index_table,
        )
    labels = tuple(str(x) for x in (t.cluster_labels or []))
    return Topology(
        int(t.clusters), int(t.replicas_per_cluster), labels=labels, index_table=tuple((index_table or {}).items())
    )
