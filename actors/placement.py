"""Where replicas run: one placement group per cluster, so a "cluster" in the config is
co-located hardware on a real Ray cluster (STRICT_PACK by default: all of a cluster's replicas
on one node, where the fast link is). `topology.cluster_labels` pins cluster c to nodes carrying
the Ray node label `hsgd-cluster=<label>` instead (`ray start --labels hsgd-cluster=rack-a`; the
actors ask for it with Ray's `label_selector` option). NCCL replicas ask for one GPU each.

`check_capacity` fails the job before any actor starts when the cluster can never place every
replica: too few CPUs/GPUs in total, no node (or set of nodes) that can hold a cluster as the
strategy requires, or no live node with a cluster's label.
"""
from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hsgd.config import ConfigError
from hsgd.config.capacity import describe_resources, placement_problem

LABEL_KEY = "hsgd-cluster"


class PlacementTimeout(RuntimeError):
    """The replicas could fit, but Ray did not place a cluster in time (resources busy)."""


def replica_resources(cfg: Any, backend: str) -> dict:
    res = {"CPU": float(cfg.topology.cpus_per_replica)}
    if backend == "nccl":
        res["GPU"] = 1.0
    return res


def _alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def check_capacity(cfg: Any, backend: str) -> None:
    """Fail before any actor starts if the cluster can never place every replica and hot spare
    (the decision: hsgd.config.capacity.placement_problem)."""
    t = cfg.topology
    problem = placement_problem(
        clusters=t.clusters, replicas_per_cluster=t.replicas_per_cluster,
        spares_per_cluster=int(t.get("spares_per_cluster", 0) or 0), need=replica_resources(cfg, backend),
        total=ray.cluster_resources(), nodes=_alive_nodes(), strategy=t.placement_strategy,
        cluster_labels=list(t.cluster_labels or []), label_key=LABEL_KEY)
    if problem is not None:
        raise ConfigError(*problem)


class ClusterPlacement:
    """Placement groups (or label selectors) for every cluster; `options(c, i)` for replica i of c."""

    def __init__(self, cfg: Any, backend: str, timeout_s: float):
        self.cfg, self.backend = cfg, backend
        self.groups = []
        strategy = cfg.topology.placement_strategy
        bundle = replica_resources(cfg, backend)
        if strategy == "NONE" or cfg.topology.cluster_labels or not any(v > 0 for v in bundle.values()):
            return  # (a placement group needs a non-empty bundle: 0 CPUs and no GPU is unplaced)
        for c in range(cfg.topology.clusters):
            slots = cfg.topology.replicas_per_cluster + int(cfg.topology.get("spares_per_cluster", 0) or 0)
            pg = placement_group([dict(bundle) for _ in range(slots)],  # replicas, then hot spares
                                 strategy=strategy, name=f"hsgd-cluster-{c}")
            self.groups.append(pg)
        refs = [pg.ready() for pg in self.groups]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(ready) < len(refs):
            pending = [f"c{c}" for c, ref in enumerate(refs) if ref not in ready]
            self.release()
            raise PlacementTimeout(
                f"clusters {pending} not placed after {timeout_s:g}s ({strategy}, {cfg.topology.replicas_per_cluster} "
                f"x {describe_resources(bundle)} each): the Ray cluster's resources are busy (other jobs?); free them, "
                f"or raise supervisor.quorum_wait_s")

    def options(self, cluster: int, index: int) -> dict:
        res = replica_resources(self.cfg, self.backend)
        opts: dict = {"num_cpus": res["CPU"], "num_gpus": res.get("GPU", 0)}
        if self.groups:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.groups[cluster], placement_group_bundle_index=index)
        elif self.cfg.topology.cluster_labels:
            opts["label_selector"] = {LABEL_KEY: str(self.cfg.topology.cluster_labels[cluster])}
        return opts

    def release(self) -> None:
        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 — the cluster may already be gone
                pass
        self.groups = []
