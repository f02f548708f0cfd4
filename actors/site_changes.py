"""Site requests carried out by the supervisor (hsgd/core/site_requests.py is the protocol: files,
decisions, applied once): `drain` and `add-site`; an add-site is decided, never carried out yet.

Drain c at round r's start (its replicas are idle, between rounds): the outcome is written first,
then c's replicas and hot spares are stopped with no restart. That is no failure: the roster sets
them aside (never `missing`, never promoted over, never probed by the round machine) and Ray's
actor table reports their deaths to nobody (Roster.deaths skips a drained cluster), so no
`replica_down`, fault count, restart or quorum quarantine follows; nothing is rolled back. The
machine's plan leaves c out like any cluster with no live member: the other clusters' inner groups
stand, the outer group of round r is formed over one site fewer (its holders changed).

Add-site at round r's start (issue 37's join, not built yet): the request is decided with the
live Ray cluster's nodes and free resources (`cluster_resources`: two reads of Ray's GCS tables, as
quarantine.py's `ray.nodes()` is; no actor is asked), so its refusals are real: a label no live
node carries, no room for its replicas (hsgd/core/site_requests.py `add_site_problem`), Ray's
tables unreadable. A request that passes them is still refused, saying that joining a running run
is not built: creating, placing and healing the new site's replicas mid-run and widening the round
machine's topology are the missing part. Nothing is reserved or started for it.

A restarted supervisor reads the outcomes before it looks at any replica (`SiteChanges.__init__`),
stops a drained cluster's actors again (a no-op once they are dead) and logs a `site_request`
event its predecessor decided but did not live to log. No requests folder: one directory check
per round, nothing else.
"""
from __future__ import annotations

import contextlib
import sys

import ray

from hsgd.core.site_requests import (APPLIED, REFUSED, Decision, SiteRequest, add_site_problem, decide, drained,
                                     mark_done, next_cluster, outcomes, pending)
from hsgd.record.rundir import call_with_deadline, write_deadline_s

JOIN_NOT_BUILT = "joining a running run is not built yet (issue 37's join slice); nothing was started"


def cluster_resources(cfg) -> tuple[list[dict], dict[str, dict], dict]:
    """Ray's node table, each live node's free resources (NodeID -> {resource: amount}), and one
    replica's bundle as this run places it. Raises whatever Ray raises when its tables cannot be read."""
    from ray._private.state import available_resources_per_node  # Ray's DeveloperAPI: no public per-node view

    from actors.placement import rank_resources
    from hsgd.config.capacity import plan_backends, replica_need

    nodes = ray.nodes()
    gpus = plan_backends(cfg, [nd for nd in nodes if nd.get("Alive")]).gpus_per_rank
    return nodes, available_resources_per_node(), replica_need(cfg, rank_resources(cfg, gpus))


