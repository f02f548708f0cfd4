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

LABEL_KEY = "hsgd-cluster"


class PlacementTimeout(RuntimeError):
    """The replicas could fit, but Ray did not place a cluster in time (resources busy)."""


def replica_resources(cfg: Any, backend: str) -> dict:
    res = {"CPU": float(cfg.topology.cpus_per_replica)}
    if backend == "nccl":
        res["GPU"] = 1.0
    return res


def _fits(node_resources: dict, need: dict) -> int:
    """How many replicas with resources `need` one node can hold at most."""
    counts = [int(node_resources.get(k, 0.0) / v + 1e-9) for k, v in need.items() if v > 0]
    return min(counts) if counts else 1 << 30


def _alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def _describe(need: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in need.items()) + "}"


def check_capacity(cfg: Any, backend: str) -> None:
    """Fail before any actor starts if the cluster can never place every replica."""
    need = replica_resources(cfg, backend)
    t = cfg.topology
    n = t.clusters * t.replicas_per_cluster
    have = ray.cluster_resources()
    for key, amount in need.items():
        if amount * n > have.get(key, 0.0) + 1e-9:
            field = "topology.cpus_per_replica" if key == "CPU" else "comm.backend"
            raise ConfigError("topology.replicas_per_cluster",
                              f"{n} replicas need {amount * n:g} {key} but the Ray cluster has "
                              f"{have.get(key, 0.0):g}; use fewer replicas, lower {field}, or a bigger cluster")
    nodes = _alive_nodes()
    k = t.replicas_per_cluster
    if t.cluster_labels:
        present = sorted({str(nd.get("Labels", {}).get(LABEL_KEY)) for nd in nodes if LABEL_KEY in nd.get("Labels", {})})
        for c, label in enumerate(t.cluster_labels):
            mine = [nd for nd in nodes if nd.get("Labels", {}).get(LABEL_KEY) == str(label)]
            if not mine:
                raise ConfigError(f"topology.cluster_labels[{c}]",
                                  f"no live Ray node has the label {LABEL_KEY}={label}; labelled nodes: "
                                  f"{present or 'none'} (start nodes with `ray start --labels {LABEL_KEY}={label}`)")
            room = sum(_fits(nd["Resources"], need) for nd in mine)
            shared = sum(1 for lab in t.cluster_labels if str(lab) == str(label))
            if room < k * shared:
                raise ConfigError(f"topology.cluster_labels[{c}]",
                                  f"nodes labelled {LABEL_KEY}={label} hold at most {room} replicas of "
                                  f"{_describe(need)}; cluster c{c} needs {k}" + (f" (x{shared} clusters share the label)" if shared > 1 else ""))
        return
    strategy = t.placement_strategy
    fits = sorted((_fits(nd["Resources"], need) for nd in nodes), reverse=True)
    if strategy == "STRICT_PACK":
        # every cluster on one node: greedily count how many whole clusters the nodes hold
        if sum(f // k for f in fits) < t.clusters:
            raise ConfigError("topology.placement_strategy",
                              f"STRICT_PACK needs each cluster's {k} replicas of {_describe(need)} on one node, "
                              f"but the nodes hold at most {fits[:8]} replicas each, room for {sum(f // k for f in fits)} "
                              f"of {t.clusters} clusters; use PACK, fewer replicas per cluster, or bigger nodes")
    elif strategy == "STRICT_SPREAD":
        if sum(1 for f in fits if f >= 1) < k:
            raise ConfigError("topology.placement_strategy",
                              f"STRICT_SPREAD needs {k} nodes per cluster that each fit one replica of "
                              f"{_describe(need)}; the Ray cluster has {sum(1 for f in fits if f >= 1)}")
    if sum(fits) < n:
        raise ConfigError("topology.replicas_per_cluster",
                          f"{n} replicas of {_describe(need)} do not fit on the nodes (at most {sum(fits)}: "
                          f"per node {fits[:8]}); use fewer replicas or a bigger cluster")


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
                f"x {_describe(bundle)} each): the Ray cluster's resources are busy (other jobs?); free them, "
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
