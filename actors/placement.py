"""Where replicas run: one placement group per cluster, so a "cluster" in the config is
co-located hardware on a real Ray cluster (STRICT_PACK by default: all of a cluster's replicas
on one node, where the fast link is). `topology.cluster_labels` pins cluster c to nodes carrying
the label `hsgd-cluster=<label>` instead. NCCL replicas ask for one GPU each.
"""
from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hsgd.config import ConfigError


def replica_resources(cfg: Any, backend: str) -> dict:
    res = {"CPU": float(cfg.topology.cpus_per_replica)}
    if backend == "nccl":
        res["GPU"] = 1.0
    return res


def check_capacity(cfg: Any, backend: str) -> None:
    """Fail before any actor starts if the cluster can never place every replica."""
    need = replica_resources(cfg, backend)
    n = cfg.topology.clusters * cfg.topology.replicas_per_cluster
    have = ray.cluster_resources()
    for key, amount in need.items():
        if amount * n > have.get(key, 0.0) + 1e-9:
            field = "topology.cpus_per_replica" if key == "CPU" else "comm.backend"
            raise ConfigError("topology.replicas_per_cluster",
                              f"{n} replicas need {amount * n:g} {key} but the Ray cluster has "
                              f"{have.get(key, 0.0):g}; use fewer replicas, lower {field}, or a bigger cluster")


class ClusterPlacement:
    """Placement groups (or label selectors) for every cluster; `options(c, i)` for replica i of c."""

    def __init__(self, cfg: Any, backend: str, timeout_s: float):
        self.cfg, self.backend = cfg, backend
        self.groups = []
        strategy = cfg.topology.placement_strategy
        if strategy == "NONE" or cfg.topology.cluster_labels:
            return
        bundle = replica_resources(cfg, backend)
        for c in range(cfg.topology.clusters):
            pg = placement_group([dict(bundle) for _ in range(cfg.topology.replicas_per_cluster)],
                                 strategy=strategy, name=f"hsgd-cluster-{c}")
            self.groups.append(pg)
        ready = ray.get([pg.ready() for pg in self.groups], timeout=timeout_s) if self.groups else []
        assert len(ready) == len(self.groups)

    def options(self, cluster: int, index: int) -> dict:
        res = replica_resources(self.cfg, self.backend)
        opts: dict = {"num_cpus": res["CPU"], "num_gpus": res.get("GPU", 0)}
        if self.groups:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.groups[cluster], placement_group_bundle_index=index)
        elif self.cfg.topology.cluster_labels:
            opts["label_selector"] = {"hsgd-cluster": str(self.cfg.topology.cluster_labels[cluster])}
        return opts

    def release(self) -> None:
        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 — the cluster may already be gone
                pass
        self.groups = []
