"""Site requests carried out by the supervisor (hsgd/core/site_requests.py is the protocol: files,
decisions, applied once): `drain` and `add-site`.

Drain c at round r's start (its replicas are idle, between rounds): the outcome is written first,
then c's replicas and hot spares are stopped with no restart and its placement group (the driver's or its
own, `site_group_name`) released, so its room serves a later add-site. That is no failure: the roster sets
them aside (never `missing`, never promoted over, never probed by the round machine) and Ray's
actor table reports their deaths to nobody (Roster.deaths skips a drained cluster), so no
`replica_down`, fault count, restart or quorum quarantine follows; nothing is rolled back. The
machine's plan leaves c out like any cluster with no live member: the other clusters' inner groups
stand, the outer group of round r is formed over one site fewer (its holders changed).

Add-site at round a's start: decided with the live Ray cluster's nodes and free resources
(`cluster_resources`: two reads of Ray's GCS tables; no actor is asked). Refused: a label no live
node carries, no room (hsgd/core/site_requests.py `add_site_problem`), Ray's tables unreadable, or
another site still starting (one site starts at a time, so every new site is the next index). An
applied one is the new cluster c<K> (`next_cluster`: a drained site's index is never reused):
    start     its outcome written, its ids' fresh global indices (Topology.with_site, issue 32's
              table) saved in the durable state, then its replicas started, named as the driver
              names replicas, DETACHED (a supervisor's own actors die with it; these must outlive
              it, as the driver's do) and placed as a cluster is (actors/placement.py
              `site_options`: its label, else a detached placement group of its own). Nothing
              waits: the round in flight goes on.
    up        at each round's start their `progress` is asked without waiting (ray.wait, timeout 0);
              once ALL have answered up (built, idle), at that round's start: the identity map
              gets their names (saved), `<id>.joined` is written (run.json's `replicas` then lists
              them: `note_in_run_json`), then the topology is widened
              (returned to the supervisor, which hands it to the round machine) and they are
              admitted at their own (round 0) progress: `site_up`.
    join      the round machine sees a cluster with nobody at the round: it heals `global` from
              another cluster (as a whole cluster that restarted), forms the new cluster's inner
              group and, its leader being new, the outer group; the other sites' inner groups
              stand (their members did not change). `site_committed` at the first round's start
              after a round it committed, or at the run's end (`at_run_end`) when that was the last.
    lost      a new replica that dies for good before it is up (Ray's restarts spent:
              roster.restarts_exhausted) is created again under its name, at most
              `faults.max_restarts` times in all for the site. Once those are spent, a replica dead for
              good again is lost: when every other one is up, the site joins with those up if they
              are at least its floor (`supervisor.min_replicas_per_cluster`, or its `min_replicas`;
              the lost ones are `gone`, as any replica whose restarts are spent), else it is
              abandoned: its replicas and placement group stopped, then `<id>.abandoned` written,
              `site_abandoned` (cluster, round, reason) and a console line; a later add-site may go
              on (it gets the abandoned index). Nothing in the other sites is touched.
    resume    a resumed run (`train.resume=true`, a new run id) starts every applied site that was
              neither drained nor abandoned again, under its names and indices, one after the other
              in the order added (`queued`: the first at once, in the supervisor's constructor while
              the driver's replicas load, each next one once the one before joined; a drained site
              keeps its index in the topology, its replicas never started); each replica the resumed
              checkpoint holds loads its own state, and the first round's start waits for them (up
              to `supervisor.phase_timeout_s`): the site joins at the resume round, as it left off.
              A site past a gap (the resume's config has fewer clusters than it came after) is
              `stranded`: never started; the driver said so before any actor started
              (`resume_notice`), and an add-site that could not start is refused.
A restarted supervisor builds its topology with every joined site (`topology_of_run`), finds a
joined site's actors by name, and, for an applied site not joined yet, finds (or, if the crash
came before they were started, starts) its replicas and waits for them again. The driver stops
the detached replicas and groups at the run's end (`stop_joined_sites`). The re-creation count
lives in memory: a restarted supervisor's starts again. A site not all up (or lost) within
`supervisor.join_timeout_s` of its start (a replica that never answers and never dies: its group
never placed) is abandoned the same way (`join_overdue`). Not handled: a joined site's replica
re-created by quarantine starts with the run's config as written.

A restarted supervisor decides no request at the first round's start it sees: that round may be one
its predecessor started, and a drain takes effect only between rounds ("the site finishes its
current round"); pending requests are decided at the next round's start.
A restarted supervisor reads the outcomes before it looks at any replica (`SiteChanges.__init__`),
sets a drained cluster's actors aside and stops them again at its first round's start (a no-op
once they are dead; not in the constructor: a resumed run's driver, which started them, still has
its start-up calls to them in flight, and a kill there would fail its start) and logs a `site_request`
event its predecessor decided but did not live to log. No requests folder: one directory check
per round, nothing else.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray
from omegaconf import OmegaConf

from actors.placement import site_group_name
from actors.roster import lookup, replica_actor_name, restarts_exhausted
from hsgd.core.round import current_round
from hsgd.core.site_requests import (
    APPLIED,
    REFUSED,
    Decision,
    Outcome,
    RequestKind,
    SiteRequest,
    abandoned,
    add_site_problem,
    applied_sites,
    decide,
    drained,
    join_overdue,
    joined,
    joined_topology,
    mark_abandoned,
    mark_done,
    mark_joined,
    next_cluster,
    outcomes,
    pending,
    round_holders,
    site_queue,
    stranded_notice,
    widened_sites,
)
from hsgd.core.topology import Topology, topology_of
from hsgd.record.rundir import atomic_write_text, call_with_deadline, write_deadline_s


def cluster_resources(cfg) -> tuple[list[dict], dict[str, dict], dict]:
    """Ray's node table, each live node's free resources (NodeID -> {resource: amount}), and one
    replica's bundle as this run places it. Raises whatever Ray raises when its tables cannot be read."""
    from ray._private.state import available_resources_per_node  # Ray's DeveloperAPI: no public per-node view

    from actors.placement import rank_resources
    from hsgd.config.capacity import plan_backends, replica_need

    nodes = ray.nodes()
    gpus = plan_backends(cfg, [nd for nd in nodes if nd.get("Alive")]).gpus_per_rank
    return nodes, available_resources_per_node(), replica_need(cfg, rank_resources(cfg, gpus))


