"""Where replicas run: one placement group per cluster (STRICT_PACK by default: one node, where
the fast link is), or Ray's `label_selector` on the node label `hsgd-cluster=<label>`. A replica asks
for a GPU of its own exactly when a level of it may use nccl ("Duplicate GPU detected" otherwise).
`check_cluster` runs before any actor starts: hsgd.config.capacity's refusals, and data.path missing
on a node that may run replicas, each a one-line ConfigError.

A replica of k ranks (`topology.gpus_per_replica`, issue 34) is ONE bundle of k x a rank's resources,
and its k rank actors all schedule into that bundle (`options(c, i)`, the same for each). Why one bundle rather
than k bundles in a STRICT_PACK sub-group: a bundle always lives on one node, so the replica's ranks
are together under every cluster strategy (PACK and SPREAD place a cluster's bundles apart, which
would split k separate bundles), the bundle index stays the replica index, and Ray gives each actor
in a shared bundle GPUs of its own from the bundle's. With labels or NONE, k > 1 still needs one
bundle per replica: the cluster gets a PACK group whose bundles carry the label (`group_specs`).
"""

from __future__ import annotations

import contextlib
import os
import socket

import ray
from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from hsgd.config import ConfigError
from hsgd.config.capacity import (
    LABEL_KEY,
    BackendPlan,
    data_path_problem,
    describe_resources,
    placement_problem,
    plan_backends,
    replica_need,
    replicas_that_fit,
)
from hsgd.config.layout import RunLayout, ranks_of, sites_and_ranks
from hsgd.config.schema import HsgdConfig


class PlacementTimeout(RuntimeError):
    """The replicas could fit, but Ray did not place a cluster in time (resources busy)."""


def rank_resources(cfg: HsgdConfig, gpus: float) -> dict:
    """One rank actor's resources (the whole replica's when gpus_per_replica=1): its CPUs
    (topology.cpus_per_replica, per rank) and, when a level of it may use nccl, a GPU of its own."""
    return {"CPU": float(cfg.topology.cpus_per_replica), **({"GPU": float(gpus)} if gpus else {})}


def replica_resources(cfg: HsgdConfig, gpus: float, layout: RunLayout | None = None) -> dict:
    """One replica's resources, its placement-group bundle: its k ranks' together, so one node holds them."""
    return replica_need(cfg, rank_resources(cfg, gpus), layout)


def site_group_name(run_id: str, cluster: int) -> str:
    """The placement group of cluster `cluster` in run `run_id`: the driver's (`ClusterPlacement`) and an
    added site's (`site_options`) alike, so a drain finds and releases its site's group by name (a
    drained index is never reused, so no two sites of a run share one)."""
    return f"hsgd:{run_id}:site-c{cluster}"


def release_site_group(run_id: str, cluster: int) -> None:
    """A drained or abandoned site's placement group removed, its resources free for the next add-site
    (issue 45, finding 9); best effort: none by that name (no group: labels, NONE) is nothing to do."""
    remove_site_group(site_group_name(run_id, cluster))


def cluster_resources(cfg: HsgdConfig, layout: RunLayout | None = None) -> tuple[list[dict], dict[str, dict], dict]:
    """Ray's node table, each live node's free resources (NodeID -> {resource: amount}), and one
    replica's bundle as this run places it: what an add-site's room is checked with. Raises whatever
    Ray raises when its tables cannot be read."""
    from ray._private.state import available_resources_per_node  # Ray's DeveloperAPI: no public per-node view

    nodes = ray.nodes()
    gpus = plan_backends(cfg, [nd for nd in nodes if nd.get("Alive")], layout).gpus_per_rank
    return nodes, available_resources_per_node(), replica_need(cfg, rank_resources(cfg, gpus), layout)


def site_backends(cfg: HsgdConfig, replica_info: dict, layout: RunLayout | None = None) -> dict:
    """The levels' backends for a new site's replicas: as the run's replicas report them (`replica_info`:
    rid -> {backends}), else as the driver planned them."""
    known = next((info["backends"] for info in replica_info.values() if info.get("backends")), None)
    if known:
        return dict(known)
    plan = plan_backends(cfg, [nd for nd in ray.nodes() if nd.get("Alive")], layout)
    return {"inner": plan.inner, "outer": plan.outer}


