"""What the supervisor knows and decides about site changes over a run (docs/sites.md, "Sites that
come and go"), pure: the request files and their records are hsgd/core/site_requests.py, the rules
each request is decided by hsgd/core/site_rules.py; actors/site_changes.py carries the decisions out.

Protocol (one site starts at a time, so every new site is the next index, c<K>):
    drain     applied at round r's start: the outcome written, then c's replicas and spares stopped
              with no restart. No failure: no `replica_down`, fault, restart or quarantine follows.
    start     an applied add-site: its outcome written, its ids' fresh global indices saved, then its
              replicas started DETACHED; nothing waits, the round in flight goes on.
    up        at each round's start its replicas are asked without waiting (`JoinProgress`); once ALL
              are up or lost it joins: `<id>.joined`, run.json, the topology widened, `site_up`.
    lost      a new replica dead for good before it is up is created again, at most
              faults.max_restarts times for the site; then the site joins with those up if they keep
              its floor, else it is abandoned: stopped, `<id>.abandoned`, `site_abandoned`.
    deadline  not all up (or lost) within supervisor.join_timeout_s: abandoned the same way.
    resume    a resumed run starts every applied site neither drained nor abandoned again, in the
              order added (`SitePlan.next_queued`); one past a gap is stranded, never started.
    restart   a restarted supervisor builds its topology with every joined site (`SiteLedger`), finds
              its actors by name, and decides no request at the first round's start it sees.

Failure cases: every refusal is one line in the `site_request` event (hsgd/core/site_rules.py); a
site that cannot join is abandoned, never retried in this run or a resumed one; Ray's tables
unreadable refuse the add-site (`decide_add`), the run goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hsgd.core.site_requests import (
    Decision,
    Outcome,
    RequestKind,
    SiteRequest,
    abandoned,
    drained,
    joined,
    mark_abandoned,
    mark_done,
    mark_joined,
    outcomes,
)
from hsgd.core.site_rules import decide_add, decide_drain, join_overdue, next_cluster
from hsgd.core.site_topology import applied_sites, joined_topology, site_queue, stranded_notice
from hsgd.core.topology import Topology
from hsgd.record.run_info import widen_replicas


@dataclass
class SiteLedger:
    """The run folder's record of site requests as one supervisor (of run `run_id`) reads and writes it."""

    done: dict[str, dict]  # request id -> its outcome record (`<id>.done`)
    joined: dict[str, dict]  # request id -> its join in this run (`<id>.joined`)
    abandoned: dict[str, dict]  # request id -> given up before it joined (`<id>.abandoned`)
    drained: dict[int, int]  # cluster -> the round at whose start it left
    run_dir: str | Path = ""
    run_id: str = ""

    @classmethod
    def read(cls, run_dir: str | Path, run_id: str) -> SiteLedger:
        """One directory check when no request was ever decided."""
        done = outcomes(run_dir)
        if not done:
            return cls({}, {}, {}, {}, run_dir, run_id)
        return cls(done, joined(run_dir, run_id), abandoned(run_dir), drained(done), run_dir, run_id)

    def applied_sites(self) -> list[Outcome]:
        return applied_sites(self.done)

    def write_done(self, request: SiteRequest, decision: Decision, round_index: int) -> dict:
        """`mark_done`, then the ledger holds it (an applied drain's cluster drained from its round)."""
        record = self.done[request.id] = mark_done(self.run_dir, request, decision, round_index)
        d = Outcome.of(record)
        if d.applied_as(RequestKind.DRAIN):
            self.drained.setdefault(d.cluster, d.round)
        return record

    def write_joined(self, site: JoinProgress, round_index: int) -> None:
        self.joined[site.request_id] = mark_joined(self.run_dir, site.request_id, site.name, round_index, self.run_id)

    def note_in_run_json(self) -> None:
        """run.json's `replicas` widened by the sites joined so far (`replica_ids`): written by the
        supervisor at each join; the driver writes it last at the run's end, the same way."""
        widen_replicas(self.run_dir, self.run_id, self.replica_ids)

    def write_abandoned(self, site: JoinProgress, round_index: int, reason: str) -> None:
        record = mark_abandoned(self.run_dir, site.request_id, site.name, round_index, reason, self.run_id)
        self.abandoned[site.request_id] = record

    def topology(self, base: Topology) -> Topology:
        """`base` widened by the sites that joined in this run or were drained (`joined_topology`)."""
        return joined_topology(base, self.done, self.joined, self.drained, self.abandoned)

    def queue(self, clusters: int) -> tuple[list[Outcome], list[Outcome]]:
        return site_queue(clusters, self.done, self.abandoned)

    def stranded_notice(self, clusters: int) -> str | None:
        return stranded_notice(clusters, self.done, self.abandoned, self.drained)

    def replica_ids(self, replicas: list[str]) -> list[str]:
        """`replicas` (the driver's ids) and every id of a site that joined in this run, in the order they came."""
        ids = list(replicas)
        for d in self.applied_sites():
            if d.id in self.joined and d.id not in self.abandoned:
                ids += [f"{d.site}r{i}" for i in range(d.replicas) if f"{d.site}r{i}" not in ids]
        return ids

    def record(self, topology: Topology) -> dict:
        """The summary's `topology`: Topology.describe(), plus `drained` (cluster -> the round at whose
        start it left) when a cluster was drained, and `history` (every applied join and drain, in
        order: round, kind, cluster; an add-site also `joined`: the round at whose start it took part,
        null if it never did, and `abandoned` for one given up) when there was one."""
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
        ]
        return {
            **topology.describe(),
            **({"drained": drained_at} if drained_at else {}),
            **({"history": history} if history else {}),
        }

    def commits_due(
        self, topology: Topology, committed: set, live: dict[str, tuple[int, int]], round_index: int
    ) -> list[tuple[str, list[str]]]:
        """(site, members) for each joined site not yet `site_committed` whose members hold a round
        after the one it joined at, at round `round_index`'s start (they took part in that commit)."""
        due = []
        for d in self.applied_sites():
            joined_at = (self.joined.get(d.id) or {}).get("round")
            if joined_at is None or d.site in committed or d.cluster >= topology.clusters:
                continue
            members = [
                rid
                for rid in topology.cluster_members(d.cluster)
                if live.get(rid, (-1, 0))[0] > joined_at and live[rid][0] >= round_index
            ]
            if members:
                due.append((d.site, members))
        return due