def topology_of_run(cfg, replica_indices: dict, run_dir: str, run_id: str) -> Topology:
    """The run's topology now: the config's, widened by every site that joined in this run or was
    drained (a restarted supervisor's), up to the first other one (a resumed run starts it and those
    after it again, in order: `SiteChanges`)."""
    done = outcomes(run_dir)
    return joined_topology(
        topology_of(cfg, replica_indices),
        done,
        joined(run_dir, run_id),
        drained(done),
        abandoned(run_dir) if done else {},
    )


def resume_notice(run_dir: str, clusters: int) -> str | None:
    """The driver of a resumed run whose config has `clusters` clusters, before any actor starts: one line
    when an added site cannot start in this run (hsgd/core/site_requests.py `stranded_notice`), else None."""
    done = outcomes(run_dir)
    return stranded_notice(clusters, done, abandoned(run_dir), drained(done)) if done else None


def with_joined_replicas(run_dir: str, run_id: str, replicas: list[str]) -> list[str]:
    """run.json's `replicas` (the ids the driver started) and every id of a site that joined in run
    `run_id`, in the order they came: how drills, `jobs.diagnose` and `jobs.status` readers find the
    actors of a site added mid-run (named `hsgd:<run_id>:<rid>` as the driver's)."""
    ids, took_part, gave_up = list(replicas), joined(run_dir, run_id), abandoned(run_dir)
    for d in applied_sites(outcomes(run_dir)):
        if d.id in took_part and d.id not in gave_up:
            ids += [f"{d.site}r{i}" for i in range(d.replicas) if f"{d.site}r{i}" not in ids]
    return ids