def group_specs(cfg: HsgdConfig, gpus: float, run_id: str | None = None, layout: RunLayout | None = None) -> list[dict]:
    """The placement group of each cluster, as keyword arguments of ray's `placement_group` (no group
    at all: []): one bundle per replica, then one per hot spare, named for the run (`site_group_name`;
    no `run_id`: `hsgd-cluster-<c>`). Pure, so it is tested without Ray."""
    (topo, ranks), strategy = sites_and_ranks(cfg, layout), cfg.topology.placement_strategy
    bundle = replica_resources(cfg, gpus, layout)
    if not any(v > 0 for v in bundle.values()):
        return []  # a placement group needs a non-empty bundle: 0 CPUs and no GPU is unplaced
    labelled = any(topo.labels)
    if (strategy == "NONE" or labelled) and ranks == 1:
        return []  # one actor per replica: a label selector (or nothing) places it whole
    specs = []
    for c in range(topo.clusters):
        n = topo.size(c) + cfg.topology.spares_per_cluster  # replicas, then hot spares
        spec = {
            "bundles": [dict(bundle) for _ in range(n)],
            "name": f"hsgd-cluster-{c}" if run_id is None else site_group_name(run_id, c),
            # k ranks need their bundle even where the cluster asked no strategy: PACK is the loosest
            "strategy": "PACK" if strategy == "NONE" or labelled else strategy,
        }
        if labelled and topo.label(c) is not None:
            spec["bundle_label_selector"] = [{LABEL_KEY: str(topo.label(c))} for _ in range(n)]
        specs.append(spec)
    return specs


def check_cluster(
    cfg: HsgdConfig, data_timeout_s: float, layout: RunLayout | None = None
) -> tuple[BackendPlan, list[str]]:
    """The backend plan for this Ray cluster (hsgd.config.capacity) and the nodes silent on the data.path check."""
    nodes = [nd for nd in ray.nodes() if nd.get("Alive")]
    plan = plan_backends(cfg, nodes, layout)
    need = rank_resources(cfg, plan.gpus_per_rank)
    problem = placement_problem(cfg, need, nodes, layout=layout)
    if problem is not None:
        raise ConfigError(*problem)
    return plan, _check_data_path(cfg, replica_need(cfg, need, layout), nodes, data_timeout_s, layout)


@ray.remote(num_cpus=0, max_retries=0)
def _path_here(path: str) -> tuple[bool, str]:
    """Run on one node, in the job's working directory as the replicas are: does `path` exist?"""
    return os.path.exists(os.path.expanduser(path)), socket.gethostname()


def _check_data_path(
    cfg: HsgdConfig, need: dict, alive: list[dict], timeout_s: float, layout: RunLayout | None = None
) -> list[str]:
    """Refuse (ConfigError) when data.path does not exist on a node that may run replicas, asking each
    with a tiny pinned task. A node that does not answer within `timeout_s` is not refused; returns their names."""
    path = cfg.data.path
    if path is None:
        return []
    site_labels = sites_and_ranks(cfg, layout)[0].labels
    labels = {str(x) for x in site_labels if x is not None}
    anywhere = not labels or None in site_labels  # a site without a label may land on any node
    nodes = [
        nd
        for nd in alive
        if replicas_that_fit(nd.get("Resources", {}), need) >= 1  # room for one
        and (anywhere or str(nd.get("Labels", {}).get(LABEL_KEY)) in labels)
    ]  # a cluster's label, if pinned
    refs = {
        nd["NodeID"]: _path_here.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=nd["NodeID"], soft=False)
        ).remote(str(path))
        for nd in nodes
    }
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


def site_strategy(cfg: HsgdConfig, label: str | None, layout: RunLayout | None = None) -> str:
    """How `site_options` places a joining site's replicas: "NONE" when each replica is placed on its own
    (by its label, or anywhere), else its placement group's strategy (k ranks need their one bundle even
    with a label or no strategy: PACK). The add-site room check counts room the same way."""
    strategy = cfg.topology.placement_strategy
    ranks = ranks_of(cfg, layout)
    if ranks == 1 and (label is not None or strategy == "NONE"):
        return "NONE"
    return "PACK" if strategy == "NONE" or label is not None else strategy


