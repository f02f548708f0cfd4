"""Site requests (drain, add-site) carried out by the supervisor: what is decided, and when, is
hsgd/core/site_plan.py (its docstring is the protocol), the files hsgd/core/site_requests.py. Here only
the carrying out: Ray's tables read, a new site's replicas started detached and asked whether they are
up, a drained or abandoned site's actors stopped and its placement group released, the roster told,
events and console lines written. The run folder is read and written under the run's I/O deadline: a
full disk or a hung mount leaves a request (or a join) pending for a later round, never costs the run.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from omegaconf import OmegaConf

from actors.placement import cluster_resources, site_group_name
from actors.roster import lookup, replica_actor_name, restarts_exhausted
from hsgd.core.round import current_round
from hsgd.core.site_plan import JoinProgress, RequestReport, SiteLedger, SitePlan, topology_of_run, with_joined_replicas
from hsgd.core.site_requests import APPLIED, Outcome, RequestKind, SiteRequest, pending
from hsgd.core.site_topology import widened_sites
from hsgd.core.topology import Topology
from hsgd.record.rundir import call_with_deadline, write_deadline_s

__all__ = ["SiteChanges", "stop_joined_sites", "topology_of_run", "with_joined_replicas"]  # the driver's too


def stop_joined_sites(run_dir: str, run_id: str) -> None:
    """The run's end (the driver): every added site's detached replicas and group stopped, best effort."""
    from actors.placement import release_site_group

    for d in SiteLedger.read(run_dir, run_id).applied_sites():
        _kill(lookup(replica_actor_name(run_id, f"{d.site}r{i}")) for i in range(d.replicas))
        release_site_group(run_id, d.cluster)


def _kill(handles) -> None:
    for handle in handles:
        if handle is not None:
            with contextlib.suppress(Exception):  # already gone: stopped all the same
                ray.kill(handle, no_restart=True)


@dataclass
class Joining(JoinProgress):
    """A starting site's actors, beside what is known of them (JoinProgress)."""

    handles: dict = field(default_factory=dict)  # rid -> its actor
    make: Callable[[str], object] | None = None  # rid -> a new actor under rid's name (one dead for good)
    asked: dict = field(default_factory=dict)  # rid -> its progress question still unanswered
    loading: dict = field(default_factory=dict)  # rid -> its resume checkpoint load still in flight
    wait_s: float = 0.0  # how long the next look may wait for them (a resumed site's first look only)