def note_in_run_json(run_dir: str, run_id: str) -> None:
    """run.json's `replicas` widened by the sites joined so far (`with_joined_replicas`): written by
    the supervisor at each join; the driver writes it last at the run's end, the same way."""
    path = Path(run_dir) / "run.json"
    info = json.loads(path.read_text(encoding="utf-8"))
    if info.get("run_id") == run_id:  # another run's file (a folder reused by hand) is left alone
        info["replicas"] = with_joined_replicas(run_dir, run_id, list(info.get("replicas") or []))
        atomic_write_text(path, json.dumps(info, indent=1))


def stop_joined_sites(run_dir: str, run_id: str) -> None:
    """The run's end (the driver): every added site's replicas and placement group are detached, so
    they outlive their supervisor and are stopped here, each best effort (one already gone is none)."""
    from actors.placement import remove_site_group

    for d in applied_sites(outcomes(run_dir)):
        for i in range(d.replicas):
            handle = lookup(replica_actor_name(run_id, f"{d.site}r{i}"))
            if handle is not None:
                with contextlib.suppress(Exception):
                    ray.kill(handle, no_restart=True)
        remove_site_group(site_group_name(run_id, d.cluster))


@dataclass
class Joining:
    """An applied site whose replicas were started and are not all up yet."""

    request_id: str
    cluster: int
    topology: Topology  # the run's topology with it
    handles: dict  # rid -> its actor
    make: Callable[[str], object]  # rid -> a new actor under rid's name (one that died for good)
    asked: dict = field(default_factory=dict)  # rid -> its progress question still unanswered
    up: dict = field(default_factory=dict)  # rid -> its progress answer (built, idle)
    lost: set = field(default_factory=set)  # rids dead for good once the site's re-creations were spent
    loading: dict = field(default_factory=dict)  # rid -> its resume checkpoint load still in flight
    wait_s: float = 0.0  # how long the next look may wait for them (a resumed site's first look only)
    recreated: int = 0  # re-creations so far, for the whole site (at most faults.max_restarts)
    started: float = 0.0  # when it was started (or found by a restarted supervisor): SiteChanges' clock


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
        """`log`: the RunLog; its events are read only when outcomes exist (a predecessor's
        `site_request` events are not logged twice). `state`: the durable RunState (run id, index
        table, identity map) and `save` its writer: an add-site's fresh indices are saved there.
        `resume_round`: the checkpoint round a resumed run started from (module docstring: `resume`).
        `clock`: monotonic seconds, for the join deadline (supervisor.join_timeout_s)."""
        self.clock = clock
        self.cfg, self.run_dir, self.topology, self.roster, self.log = cfg, run_dir, topology, roster, log
        self.state, self.save, self.run_id = state, save, getattr(state, "run_id", "")
        self.done = outcomes(run_dir)
        self.joined = joined(run_dir, self.run_id) if self.done else {}  # request id -> its join ("cluster", "round")
        self.abandoned = abandoned(run_dir) if self.done else {}  # request id -> given up before it joined
        self.joining: Joining | None = None
        self.drained = drained(self.done)  # cluster -> the round at whose start it left
        self.to_stop: list = []  # drained sites' actors set aside, to be killed at the first round's start
        self.to_release: list[int] = []  # drained sites whose placement group goes once their actors are stopped
        # a restarted supervisor (Ray re-runs this constructor with the same arguments, a resume's
        # `resume_round` too) takes over a round its predecessor may have started: requests wait for
        # the next round's start, so a drain lets the site finish that round
        first = getattr(state, "supervisor_starts", 1) == 1  # a resumed run's first supervisor too
        self.taken_over = not first
        for cluster in self.drained:
            if cluster < topology.clusters:  # (a drained site past a resumed run's queue head: widened later)
                self._stop(cluster, now=False)
        events = log.records("events") if self.done else []
        logged = {e.get("id") for e in events if e.get("event") == "site_request"}
        self.committed = {e.get("cluster") for e in events if e.get("event") == "site_committed"}
        for record in self.done.values():
            if record.get("id") not in logged:
                self._report(record)
        # applied sites not in the topology yet, in the order added: the one starting (a restart) or,
        # in a resumed run, every one not drained before it (each starts once the one before joined)
        # (`stranded`: past a gap, a resume with fewer clusters: the driver said so, never started here)
        self.queued, self.stranded = site_queue(topology.clusters, self.done, self.abandoned)
        for record in applied_sites(self.done):
            if record.id not in self.abandoned and record.cluster < topology.clusters:
                self._adopt(record.cluster)
        self.resume_round = resume_round if first else None  # a restart's site loaded already
        self._next_queued()

    def at_round_start(self, round_index: int) -> Topology:
        """Decide and carry out every pending request, oldest first, before round `round_index` is planned;
        take in a site whose replicas are all up. A restarted supervisor's first call decides nothing: the
        round it takes over may be in flight (a drain applied there would drop the site's finished
        inner steps from that round's commit); its requests wait for the next round's start. Returns the
        run's topology (wider once a site joined).
        The run folder is read and written under the run's I/O deadline: a full disk or a hung mount
        leaves the request (or the join) pending for a later round (nothing is applied before its
        outcome is on disk) and costs a warning, never the run."""
        self._stop_set_aside()
        try:
            requests = (
                [] if self.taken_over else self._io(lambda: pending(self.run_dir, self.done), "listing site requests")
            )
            self.taken_over = False
            for request in requests:  # no folder: one directory check, nothing else
                self._apply(request, round_index)
            if self.joining is not None:
                self._take_in(self.joining, round_index)
        except OSError as err:
            with contextlib.suppress(Exception):
                print(
                    f"[hsgd] site requests not read at round {round_index} (retried next round): "
                    f"{type(err).__name__}: {err}",
                    file=sys.stderr,
                    flush=True,
                )
        self._note_commits(round_index)
        return self.topology

    def at_run_end(self) -> dict:
        """The run's end: `site_committed` for a site whose first commit was the run's last round (no
        round's start came after it); returns the summary's `topology` (`topology_record`)."""
        with contextlib.suppress(Exception):  # a record owed, never a reason for the summary to fail
            self._note_commits(current_round(self.roster.live.values()))
        return self.topology_record()

    def _io(self, fn, what: str):
        return call_with_deadline(fn, write_deadline_s(float(self.cfg.run.io_grace_s)), what)

    def topology_record(self) -> dict:
        """The summary's `topology`: Topology.describe(), plus `drained` (cluster -> the round at whose
        start it left) when a cluster was drained, and `history` (every applied join and drain, in
        order: round, kind, cluster; an add-site also `joined`: the round at whose start it took part,
        null if it never did) when there was one; with none, exactly Topology.describe()."""
        drained_at = {f"c{c}": r for c, r in sorted(self.drained.items())}
        history = [
            {
                "round": d.round,
                "kind": str(d.kind),
                "cluster": d.site,
                **({"joined": (self.joined.get(d.id) or {}).get("round")} if d.kind is RequestKind.ADD_SITE else {}),
                **({"abandoned": self.abandoned[d.id].get("round")} if d.id in self.abandoned else {}),
            }
            for d in sorted(map(Outcome.of, self.done.values()), key=lambda d: (d.round, d.id))
            if d.applied and d.kind is not None and d.cluster is not None
        ]  # every join and drain, in order
        return {
            **self.topology.describe(),
            **({"drained": drained_at} if drained_at else {}),
            **({"history": history} if history else {}),
        }

    def _decide_add(self, request: SiteRequest) -> Decision:
        """An add-site's decision (see the module docstring): applied, or refused with its reason."""
        if request.problem:
            return Decision(REFUSED, request.problem, None)
        new = next_cluster(self.topology.clusters, self.done, self.abandoned)
        if self.joining is None and new != self.topology.clusters:  # applied, it would never start
            return Decision(
                REFUSED,
                f"add-site c{new}: it could never start in this run: added site(s) before it "
                f"({', '.join(d.site for d in self.stranded) or '?'}) are not in its topology of "
                f"{self.topology.clusters} cluster(s); resume with them configured to add a site",
                None,
            )
        if self.joining is not None:
            return Decision(
                REFUSED,
                f"add-site c{new}: site c{self.joining.cluster} is still starting; ask again "
                f"once it joined (one site starts at a time)",
                None,
            )
        try:
            nodes, free, need = cluster_resources(self.cfg)
        except Exception as err:  # noqa: BLE001 — Ray's tables unreadable: refused, the run goes on
            return Decision(
                REFUSED,
                f"add-site c{new}: cannot read the Ray cluster's nodes: {type(err).__name__}: {err}".splitlines()[0],
                None,
            )
        from actors.placement import site_strategy

        strategy = site_strategy(self.cfg, request.label)
        problem = add_site_problem(request, nodes=nodes, free=free, need=need, new_cluster=new, strategy=strategy)
        if problem is not None:
            return Decision(REFUSED, problem, None)
        where = f"label {request.label!r}" if request.label is not None else "a placement group of its own"
        return Decision(
            APPLIED,
            f"add-site c{new}: {request.replicas} replica(s) starting ({where}); the site "
            f"joins at the first round's start after all answer up",
            new,
        )

    def _apply(self, request: SiteRequest, round_index: int) -> None:
        if request.kind is RequestKind.ADD_SITE:
            decision = self._decide_add(request)
        else:
            live = {self.topology.cluster_of(rid) for rid in self.roster.live} - set(self.drained)
            floor = int(self.cfg.supervisor.min_replicas_per_cluster)
            decision = decide(
                request,
                clusters=self.topology.clusters,
                drained_clusters=self.drained,
                min_clusters=int(self.cfg.supervisor.min_clusters),
                live_clusters=live,
                holders=round_holders(self.topology, self.roster.live, self.drained, floor),
                committed_round=current_round(self.roster.live.values()),
            )
        # before the effect: applied once (an OSError here leaves it pending, nothing done)
        record = self._io(lambda: mark_done(self.run_dir, request, decision, round_index), "recording a site request")
        self.done[request.id] = record
        if decision.outcome == APPLIED and request.kind is RequestKind.DRAIN:
            self.drained[decision.cluster] = round_index
            self._stop(decision.cluster)
        self._report(record)
        if decision.outcome == APPLIED and request.kind is RequestKind.ADD_SITE:
            self._start(Outcome.of(record))

    def _start(self, record: Outcome) -> None:
        """Start (or, after a supervisor restart, find) the replicas of the applied add-site `record`;
        never waits for them (module docstring: `start`)."""
        from actors.placement import site_options
        from actors.startup import start_replica

        c, n = record.cluster, record.replicas
        if c != self.topology.clusters:  # one site starts at a time: cannot happen unless files were edited
            self._say(f"site {record.site} not started: the next cluster is c{self.topology.clusters}")
            return
        widened = self.topology.with_site(n, label=record.label, name=record.name)
        if self.state is not None:  # fresh indices, durable before any replica reads its own
            self.state.replica_indices.update(dict(widened.index_table))
            self.save()
        backends = self._backends()
        container = OmegaConf.to_container(self.cfg, resolve=True)  # its replicas' config names the site
        container["topology"]["sites"] = widened_sites(list(container["topology"].get("sites") or []), widened)
        options = site_options(
            self.cfg,
            1.0 if "nccl" in backends.values() else 0.0,
            n,
            record.label,
            site_group_name(self.run_id, c),
        )
        members = widened.cluster_members(c)

        def make(rid: str):
            return start_replica(
                container,
                replica_actor_name(self.run_id, rid),
                options[members.index(rid)],
                rid,
                self.run_dir,
                backends,
                index_table=dict(widened.index_table),
                lifetime="detached",
            )

        handles = {rid: lookup(replica_actor_name(self.run_id, rid)) or make(rid) for rid in members}
        self.joining = Joining(record.id, c, widened, handles, make, started=self.clock())

    def _next_queued(self) -> None:
        """Start the next queued site (none while one is starting); a drained one on the way is only
        widened into the topology (it keeps its index; its replicas are never started again)."""
        while self.queued and self.joining is None:
            record = self.queued.pop(0)
            c = record.cluster
            if c != self.topology.clusters:  # one before it was abandoned: it and those after are stranded
                self.stranded += [record, *self.queued]
                self.queued = []
                names = ", ".join(d.site for d in self.stranded)
                self._say(f"site(s) {names} not started: the next cluster is c{self.topology.clusters}")
                return
            if c in self.drained:
                if c == self.topology.clusters:
                    self.topology = self.roster.topology = self.topology.with_site(
                        record.replicas, label=record.label, name=record.name
                    )
                    self._stop(c, now=False)
                continue
            self._start(record)
            if self.resume_round is not None and self.joining is not None:
                self._load_resume_point(self.joining, self.resume_round)

    def _load_resume_point(self, joining: Joining, resume_round: int) -> None:
        """A resumed run's site: each replica the resumed checkpoint holds loads its own state (as the
        driver's replicas do), and the first round's start waits for them up to
        `supervisor.phase_timeout_s`, so the site takes part from the resume round. A manifest not
        read, or a load that fails: that replica heals from the global state when it joins."""
        from hsgd.train import checkpoint

        directory = checkpoint.join_url(
            checkpoint.root_url(self.cfg.checkpoint.dir, self.run_dir), checkpoint.round_dir_name(resume_round)
        )
        try:
            manifest = self._io(lambda: checkpoint.read_manifest(directory), "reading the resumed checkpoint")
        except Exception as err:  # noqa: BLE001 — the site still joins, healed
            self._say(f"site c{joining.cluster}: {directory} not read ({type(err).__name__}: {err}); it heals instead")
            return
        fmt = checkpoint.format_of(manifest)
        joining.loading = {
            rid: handle.load_checkpoint.remote(directory, manifest["files"][rid], None, fmt)
            for rid, handle in joining.handles.items()
            if rid in manifest["files"]
        }
        joining.wait_s = float(self.cfg.supervisor.phase_timeout_s)

    def _backends(self) -> dict:
        """The levels' backends as the run's replicas report them, else as the driver planned them."""
        known = next((info["backends"] for info in self.roster.replica_info.values() if info.get("backends")), None)
        if known:
            return dict(known)
        from hsgd.config.capacity import plan_backends

        plan = plan_backends(self.cfg, [nd for nd in ray.nodes() if nd.get("Alive")])
        return {"inner": plan.inner, "outer": plan.outer}

    def _take_in(self, joining: Joining, round_index: int) -> None:
        """Ask the starting replicas whether they are up (never waiting); once each is up or lost for
        good, the site joins now with those up, if they are at least its floor
        (`supervisor.min_replicas_per_cluster`, or its own `min_replicas`), else it is abandoned."""
        self._ask_up(joining)
        if len(joining.up) + len(joining.lost) < len(joining.handles):
            timeout_s = float(self.cfg.supervisor.join_timeout_s)
            if join_overdue(joining.started, self.clock(), timeout_s):
                self._abandon(
                    joining,
                    round_index,
                    f"not up within supervisor.join_timeout_s={timeout_s:g} s: {len(joining.up)} of "
                    f"{len(joining.handles)} replica(s) up, the others neither answered nor died (not placed?)",
                )
            return
        floor = joining.topology.min_replicas_of(joining.cluster, int(self.cfg.supervisor.min_replicas_per_cluster))
        if len(joining.up) < floor:
            self._abandon(
                joining,
                round_index,
                f"{len(joining.up)} of {len(joining.handles)} replica(s) up, below "
                f"its floor of {floor}: {', '.join(sorted(joining.lost))} died for "
                f"good after {joining.recreated} re-creation(s)",
            )
            return
        roster, name = self.roster, f"c{joining.cluster}"
        for rid, handle in joining.handles.items():  # the identity map first: a successor's roster finds them
            roster.names[rid], roster.handles[rid] = replica_actor_name(self.run_id, rid), handle
            roster.gone.discard(rid)
        roster.gone.update(joining.lost)  # out, as any replica whose restarts are spent
        for rid in joining.lost:  # its deaths before the join were never the run's: no faults, no quarantine
            roster.watch.given_up(roster.names[rid])
        self.save()
        self.joined[joining.request_id] = self._io(
            lambda: mark_joined(self.run_dir, joining.request_id, name, round_index, self.run_id),
            "recording a site's join",
        )
        try:  # run.json lists them too (drills, jobs.diagnose); a failure there costs the join nothing
            self._io(lambda: note_in_run_json(self.run_dir, self.run_id), "listing a site's replicas in run.json")
        except Exception as err:  # noqa: BLE001
            self._say(f"run.json not updated for site {name}: {type(err).__name__}: {err}")
        self.topology = roster.topology = joining.topology
        for rid, answer in sorted(joining.up.items()):
            roster.admit(rid, answer)  # replica_up, with its fresh replica_index
        self.joining = None
        self._next_queued()  # a resumed run's next added site, if any
        seconds = self.clock() - joining.started
        self.log.event(
            "site_up", cluster=name, round=round_index, replicas=sorted(joining.up), seconds=round(seconds, 3)
        )
        without = f"; without {', '.join(sorted(joining.lost))} (died for good)" if joining.lost else ""
        how = (
            "as it left off (the resumed checkpoint)"
            if all(a["round"] >= round_index for a in joining.up.values())
            else "healed from the global state"
        )
        self._say(
            f"site {name} up ({len(joining.up)} replica(s), {seconds:.1f} s after it was applied{without}): "
            f"it joins at round {round_index}'s start, {how}"
        )

    def _ask_up(self, joining: Joining) -> None:
        """One look at the starting replicas, never waiting: an answer up (built, idle) is kept; one
        that died for good (Ray's restarts spent) is created again under its name while the site's
        re-creations last (faults.max_restarts in all), else it is lost; any other failure (restarting,
        no answer yet) is asked again at the next round's start."""
        wait_s, joining.wait_s = joining.wait_s, 0.0
        self._loaded(joining, wait_s)
        for rid, handle in joining.handles.items():
            if rid not in joining.up and rid not in joining.lost and rid not in joining.asked | joining.loading:
                joining.asked[rid] = handle.progress.remote()
        refs = list(joining.asked.values())
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=wait_s, fetch_local=False)[0]) if refs else set()
        for rid, ref in list(joining.asked.items()):
            if ref not in ready:
                continue
            del joining.asked[rid]
            try:
                answer = ray.get(ref, timeout=1.0)
            except Exception:  # noqa: BLE001 — died: for good, or restarting (asked again next round)
                if restarts_exhausted(joining.handles[rid]):
                    self._recreate(joining, rid)
                continue
            if answer.get("phase", "idle") == "idle" and not answer.get("spare"):
                joining.up[rid] = answer

    def _loaded(self, joining: Joining, wait_s: float) -> None:
        """Resume loads done (waited for up to wait_s): their replicas may be asked whether they are
        up; one that failed heals from the global state when it joins."""
        refs = list(joining.loading.values())
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=wait_s, fetch_local=False)[0]) if refs else set()
        for rid, ref in list(joining.loading.items()):
            if ref in ready:
                del joining.loading[rid]
                try:
                    ray.get(ref, timeout=1.0)
                except Exception as err:  # noqa: BLE001 — its own failure (or death: seen when asked)
                    self._say(
                        f"site c{joining.cluster}: {rid} did not load the resumed checkpoint "
                        f"({type(err).__name__}); it heals from the global state"
                    )

    def _recreate(self, joining: Joining, rid: str) -> None:
        """rid died for good before it was up: a new actor under its name, or lost once the site's
        re-creations are spent (a failed creation spends one too)."""
        bound = int(self.cfg.faults.max_restarts)
        if joining.recreated >= bound:
            joining.lost.add(rid)
            self._say(
                f"site c{joining.cluster}: {rid} died for good before it was up; the site's {bound} "
                f"re-creation(s) are spent, it joins without it if enough are up"
            )
            return
        joining.recreated += 1
        self._say(
            f"site c{joining.cluster}: {rid} died for good before it was up; started again under its name "
            f"(re-creation {joining.recreated} of {bound})"
        )
        try:
            joining.handles[rid] = joining.make(rid)
        except Exception as err:  # noqa: BLE001 — the name still held, no room: the next look tries again
            self._say(f"site c{joining.cluster}: {rid} not started again: {type(err).__name__}: {err}")

    def _abandon(self, joining: Joining, round_index: int, reason: str) -> None:
        """Give the site up: its replicas and placement group stopped first, then `<id>.abandoned`
        (a supervisor restarted in between starts it again: a fresh try); a later add-site may go on.
        Nothing of the other sites is touched."""
        from actors.placement import release_site_group

        name = f"c{joining.cluster}"
        for handle in joining.handles.values():
            with contextlib.suppress(Exception):  # already gone: stopped all the same
                ray.kill(handle, no_restart=True)
        release_site_group(self.run_id, joining.cluster)
        self.abandoned[joining.request_id] = self._io(
            lambda: mark_abandoned(self.run_dir, joining.request_id, name, round_index, reason, self.run_id),
            "recording an abandoned site",
        )
        self.joining = None
        self._next_queued()  # (a resumed run's later site: started only if its index is now the next)
        self.log.event("site_abandoned", cluster=name, round=round_index, reason=reason)
        self._say(f"site {name} abandoned at round {round_index}'s start: {reason}; a new add-site may be asked")

    def _adopt(self, cluster: int) -> None:
        """A joined site after a supervisor restart: its ids are in the identity map (saved before it
        joined); an id missing there (an older state) gets the name the site's replicas were started under."""
        roster = self.roster
        for rid in self.topology.cluster_members(cluster):
            if rid not in roster.names:
                roster.names[rid] = replica_actor_name(self.run_id, rid)
            if roster.handles.get(rid) is None:
                roster.handles[rid] = lookup(roster.names[rid])
                if roster.handles[rid] is None:
                    roster.gone.add(rid)

    def _note_commits(self, round_index: int) -> None:
        """`site_committed`, once per joined site: at the first round's start where a member of it
        holds a round after the one it joined at (it took part in that commit)."""
        for record in applied_sites(self.done):
            name, joined_at = record.site, (self.joined.get(record.id) or {}).get("round")
            if joined_at is None or name in self.committed or record.cluster >= self.topology.clusters:
                continue
            members = [
                rid
                for rid in self.topology.cluster_members(record.cluster)
                if self.roster.live.get(rid, (-1, 0))[0] > joined_at and self.roster.live[rid][0] >= round_index
            ]
            if members:
                self.committed.add(name)
                self.log.event("site_committed", cluster=name, round=round_index - 1, replicas=members)
                self._say(f"site {name} committed round {round_index - 1} with the others")

    def _say(self, line: str) -> None:
        with contextlib.suppress(Exception):  # a console that fails must not stop the run
            print(f"[hsgd] {line}", file=sys.stderr, flush=True)

    def _stop(self, cluster: int, *, now: bool = True) -> None:
        """Stop cluster's replicas and spares for good, none of it counted as a failure. `now=False`
        (the constructor): set aside at once, killed at the first round's start (`_stop_set_aside`),
        since a resumed run's driver still has its start-up calls in flight to the actors it started
        for the drained site (killing them there fails those calls, and the start)."""
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
        """Kill the set-aside actors, then release their sites' placement groups (issue 45, finding 9: the
        room goes back to the Ray cluster, e.g. for an add-site in the drained site's place)."""
        from actors.placement import release_site_group

        for handle in self.to_stop:
            if handle is not None:
                with contextlib.suppress(Exception):  # already gone: stopped all the same
                    ray.kill(handle, no_restart=True)
        for cluster in self.to_release:
            release_site_group(self.run_id, cluster)
        self.to_stop, self.to_release = [], []

    def _report(self, record: dict) -> None:
        self.log.event(
            "site_request",
            id=record.get("id"),
            kind=record.get("kind"),
            cluster=record.get("cluster"),
            outcome=record.get("outcome"),
            reason=record.get("reason"),
            round=record.get("round"),
        )
        with contextlib.suppress(Exception):  # a console that fails must not stop the run
            print(
                f"[hsgd] site request {record.get('id')}: {record.get('outcome')} at round {record.get('round')}: "
                f"{record.get('reason')}",
                file=sys.stderr,
                flush=True,
            )