def site_options(
    cfg: HsgdConfig, gpus: float, replicas: int, label: str | None, group_name: str, layout: RunLayout | None = None
) -> list[dict]:
    """Ray options for each replica of a site joining a running run (actors/site_changes.py), placed the
    way `ClusterPlacement` places a cluster: by its `label`, else in a placement group of its own
    (`topology.placement_strategy`), else anywhere. The group is DETACHED and named `group_name`: its
    replicas outlive a supervisor restart, whose successor finds it by name; the driver removes it at
    the run's end. Asynchronous: Ray places the replicas once the group is ready, nobody waits here."""
    rank, bundle = rank_resources(cfg, gpus), replica_resources(cfg, gpus, layout)
    opts: dict = {"num_cpus": rank["CPU"], "num_gpus": rank.get("GPU", 0)}
    strategy = site_strategy(cfg, label, layout)
    if strategy == "NONE" and label is not None:
        return [{**opts, "label_selector": {LABEL_KEY: str(label)}} for _ in range(replicas)]
    if strategy == "NONE" or not any(v > 0 for v in bundle.values()):
        return [dict(opts) for _ in range(replicas)]
    try:
        group = get_placement_group(group_name)  # a predecessor's, for the same site
    except ValueError:  # k ranks need their one bundle even with a label or no strategy (group_specs)
        group = placement_group(
            [dict(bundle) for _ in range(replicas)],
            name=group_name,
            lifetime="detached",
            strategy=strategy,
            **({"bundle_label_selector": [{LABEL_KEY: str(label)}] * replicas} if label is not None else {}),
        )
    return [
        {
            **opts,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=i
            ),
        }
        for i in range(replicas)
    ]


def remove_site_group(group_name: str) -> None:
    """The detached group of a joined site, removed (the run's end); none by that name: nothing to do."""
    with contextlib.suppress(Exception):
        remove_placement_group(get_placement_group(group_name))


def quarantine_node(
    nodes: list[dict], free: dict[str, dict], need: dict, *, away_from: str | None, label: str | None
) -> str | None:
    """The node a quarantined replica is re-created on (actors/quarantine.py): a live node other than
    `away_from` with room for `need` now (`free`: ray's available resources per node id), of its site's
    `label` when it has one (as its site's replicas are placed), the most room first; None: no such node."""
    room = [
        (replicas_that_fit(free.get(nd["NodeID"], {}), need), nd["NodeID"])
        for nd in nodes
        if nd.get("Alive")
        and nd["NodeID"] != away_from
        and (label is None or str((nd.get("Labels") or {}).get(LABEL_KEY)) == str(label))
    ]
    return max((r for r in room if r[0] >= 1), default=(0, None))[1]


class ClusterPlacement:
    """Placement groups (or label selectors) for every cluster; `options(c, i)` for each rank actor of
    replica i of c (with gpus_per_replica=1 the one actor is the replica)."""

    def __init__(
        self, cfg: HsgdConfig, gpus: float, timeout_s: float, run_id: str | None = None, layout: RunLayout | None = None
    ):
        self.rank = rank_resources(cfg, gpus)  # what one actor asks; its replica's bundle holds k of these
        self.topology = topo = sites_and_ranks(cfg, layout)[0]
        specs = group_specs(cfg, gpus, run_id, layout)
        self.groups = [placement_group(**spec) for spec in specs]
        if not self.groups:
            return
        strategy, bundle = specs[0]["strategy"], specs[0]["bundles"][0]
        refs = [pg.ready() for pg in self.groups]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(ready) < len(refs):
            pending = [f"c{c}" for c, ref in enumerate(refs) if ref not in ready]
            self.release()
            raise PlacementTimeout(
                f"clusters {pending} not placed after {timeout_s:g}s ({strategy}, up to {topo.replicas_per_cluster} "
                f"x {describe_resources(bundle)} each): the Ray cluster's resources are busy (other jobs?); free them, "
                f"or raise supervisor.quorum_wait_s"
            )

    def options(self, cluster: int, index: int) -> dict:
        """Ray options for one rank actor of replica `index` of `cluster`: every rank of it gets the same
        (one rank's resources, scheduled into the replica's one bundle)."""
        opts: dict = {"num_cpus": self.rank["CPU"], "num_gpus": self.rank.get("GPU", 0)}
        if self.groups:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.groups[cluster], placement_group_bundle_index=index
            )
        elif self.topology.label(cluster) is not None:
            opts["label_selector"] = {LABEL_KEY: str(self.topology.label(cluster))}
        return opts

    def release(self) -> None:
        for pg in self.groups:
            with contextlib.suppress(Exception):  # the cluster may already be gone
                remove_placement_group(pg)
        self.groups = []
