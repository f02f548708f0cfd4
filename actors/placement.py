"""Where replicas run: one placement group per cluster (STRICT_PACK by default: one node, where
the fast link is), or Ray's `label_selector` on the node label `hsgd-cluster=<label>`. A replica asks
for a GPU of its own exactly when a level of it may use nccl ("Duplicate GPU detected" otherwise).
`check_cluster` runs before any actor starts: hsgd.config.capacity's refusals, and data.path missing
on a node that may run replicas, each a one-line ConfigError.
"""
from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from hsgd.config import ConfigError
from hsgd.config.capacity import (LABEL_KEY, BackendPlan, data_path_problem, describe_resources, placement_problem,
                                  plan_backends, replicas_that_fit)
from hsgd.core.topology import topology_of


class PlacementTimeout(RuntimeError):
    """The replicas could fit, but Ray did not place a cluster in time (resources busy)."""


def replica_resources(cfg: Any, gpus: float) -> dict:
    """One replica's resources: its CPUs and, when a level of it may use nccl, a GPU of its own."""
    return {"CPU": float(cfg.topology.cpus_per_replica), **({"GPU": float(gpus)} if gpus else {})}


def check_cluster(cfg: Any, data_timeout_s: float) -> tuple[BackendPlan, list[str]]:
    """The backend plan for this Ray cluster (hsgd.config.capacity) and the nodes silent on the data.path check."""
    nodes = [nd for nd in ray.nodes() if nd.get("Alive")]
    plan = plan_backends(cfg, nodes)
    need = replica_resources(cfg, plan.gpus_per_replica)
    problem = placement_problem(cfg, need, nodes)
    if problem is not None:
        raise ConfigError(*problem)
    return plan, _check_data_path(cfg, need, nodes, data_timeout_s)


@ray.remote(num_cpus=0, max_retries=0)
def _path_here(path: str) -> tuple[bool, str]:
    """Run on one node, in the job's working directory as the replicas are: does `path` exist?"""
    return os.path.exists(os.path.expanduser(path)), socket.gethostname()


def _check_data_path(cfg: Any, need: dict, alive: list[dict], timeout_s: float) -> list[str]:
    """Refuse (ConfigError) when data.path does not exist on a node that may run replicas, asking each
    with a tiny pinned task. A node that does not answer within `timeout_s` is not refused; returns their names."""
    path = cfg.data.path
    if path is None:
        return []
    site_labels = topology_of(cfg).labels
    labels = {str(x) for x in site_labels if x is not None}
    anywhere = not labels or None in site_labels  # a site without a label may land on any node
    nodes = [nd for nd in alive if replicas_that_fit(nd.get("Resources", {}), need) >= 1  # room for one
             and (anywhere or str(nd.get("Labels", {}).get(LABEL_KEY)) in labels)]  # a cluster's label, if pinned
    refs = {nd["NodeID"]: _path_here.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_id=nd["NodeID"], soft=False)).remote(str(path)) for nd in nodes}
    names = {nd["NodeID"]: f"{nd.get('NodeManagerAddress', '?')} ({nd['NodeID'][:8]})" for nd in nodes}
    ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    answers: dict = {}
    for node_id, ref in refs.items():
        try:
            exists, host = ray.get(ref, timeout=0.1)
            answers[f"{host} {names[node_id]}"] = exists
        except Exception:  # noqa: BLE001 — no answer in time (busy or dying node): not a refusal
            ray.cancel(ref, force=True)
            answers[names[node_id]] = None
    problem = data_path_problem(str(path), answers)
    if problem is not None:
        raise ConfigError("data.path", problem)
    return sorted(name for name, exists in answers.items() if exists is None)


class ClusterPlacement:
    """Placement groups (or label selectors) for every cluster; `options(c, i)` for replica i of c."""

    def __init__(self, cfg: Any, gpus: float, timeout_s: float):
        self.groups = []
        strategy = cfg.topology.placement_strategy
        self.bundle = bundle = replica_resources(cfg, gpus)
        self.topology = topo = topology_of(cfg)
        if strategy == "NONE" or any(topo.labels) or not any(v > 0 for v in bundle.values()):
            return  # (a placement group needs a non-empty bundle: 0 CPUs and no GPU is unplaced)
        spares = cfg.topology.spares_per_cluster
        self.groups = [placement_group([dict(bundle) for _ in range(topo.size(c) + spares)],  # replicas, then hot spares
                                       strategy=strategy, name=f"hsgd-cluster-{c}")
                       for c in range(topo.clusters)]
        refs = [pg.ready() for pg in self.groups]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(ready) < len(refs):
            pending = [f"c{c}" for c, ref in enumerate(refs) if ref not in ready]
            self.release()
            raise PlacementTimeout(
                f"clusters {pending} not placed after {timeout_s:g}s ({strategy}, up to {topo.replicas_per_cluster} "
                f"x {describe_resources(bundle)} each): the Ray cluster's resources are busy (other jobs?); free them, "
                f"or raise supervisor.quorum_wait_s")

    def options(self, cluster: int, index: int) -> dict:
        opts: dict = {"num_cpus": self.bundle["CPU"], "num_gpus": self.bundle.get("GPU", 0)}
        if self.groups:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.groups[cluster], placement_group_bundle_index=index)
        elif self.topology.label(cluster) is not None:
            opts["label_selector"] = {LABEL_KEY: str(self.topology.label(cluster))}
        return opts

    def release(self) -> None:
        for pg in self.groups:
            with contextlib.suppress(Exception):  # the cluster may already be gone
                remove_placement_group(pg)
        self.groups = []