def is_up(answer: dict) -> bool:
    """A starting replica's progress answer that says it is up: built and idle, not a spare."""
    return answer.get("phase", "idle") == "idle" and not answer.get("spare")


@dataclass
class JoinProgress:
    """An applied site whose replicas were started and are not all up yet: what is known of them."""

    request_id: str
    cluster: int
    topology: Topology  # the run's topology with it
    started: float = 0.0  # when it was started (or found by a restarted supervisor), monotonic seconds
    up: dict = field(default_factory=dict)  # rid -> its progress answer (`is_up`)
    lost: set = field(default_factory=set)  # rids dead for good once the site's re-creations were spent
    recreated: int = 0  # re-creations so far, for the whole site (at most faults.max_restarts)

    @property
    def name(self) -> str:
        return f"c{self.cluster}"

    @property
    def members(self) -> list[str]:
        return self.topology.cluster_members(self.cluster)

    def verdict(self, *, default_floor: int, now: float, timeout_s: float) -> tuple[str, str]:
        """("wait", ""), ("join", ""), or ("abandon", its reason in one line): it joins once each
        replica is up or lost, with those up if they keep its floor; it is abandoned below its floor,
        or when not all are up or lost `timeout_s` (supervisor.join_timeout_s) after it started."""
        n, up = len(self.members), len(self.up)
        if up + len(self.lost) < n:
            if join_overdue(self.started, now, timeout_s):
                return "abandon", (
                    f"not up within supervisor.join_timeout_s={timeout_s:g} s: {up} of {n} replica(s) up, "
                    f"the others neither answered nor died (not placed?)"
                )
            return "wait", ""
        floor = self.topology.min_replicas_of(self.cluster, default_floor)
        if up < floor:
            return "abandon", (
                f"{up} of {n} replica(s) up, below its floor of {floor}: {', '.join(sorted(self.lost))} died "
                f"for good after {self.recreated} re-creation(s)"
            )
        return "join", ""

    def answered(self, rid: str, answer: dict) -> None:
        """A starting replica's progress answer: kept when it says it is up (`is_up`)."""
        if is_up(answer):
            self.up[rid] = answer

    def dead_for_good(self, rid: str, bound: int) -> tuple[bool, str]:
        """`rid` died for good before it was up: (start it again under its name?, the console line).
        The site's re-creations are `bound` (faults.max_restarts) in all; once spent, rid is lost."""
        if self.recreated >= bound:
            self.lost.add(rid)
            return False, (
                f"site {self.name}: {rid} died for good before it was up; the site's {bound} re-creation(s) "
                f"are spent, it joins without it if enough are up"
            )
        self.recreated += 1
        return True, (
            f"site {self.name}: {rid} died for good before it was up; started again under its name "
            f"(re-creation {self.recreated} of {bound})"
        )

    def up_line(self, round_index: int, seconds: float) -> str:
        """The console line of its join at round `round_index`'s start."""
        without = f"; without {', '.join(sorted(self.lost))} (died for good)" if self.lost else ""
        how = (
            "as it left off (the resumed checkpoint)"
            if all(a["round"] >= round_index for a in self.up.values())
            else "healed from the global state"
        )
        return (
            f"site {self.name} up ({len(self.up)} replica(s), {seconds:.1f} s after it was applied{without}): "
            f"it joins at round {round_index}'s start, {how}"
        )


@dataclass(frozen=True)
class RequestReport:
    """A decided request's `site_request` event fields (its outcome record as written) and console line."""

    id: str | None
    kind: str | None
    cluster: str | None
    outcome: str | None
    reason: str | None
    round: int | None

    @classmethod
    def of(cls, record: dict) -> RequestReport:
        return cls(*(record.get(k) for k in ("id", "kind", "cluster", "outcome", "reason", "round")))

    @property
    def line(self) -> str:
        return f"site request {self.id}: {self.outcome} at round {self.round}: {self.reason}"


