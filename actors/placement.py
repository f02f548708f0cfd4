"""Where replicas run: one placement group per cluster, so a "cluster" in the config is
co-located hardware on a real Ray cluster (STRICT_PACK by default: all of a cluster's replicas
on one node, where the fast link is). `topology.cluster_labels` pins cluster c to nodes carrying
the Ray node label `hsgd-cluster=<label>` instead (`ray start --labels hsgd-cluster=rack-a`; the
actors ask for it with Ray's `label_selector` option). A replica asks for one GPU exactly when
a level of it may use nccl (`plan_backends`: decided from the cluster's resources, not from the
driver's CUDA), so NCCL ranks never share a GPU.

Checked right after connecting to Ray and before any actor starts (each a ConfigError, one line):
- `plan_backends`: the per-level backends and GPUs per replica (nccl asked where the cluster has
  too few GPUs, per node as the strategy places them);
- `check_capacity`: the cluster can never place every replica: too few CPUs/GPUs in total, no
  node (or set of nodes) that can hold a cluster as the strategy requires, or no live node with a
  cluster's label;
- `check_data_path`: data.path missing on a node that may run replicas (one tiny task per node).
"""
from __future__ import annotations

import os
import socket
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from hsgd.config import ConfigError
from hsgd.config.capacity import (BackendPlan, data_path_problem, describe_resources, placement_problem,
                                  replicas_that_fit)
from hsgd.config.capacity import plan_backends as _plan_backends
from hsgd.core.topology import topology_of

LABEL_KEY = "hsgd-cluster"


class PlacementTimeout(RuntimeError):
    """The replicas could fit, but Ray did not place a cluster in time (resources busy)."""


def replica_resources(cfg: Any, gpus: float) -> dict:
    """One replica's resources: its CPUs and, when a level of it may use nccl, a GPU of its own."""
    res = {"CPU": float(cfg.topology.cpus_per_replica)}
    if gpus:
        res["GPU"] = float(gpus)
    return res


def _alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def _placement_args(cfg: Any) -> dict:
    t, topo = cfg.topology, topology_of(cfg)
    return dict(clusters=topo.clusters, replicas_per_cluster=topo.replicas_per_cluster,
                sizes=None if not t.sites else list(topo.sizes),
                spares_per_cluster=t.spares_per_cluster, total=ray.cluster_resources(),
                nodes=_alive_nodes(), strategy=t.placement_strategy, cluster_labels=list(topo.labels),
                label_key=LABEL_KEY)


def plan_backends(cfg: Any) -> BackendPlan:
    """The per-level backends and GPUs per replica on this Ray cluster (the decision:
    hsgd.config.capacity.plan_backends). Raises ConfigError (nccl where GPUs are too few)."""
    c = cfg.comm
    return _plan_backends(backend=c.backend, inner_backend=c.inner_backend, outer_backend=c.outer_backend,
                          cpus_per_replica=float(cfg.topology.cpus_per_replica), **_placement_args(cfg))


def check_capacity(cfg: Any, gpus: float) -> None:
    """Fail before any actor starts if the cluster can never place every replica and hot spare
    (the decision: hsgd.config.capacity.placement_problem)."""
    problem = placement_problem(need=replica_resources(cfg, gpus), **_placement_args(cfg))
    if problem is not None:
        raise ConfigError(*problem)


@ray.remote(num_cpus=0, max_retries=0)
def _path_here(path: str) -> tuple[bool, str]:
    """Run on one node, in the job's working directory as the replicas are: does `path` exist?"""
    return os.path.exists(os.path.expanduser(path)), socket.gethostname()


def _replica_nodes(cfg: Any, gpus: float) -> list[dict]:
    """The live nodes that may run a replica: room for one, and the label of a cluster if labels pin them."""
    need = replica_resources(cfg, gpus)
    topo = topology_of(cfg)
    labels = {str(x) for x in topo.labels}
    anywhere = not labels or None in topo.labels  # a site without a label may land on any node
    return [nd for nd in _alive_nodes() if replicas_that_fit(nd.get("Resources", {}), need) >= 1
            and (anywhere or str(nd.get("Labels", {}).get(LABEL_KEY)) in labels)]


def check_data_path(cfg: Any, gpus: float, timeout_s: float = 30.0) -> list[str]:
    """Refuse (ConfigError on data.path, one line naming the nodes) when data.path does not exist
    on a node that may run replicas: one tiny task per such node, pinned to it (node affinity, no
    CPU), in the job's working directory, so a relative path is checked as the replicas will read
    it. A node that does not answer within `timeout_s` is not refused; returns their names (the
    caller warns)."""
    path = cfg.data.path
    if path is None:
        return []
    nodes = _replica_nodes(cfg, gpus)
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
        self.cfg, self.gpus = cfg, gpus
        self.groups = []
        strategy = cfg.topology.placement_strategy
        bundle = replica_resources(cfg, gpus)
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
        res = replica_resources(self.cfg, self.gpus)
        opts: dict = {"num_cpus": res["CPU"], "num_gpus": res.get("GPU", 0)}
        if self.groups:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.groups[cluster], placement_group_bundle_index=index)
        elif self.topology.label(cluster) is not None:
            opts["label_selector"] = {LABEL_KEY: str(self.topology.label(cluster))}
        return opts

    def release(self) -> None:
        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 — the cluster may already be gone
                pass
        self.groups = []