class SiteChanges:
    def __init__(
        self,
        cfg,
        run_dir: str,
        topology: Topology,
        roster,
        log,
        state=None,
        save=lambda: None,
        resume_round: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`state`: the durable RunState (run id, index table, identity map), `save` its writer;
        `resume_round`: the checkpoint round a resumed run started from; `clock`: for the join deadline."""
        self.cfg, self.run_dir, self.roster, self.log = cfg, run_dir, roster, log
        self.state, self.save, self.run_id, self.clock = state, save, getattr(state, "run_id", ""), clock
        self.plan = SitePlan.read(run_dir, self.run_id, topology, cfg.supervisor)
        # drained sites' actors set aside, killed (then their groups released) at the next round's start:
        # in the constructor, not before the first (a resumed run's driver still has calls in flight to them)
        self.to_stop, self.to_release = [], []
        # a restarted supervisor (Ray re-runs this constructor) may take over a round its predecessor
        # started: requests wait for the next round's start, so a drain lets the site finish that round
        first = getattr(state, "supervisor_starts", 1) == 1  # a resumed run's first supervisor too
        self.taken_over = not first
        for cluster in self.drained:
            if cluster < topology.clusters:  # (a drained site past a resumed run's queue head: widened later)
                self._stop(cluster, now=False)
        for record in self.plan.unlogged(log.records("events") if self.plan.ledger.done else []):
            self._report(record)
        for cluster in self.plan.adopted():
            self._adopt(cluster)
        self.resume_round = resume_round if first else None  # a restart's site loaded already
        self._next_queued()

    @property
    def topology(self) -> Topology:
        return self.plan.topology

    @property
    def drained(self) -> dict[int, int]:
        return self.plan.ledger.drained

    def at_round_start(self, round_index: int) -> Topology:
        """Decide and carry out every pending request, oldest first, before round `round_index` is
        planned (none at a restarted supervisor's first call), and take in a site whose replicas are
        all up. Returns the run's topology (wider once a site joined)."""
        self._stop_set_aside()
        try:
            done = self.plan.ledger.done
            listed = [] if self.taken_over else self._io(lambda: pending(self.run_dir, done), "listing site requests")
            self.taken_over = False
            for request in listed:  # no folder: one directory check, nothing else
                self._apply(request, round_index)
            if self.plan.joining is not None:
                self._take_in(self.plan.joining, round_index)
        except OSError as err:
            why = f"{type(err).__name__}: {err}"
            self._say(f"site requests not read at round {round_index} (retried next round): {why}")
        self._note_commits(round_index)
        return self.topology

    def at_run_end(self) -> dict:
        """`site_committed` for a site whose first commit was the run's last round; the summary's `topology`."""
        with contextlib.suppress(Exception):  # a record owed, never a reason for the summary to fail
            self._note_commits(current_round(self.roster.live.values()))
        return self.topology_record()

    def topology_record(self) -> dict:
        return self.plan.ledger.record(self.topology)

    def _io(self, fn, what: str):
        return call_with_deadline(fn, write_deadline_s(float(self.cfg.run.io_grace_s)), what)

    def _apply(self, request: SiteRequest, round_index: int) -> None:
        from actors.placement import site_strategy

        adding = request.kind is RequestKind.ADD_SITE  # Ray's tables are read only if nothing else refuses
        strategy = site_strategy(self.cfg, request.label) if adding else ""
        decision = self.plan.decide(
            request, live=self.roster.live, resources=lambda: cluster_resources(self.cfg), strategy=strategy
        )
        # before the effect: applied once (an OSError here leaves it pending, nothing done)
        record = self._io(
            lambda: self.plan.ledger.write_done(request, decision, round_index), "recording a site request"
        )
        if decision.outcome == APPLIED and request.kind is RequestKind.DRAIN:
            self._stop(decision.cluster)
        self._report(record)
        if decision.outcome == APPLIED and request.kind is RequestKind.ADD_SITE:
            self._start(Outcome.of(record))

    def _start(self, record: Outcome) -> None:
        """Start (or, after a supervisor restart, find) an applied add-site's replicas; never waits for them."""
        from actors.placement import site_backends, site_options
        from actors.startup import start_replica

        c = record.cluster
        if c != self.topology.clusters:  # one site starts at a time: cannot happen unless files were edited
            self._say(f"site {record.site} not started: the next cluster is c{self.topology.clusters}")
            return
        widened = self.topology.with_site(record.replicas, label=record.label, name=record.name)
        if self.state is not None:  # fresh indices, durable before any replica reads its own
            self.state.replica_indices.update(dict(widened.index_table))
            self.save()
        backends = site_backends(self.cfg, self.roster.replica_info)
        container = OmegaConf.to_container(self.cfg, resolve=True)  # its replicas' config names the site
        container["topology"]["sites"] = widened_sites(list(container["topology"].get("sites") or []), widened)
        gpus = 1.0 if "nccl" in backends.values() else 0.0
        options = site_options(self.cfg, gpus, record.replicas, record.label, site_group_name(self.run_id, c))
        members, table = widened.cluster_members(c), dict(widened.index_table)

        def make(rid: str):
            name, opts = replica_actor_name(self.run_id, rid), options[members.index(rid)]
            return start_replica(
                container, name, opts, rid, self.run_dir, backends, index_table=table, lifetime="detached"
            )

        handles = {rid: lookup(replica_actor_name(self.run_id, rid)) or make(rid) for rid in members}
        self.plan.joining = Joining(record.id, c, widened, started=self.clock(), handles=handles, make=make)

    def _next_queued(self) -> None:
        """Carry out `SitePlan.next_queued` until a site is starting or none is queued."""
        while (step := self.plan.next_queued()) is not None:
            what, record = step
            if what == "strand":
                names = ", ".join(d.site for d in self.plan.stranded)
                self._say(f"site(s) {names} not started: the next cluster is c{self.topology.clusters}")
            elif what == "widen":
                self.roster.topology = self.topology
                self._stop(record.cluster, now=False)
            else:
                self._start(record)
                if self.resume_round is not None and self.plan.joining is not None:
                    self._load_resume_point(self.plan.joining, self.resume_round)

    def _load_resume_point(self, joining: Joining, resume_round: int) -> None:
        """A resumed run's site: each replica the checkpoint holds loads its own state (the first look waits
        up to `supervisor.phase_timeout_s`); one that does not heals from the global state when it joins."""
        from hsgd.train import checkpoint

        root = checkpoint.root_url(self.cfg.checkpoint.dir, self.run_dir)
        directory = checkpoint.join_url(root, checkpoint.round_dir_name(resume_round))
        try:
            manifest = self._io(lambda: checkpoint.read_manifest(directory), "reading the resumed checkpoint")
        except Exception as err:  # noqa: BLE001 — the site still joins, healed
            self._say(f"site {joining.name}: {directory} not read ({type(err).__name__}: {err}); it heals instead")
            return
        fmt, files = checkpoint.format_of(manifest), manifest["files"]
        joining.loading = {
            rid: handle.load_checkpoint.remote(directory, files[rid], None, fmt)
            for rid, handle in joining.handles.items()
            if rid in files
        }
        joining.wait_s = float(self.cfg.supervisor.phase_timeout_s)

    def _take_in(self, joining: Joining, round_index: int) -> None:
        """One look at the starting replicas; the site joins, is abandoned, or waits (`JoinProgress.verdict`)."""
        self._ask_up(joining)
        floor, timeout_s = self.plan.default_floor, float(self.cfg.supervisor.join_timeout_s)
        verdict, reason = joining.verdict(default_floor=floor, now=self.clock(), timeout_s=timeout_s)
        if verdict == "abandon":
            self._abandon(joining, round_index, reason)
        if verdict != "join":
            return
        roster = self.roster
        for rid, handle in joining.handles.items():  # the identity map first: a successor's roster finds them
            roster.names[rid], roster.handles[rid] = replica_actor_name(self.run_id, rid), handle
            roster.gone.discard(rid)
        roster.gone.update(joining.lost)  # out, as any replica whose restarts are spent
        for rid in joining.lost:  # its deaths before the join were never the run's: no faults, no quarantine
            roster.watch.given_up(roster.names[rid])
        self.save()
        self._io(lambda: self.plan.ledger.write_joined(joining, round_index), "recording a site's join")
        try:  # run.json lists them too (drills, jobs.diagnose); a failure there costs the join nothing
            self._io(self.plan.ledger.note_in_run_json, "listing a site's replicas in run.json")
        except Exception as err:  # noqa: BLE001
            self._say(f"run.json not updated for site {joining.name}: {type(err).__name__}: {err}")
        self.plan.topology = roster.topology = joining.topology
        for rid, answer in sorted(joining.up.items()):
            roster.admit(rid, answer)  # replica_up, with its fresh replica_index
        self.plan.joining = None
        self._next_queued()  # a resumed run's next added site, if any
        seconds = self.clock() - joining.started
        up = sorted(joining.up)
        self.log.event("site_up", cluster=joining.name, round=round_index, replicas=up, seconds=round(seconds, 3))
        self._say(joining.up_line(round_index, seconds))

    def _ask_up(self, joining: Joining) -> None:
        """One look, never waiting (a resumed site's first: up to its loads' wait); a replica dead for good is
        created again or lost (`dead_for_good`); one restarting, or not answering yet, is asked again later."""
        wait_s, joining.wait_s = joining.wait_s, 0.0
        for rid, (ok, err) in _answers(joining.loading, wait_s).items():
            if not ok:  # its own failure (a death is seen when it is asked)
                line = f"{rid} did not load the resumed checkpoint ({err}); it heals from the global state"
                self._say(f"site {joining.name}: {line}")
        for rid, handle in joining.handles.items():
            if rid not in joining.up and rid not in joining.lost and rid not in joining.asked | joining.loading:
                joining.asked[rid] = handle.progress.remote()
        for rid, (ok, answer) in _answers(joining.asked, wait_s).items():
            if ok:
                joining.answered(rid, answer)
            elif restarts_exhausted(joining.handles[rid]):  # else restarting: asked again
                again, line = joining.dead_for_good(rid, int(self.cfg.faults.max_restarts))
                self._say(line)
                if again:
                    try:
                        joining.handles[rid] = joining.make(rid)
                    except Exception as err:  # noqa: BLE001 — its name still held, no room: tried at the next look
                        self._say(f"site {joining.name}: {rid} not started again: {type(err).__name__}: {err}")

    def _abandon(self, joining: Joining, round_index: int, reason: str) -> None:
        """Its replicas and group stopped first, then `<id>.abandoned` (a restart in between tries again)."""
        from actors.placement import release_site_group

        _kill(joining.handles.values())
        release_site_group(self.run_id, joining.cluster)
        self._io(lambda: self.plan.ledger.write_abandoned(joining, round_index, reason), "recording an abandoned site")
        self.plan.joining = None
        self._next_queued()  # (a resumed run's later site: started only if its index is now the next)
        self.log.event("site_abandoned", cluster=joining.name, round=round_index, reason=reason)
        self._say(
            f"site {joining.name} abandoned at round {round_index}'s start: {reason}; a new add-site may be asked"
        )

    def _adopt(self, cluster: int) -> None:
        """A site in the topology at a restart: its ids' names (an older state's missing ones: as started)."""
        roster = self.roster
        for rid in self.topology.cluster_members(cluster):
            roster.names.setdefault(rid, replica_actor_name(self.run_id, rid))
            if roster.handles.get(rid) is None:
                roster.handles[rid] = lookup(roster.names[rid])
                if roster.handles[rid] is None:
                    roster.gone.add(rid)

    def _note_commits(self, round_index: int) -> None:
        for name, members in self.plan.commits_due(self.roster.live, round_index):
            self.log.event("site_committed", cluster=name, round=round_index - 1, replicas=members)
            self._say(f"site {name} committed round {round_index - 1} with the others")

    def _say(self, line: str) -> None:
        with contextlib.suppress(Exception):  # a console that fails must not stop the run
            print(f"[hsgd] {line}", file=sys.stderr, flush=True)

    def _stop(self, cluster: int, *, now: bool = True) -> None:
        """Stop cluster's replicas and spares for good, no failure; `now=False`: at the next round's start."""
        roster = self.roster
        roster.drained_clusters.add(cluster)
        for rid in self.topology.cluster_members(cluster):
            self.to_stop.append(roster.handles.get(rid))
            roster.set_aside(rid)
        for name in list(roster.spares.names.get(str(cluster), ())):
            self.to_stop.append(roster.spares.handles.get(name))
            roster.spares.ready.discard(name)
            roster.spares.handles[name] = None  # never asked again
        self.to_release.append(cluster)
        if now:
            self._stop_set_aside()

    def _stop_set_aside(self) -> None:
        """Kill the set-aside actors, then release their groups (room for an add-site in their place)."""
        from actors.placement import release_site_group

        _kill(self.to_stop)
        for cluster in self.to_release:
            release_site_group(self.run_id, cluster)
        self.to_stop, self.to_release = [], []

    def _report(self, record: dict) -> None:
        r = RequestReport.of(record)
        self.log.event(
            "site_request", id=r.id, kind=r.kind, cluster=r.cluster, outcome=r.outcome, reason=r.reason, round=r.round
        )
        self._say(r.line)


def _answers(refs: dict, wait_s: float) -> dict:
    """The calls of `refs` (rid -> ref) done within wait_s, each taken out: rid -> (True, its answer) or
    (False, its error's type name: it died, for good or restarting)."""
    if not refs:
        return {}
    ready = set(ray.wait(list(refs.values()), num_returns=len(refs), timeout=wait_s, fetch_local=False)[0])
    out = {}
    for rid, ref in list(refs.items()):
        if ref in ready:
            del refs[rid]
            try:
                out[rid] = (True, ray.get(ref, timeout=1.0))
            except Exception as err:  # noqa: BLE001
                out[rid] = (False, type(err).__name__)
    return out
