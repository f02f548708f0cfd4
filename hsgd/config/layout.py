"""The run's layout, worked out once from the composed, checked config (`layout_of`) and handed down
typed: the sites (sizes, labels, names, quorum floors: a `Topology`), each site's pacing, ranks per
replica, steps per round, whether working params differ between clusters by design (streaming), and,
once the cluster is checked, the collective backend of each level. No reader works out again what it
holds. A resume's or a supervisor's own index table: `with_indices`; a site joined mid-run: the
topology it is given (`with_topology`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hsgd.config.rounds import is_streaming, steps_per_round
from hsgd.config.sites import ranks_per_replica, site_pacing
from hsgd.core.topology import Topology, topology_of

if TYPE_CHECKING:
    from hsgd.config.schema import HsgdConfig


@dataclass(frozen=True)
class BackendPlan:
    """What the driver hands each replica. `inner`: gloo | nccl | auto (left only when the replica
    gets a GPU of its own; resolved there). `outer`: gloo | nccl. `gpus_per_rank`: 0.0 or 1.0, the
    GPUs one rank actor asks Ray for (every rank of every replica and hot spare; a replica of
    topology.gpus_per_replica=k ranks asks k times that). `notice`: one console line (auto fell back to gloo)."""

    inner: str
    outer: str
    gpus_per_rank: float
    notice: str | None = None


@dataclass(frozen=True)
class RunLayout:
    topology: Topology
    ranks_per_replica: int  # rank processes per replica (topology.gpus_per_replica, one k for every site)
    steps_per_round: int  # inner steps between two outer syncs (sync.outer_every / sync.fragments)
    pacing: tuple[tuple[float, float, float], ...]  # per configured site: (min_step_s, straggle_p, straggle_factor)
    run_pacing: tuple[float, float, float]  # the run-wide train.* values: a site joined mid-run's
    streaming: bool  # fragments or a mixing weight: params agree within each cluster only
    backends: BackendPlan | None = None  # per level (inner, outer): set once the cluster is checked

    def with_indices(self, index_table: Mapping[str, int] | None) -> RunLayout:
        """The same layout with the ids keeping `index_table`'s indices (a resume's, a supervisor's state)."""
        return self.with_topology(replace(self.topology, index_table=tuple((index_table or {}).items())))

    def with_topology(self, topology: Topology) -> RunLayout:
        return replace(self, topology=topology)

    def with_backends(self, backends: BackendPlan) -> RunLayout:
        return replace(self, backends=backends)

    def expected_step_s(self, cluster: int) -> float | None:
        """The step time cluster `cluster` is configured to take (its min_step_s, stretched by its
        stragglers' expected extra), or None when none is set: sync.balance then learns it."""
        pacing = self.pacing[cluster] if cluster < len(self.pacing) else self.run_pacing
        min_step_s, straggle_p, straggle_factor = pacing
        return min_step_s * (1.0 + straggle_p * straggle_factor) if min_step_s > 0 else None


def layout_of(cfg: HsgdConfig, index_table: Mapping[str, int] | None = None) -> RunLayout:
    """The layout of a composed config (checked by hsgd.config.validate as far as the sites and ranks)."""
    topo, ranks = _sites_of(cfg, index_table)
    return RunLayout(
        topology=topo,
        ranks_per_replica=ranks,
        steps_per_round=steps_per_round(cfg),
        pacing=tuple(site_pacing(cfg, c) for c in range(topo.clusters)),
        run_pacing=site_pacing(cfg, len(cfg.topology.sites or [])),  # past the sites: train.*
        streaming=is_streaming(cfg),
    )


def _sites_of(cfg: HsgdConfig, index_table: Mapping[str, int] | None = None) -> tuple[Topology, int]:
    """(topology, ranks per replica) from the config's `topology` keys alone."""
    return topology_of(cfg, index_table), ranks_of(cfg, None)


def sites_and_ranks(cfg: HsgdConfig, layout: RunLayout | None) -> tuple[Topology, int]:
    """(topology, ranks per replica): the layout's, or, for a caller that holds only a config (a test,
    a notebook, a site joining: actors/placement.py), worked out from its `topology` keys alone."""
    return (layout.topology, layout.ranks_per_replica) if layout is not None else _sites_of(cfg)


def ranks_of(cfg: HsgdConfig, layout: RunLayout | None) -> int:
    """Ranks per replica: the layout's, or worked out from the config's `topology` keys alone."""
    return layout.ranks_per_replica if layout is not None else ranks_per_replica(cfg)
