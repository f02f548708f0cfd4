"""Site requests carried out by the supervisor (hsgd/core/site_requests.py is the protocol: files,
decisions, applied once). Only `drain` exists in this slice.

Drain c at round r's start (its replicas are idle, between rounds): the outcome is written first,
then c's replicas and hot spares are stopped with no restart. That is no failure: the roster sets
them aside (never `missing`, never promoted over, never probed by the round machine) and Ray's
actor table reports their deaths to nobody (Roster.deaths skips a drained cluster), so no
`replica_down`, fault count, restart or quorum quarantine follows; nothing is rolled back. The
machine's plan leaves c out like any cluster with no live member: the other clusters' inner groups
stand, the outer group of round r is formed over one site fewer (its holders changed).

A restarted supervisor reads the outcomes before it looks at any replica (`SiteChanges.__init__`),
stops a drained cluster's actors again (a no-op once they are dead) and logs a `site_request`
event its predecessor decided but did not live to log. No requests folder: one directory check
per round, nothing else.
"""
from __future__ import annotations

import contextlib
import sys

import ray

from hsgd.core.site_requests import APPLIED, SiteRequest, decide, drained, mark_done, outcomes, pending
from hsgd.record.rundir import call_with_deadline, write_deadline_s


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
        start it left) when a cluster was drained; with none, exactly Topology.describe()."""
        drained_at = {f"c{c}": r for c, r in sorted(self.drained.items())}
        return {**self.topology.describe(), **({"drained": drained_at} if drained_at else {})}

    def _apply(self, request: SiteRequest, round_index: int) -> None:
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