@dataclass
class SitePlan:
    """What one supervisor knows and decides about site changes; actors/site_changes.py carries each
    decision out and tells it what happened (`ledger.note`, `joining`, `topology`)."""

    ledger: SiteLedger
    topology: Topology  # the run's now
    min_clusters: int  # supervisor.min_clusters
    default_floor: int  # supervisor.min_replicas_per_cluster
    queued: list[Outcome] = field(default_factory=list)  # applied sites to start, in the order added
    stranded: list[Outcome] = field(default_factory=list)  # applied sites this run can never start
    joining: JoinProgress | None = None  # the site starting now (one at a time)
    committed: set = field(default_factory=set)  # sites logged `site_committed`

    @classmethod
    def read(cls, run_dir: str | Path, run_id: str, topology: Topology, supervisor) -> SitePlan:
        """`supervisor`: the run's supervisor settings (min_clusters, min_replicas_per_cluster)."""
        ledger = SiteLedger.read(run_dir, run_id)
        queued, stranded = ledger.queue(topology.clusters)
        floors = int(supervisor.min_clusters), int(supervisor.min_replicas_per_cluster)
        return cls(ledger, topology, *floors, queued=queued, stranded=stranded)

    def unlogged(self, events: list[dict]) -> list[dict]:
        """A successor's view of the events logged so far (it keeps the sites already committed): the
        decided records whose `site_request` event was never logged (the predecessor died first)."""
        logged = {e.get("id") for e in events if e.get("event") == "site_request"}
        self.committed = {e.get("cluster") for e in events if e.get("event") == "site_committed"}
        return [r for r in self.ledger.done.values() if r.get("id") not in logged]

    def adopted(self) -> list[int]:
        """The applied sites already in the topology (joined in this run, or a config's cluster at their index)."""
        return [
            d.cluster
            for d in self.ledger.applied_sites()
            if d.id not in self.ledger.abandoned and d.cluster < self.topology.clusters
        ]

    def decide(self, request: SiteRequest, *, live: dict, resources: Callable, strategy: str) -> Decision:
        """`request`'s decision now (`decide_add`, `decide_drain`)."""
        if request.kind is RequestKind.ADD_SITE:
            return decide_add(
                request,
                new=next_cluster(self.topology.clusters, self.ledger.done, self.ledger.abandoned),
                clusters=self.topology.clusters,
                starting=None if self.joining is None else self.joining.cluster,
                stranded=self.stranded,
                resources=resources,
                strategy=strategy,
            )
        return decide_drain(
            request,
            topology=self.topology,
            live=live,
            drained_clusters=self.ledger.drained,
            min_clusters=self.min_clusters,
            default_floor=self.default_floor,
        )

    def next_queued(self) -> tuple[str, Outcome] | None:
        """The next queued site and what becomes of it, while none is starting: "start" it; "widen":
        the topology took it in (a drained one keeps its index, never started again); "strand": its
        index is not the next (a site before it was abandoned): it and those after it never start.
        None: nothing to do."""
        if not self.queued or self.joining is not None:
            return None
        record = self.queued.pop(0)
        if record.cluster != self.topology.clusters:
            self.stranded += [record, *self.queued]
            self.queued = []
            return "strand", record
        if record.cluster in self.ledger.drained:
            self.topology = self.topology.with_site(record.replicas, label=record.label, name=record.name)
            return "widen", record
        return "start", record

    def commits_due(self, live: dict[str, tuple[int, int]], round_index: int) -> list[tuple[str, list[str]]]:
        """`SiteLedger.commits_due`, each once: the sites returned count as committed."""
        due = self.ledger.commits_due(self.topology, self.committed, live, round_index)
        self.committed.update(name for name, _ in due)
        return due


def topology_of_run(configured: Topology, run_dir: str | Path, run_id: str) -> Topology:
    """The run's topology now: the config's (`configured`, with the ids' indices kept so far), widened by every
    site that joined in this run or was drained (a restarted supervisor's), up to the first other one
    (`SitePlan` starts it again)."""
    return SiteLedger.read(run_dir, run_id).topology(configured)


def resume_notice(run_dir: str | Path, clusters: int) -> str | None:
    """The driver of a resumed run whose config has `clusters` clusters, before any actor starts: one line
    when an added site cannot start in this run (`stranded_notice`), else None."""
    return SiteLedger.read(run_dir, "").stranded_notice(clusters)


def with_joined_replicas(run_dir: str | Path, run_id: str, replicas: list[str]) -> list[str]:
    """run.json's `replicas` (the ids the driver started) and every id of a site that joined in run
    `run_id`: how drills, `jobs.diagnose` and `jobs.status` find a site added mid-run's actors."""
    return SiteLedger.read(run_dir, run_id).replica_ids(replicas)