class SiteChanges:
    def __init__(self, cfg, run_dir: str, topology, roster, log):
        """`log`: the RunLog; its events are read only when outcomes exist (a predecessor's
        `site_request` events are not logged twice)."""
        self.cfg, self.run_dir, self.topology, self.roster, self.log = cfg, run_dir, topology, roster, log
        self.done = outcomes(run_dir)
        self.drained = drained(self.done)  # cluster -> the round at whose start it left
        for cluster in self.drained:
            self._stop(cluster)
        events = log.records("events") if self.done else []
        logged = {e.get("id") for e in events if e.get("event") == "site_request"}
        for record in self.done.values():
            if record.get("id") not in logged:
                self._report(record)

    def at_round_start(self, round_index: int) -> None:
        """Decide and carry out every pending request, oldest first, before round `round_index` is planned.
        The run folder is read and written under the run's I/O deadline: a full disk or a hung mount
        leaves the request pending for a later round (nothing is applied before its outcome is on disk)
        and costs a warning, never the run."""
        try:
            requests = self._io(lambda: pending(self.run_dir, self.done), "listing site requests")
            for request in requests:  # no folder: one directory check, nothing else
                self._apply(request, round_index)
        except OSError as err:
            with contextlib.suppress(Exception):
                print(f"[hsgd] site requests not read at round {round_index} (retried next round): "
                      f"{type(err).__name__}: {err}", file=sys.stderr, flush=True)

    def _io(self, fn, what: str):
        return call_with_deadline(fn, write_deadline_s(float(self.cfg.run.io_grace_s)), what)

    def topology_record(self) -> dict:
        """The summary's `topology`: Topology.describe(), plus `drained` (cluster -> the round at whose
        start it left) when a cluster was drained, and `history` (every applied join and drain, in
        order: round, kind, cluster) when there was one; with none, exactly Topology.describe()."""
        drained_at = {f"c{c}": r for c, r in sorted(self.drained.items())}
        history = [{"round": d.get("round"), "kind": d.get("kind"), "cluster": d.get("cluster")}
                   for d in sorted(self.done.values(), key=lambda d: (d.get("round", -1), d.get("id", "")))
                   if d.get("outcome") == APPLIED]  # every join and drain, in order
        return {**self.topology.describe(), **({"drained": drained_at} if drained_at else {}),
                **({"history": history} if history else {})}

    def _decide_add(self, request: SiteRequest) -> Decision:
        """An add-site's refusal, always (see the module docstring): its real reason when there is one."""
        if request.problem:
            return Decision(REFUSED, request.problem, None)
        new = next_cluster(self.topology.clusters, self.done)
        try:
            nodes, free, need = cluster_resources(self.cfg)
        except Exception as err:  # noqa: BLE001 — Ray's tables unreadable: refused, the run goes on
            return Decision(REFUSED, f"add-site c{new}: cannot read the Ray cluster's nodes: "
                                     f"{type(err).__name__}: {err}".splitlines()[0], None)
        problem = add_site_problem(request, nodes=nodes, free=free, need=need, new_cluster=new)
        return Decision(REFUSED, problem or f"add-site c{new}: {JOIN_NOT_BUILT}", None)

    def _apply(self, request: SiteRequest, round_index: int) -> None:
        if request.kind == "add-site":
            decision = self._decide_add(request)
        else:
            live = {self.topology.cluster_of(rid) for rid in self.roster.live} - set(self.drained)
            decision = decide(request, clusters=self.topology.clusters, drained_clusters=self.drained,
                              min_clusters=int(self.cfg.supervisor.min_clusters), live_clusters=live)
        # before the effect: applied once (an OSError here leaves it pending, nothing done)
        record = self._io(lambda: mark_done(self.run_dir, request, decision, round_index), "recording a site request")
        self.done[request.id] = record
        if decision.outcome == APPLIED and request.kind == "drain":
            self.drained[decision.cluster] = round_index
            self._stop(decision.cluster)
        self._report(record)

    def _stop(self, cluster: int) -> None:
        """Stop cluster's replicas and spares for good, none of it counted as a failure."""
        roster = self.roster
        roster.drained_clusters.add(cluster)
        for rid in self.topology.cluster_members(cluster):
            handle = roster.handles.get(rid)
            roster.set_aside(rid)
            if handle is not None:
                with contextlib.suppress(Exception):  # already gone: stopped all the same
                    ray.kill(handle, no_restart=True)
        for name in list(roster.spares.names.get(str(cluster), ())):
            handle = roster.spares.handles.get(name)
            roster.spares.ready.discard(name)
            roster.spares.handles[name] = None  # never asked again
            if handle is not None:
                with contextlib.suppress(Exception):
                    ray.kill(handle, no_restart=True)

    def _report(self, record: dict) -> None:
        self.log.event("site_request", id=record.get("id"), kind=record.get("kind"), cluster=record.get("cluster"),
                       outcome=record.get("outcome"), reason=record.get("reason"), round=record.get("round"))
        with contextlib.suppress(Exception):  # a console that fails must not stop the run
            print(f"[hsgd] site request {record.get('id')}: {record.get('outcome')} at round {record.get('round')}: "
                  f"{record.get('reason')}", file=sys.stderr, flush=True)
