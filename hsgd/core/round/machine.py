"""The round machine's state, what it is asked (start, observe, tick: each takes `now`, it reads no
clock) and how each observation is taken in; __init__.py has the failure table."""

from __future__ import annotations

import itertools
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hsgd.core.deadlines import PhaseClock, collective_timeout_s, heal_deadline_s, state_bytes_bound
from hsgd.core.membership import Plan
from hsgd.core.outer_plan import holds_outer_group
from hsgd.core.phases import Phase as PhaseName
from hsgd.core.round.balance import fragment_delay_of
from hsgd.core.round.calls import CallBook, InFlight
from hsgd.core.round.close import RoundClose
from hsgd.core.round.cluster import ClusterPhases
from hsgd.core.round.liveness import Liveness
from hsgd.core.round.messages import (
    Answer,
    Call,
    CallKind,
    ClusterStage,
    Effect,
    ErrorKind,
    Lost,
    NonFinite,
    Observation,
    Outcome,
    OuterStage,
    Phase,
    PhaseEnded,
    Progress,
    StateReady,
    Up,
)
from hsgd.core.round.outer import OuterExchange
from hsgd.core.topology import Topology


@dataclass
class RoundSettings:
    steps_per_round: int
    inner: str = "ddp"
    outer: str = "diloco"
    min_replicas_per_cluster: int = 1
    min_clusters: int = 1
    max_reforms: int = 25  # per cluster (and for the outer exchange) per round: then the run fails
    inner_every: int = 1  # localsgd: members may only yield at a sync boundary
    # a yield boundary lies this far past a member's step as last seen (extrapolated to now): the
    # age of that sign (the progress board writes at most every 0.5 s) and the request's travel
    yield_lead_s: float = 1.0
    rejoin: str = "fast"  # fast: restarted replicas join inside the round | boundary: at the next round
    # deadlines in seconds (round_settings scales them; liveness.py says what each bounds)
    step_deadline_s: float = 60.0
    group_grace_s: float = 15.0
    presumed_dead_s: float = 0.5  # a peer whose connection closed, before Ray's death notice (~1.5 s)
    configure_s: float = 40.0  # joining a group: the allowance before a forming call's first step
    heal_s: float = 60.0
    outer_s: float = 120.0
    commit_s: float = 60.0
    outer_path: str = "leader"  # leader | sharded (hsgd/core/outer_plan.py)
    fragment_delay: int = 0  # > 0: holders reduce behind the round's last inner steps
    # sync.balance=steps: this round's inner steps per cluster (hsgd/core/round/balance.py); () = steps_per_round
    cluster_steps: tuple[int, ...] = ()
    cluster_step_deadline_s: tuple[float, ...] = ()  # per cluster, from its own learned step time; () = step_deadline_s
    cluster_step_s: tuple[float | None, ...] = ()  # per cluster, its learned seconds per step (None: not seen yet)
    # sync.balance=time (close.py): the inner phases close this long after the round's start (None: no
    # close, every cluster runs its steps); a cluster not ready by the close plus late_grace_s is late
    close_s: float | None = None
    late_grace_s: float = 10.0
    min_round_steps: int = 1  # a cluster that stopped before this many steps is late too

    def steps_of(self, cluster: int) -> int:
        return self.cluster_steps[cluster] if self.cluster_steps else self.steps_per_round

    def snapshot_steps_of(self, cluster: int, reached: int) -> int:
        """The steps a cluster's pseudo-gradient holds when its members reached `reached`: under
        sync.fragment_delay it is taken that many steps (clamped to the plan) before the round's end."""
        if not self.fragment_delay:
            return reached
        every = self.inner_every if self.inner == "localsgd" else 1
        return max(
            0,
            min(
                reached, self.steps_of(cluster) - fragment_delay_of(self.fragment_delay, self.steps_of(cluster), every)
            ),
        )

    def step_deadline_of(self, cluster: int) -> float:
        return self.cluster_step_deadline_s[cluster] if self.cluster_step_deadline_s else self.step_deadline_s


def round_settings(
    *,
    steps_per_round: int,
    sync: Any,
    supervisor: Any,
    comm: Any,
    param_bytes: int,
    clock: PhaseClock,
    cluster_steps: tuple[int, ...] = (),
    clusters: int = 0,
    close_s: float | None = None,
) -> RoundSettings:
    """The next round's settings from the config's sections (read by attribute): every deadline scaled
    to the work it bounds, bytes (of `param_bytes`) at comm.min_gbps for what moves state, the run's
    learned phase times for what computes (a round follows what the ones before measured).
    `cluster_steps`: sync.balance's plan; with it, each of the `clusters` learns its own step deadline.
    `close_s`: sync.balance=time's close (balance.close_after_s), with sync.grace_s and min_round_steps."""
    # a healthy member leaves a broken collective within its (payload-scaled) timeout
    grace = collective_timeout_s(comm.timeout_s, param_bytes, comm.min_gbps) + 5.0
    heal_s = heal_deadline_s(
        call_timeout_s=supervisor.call_timeout_s,
        configure_timeout_s=comm.configure_timeout_s,
        timeout_s=comm.timeout_s,
        state_bytes=state_bytes_bound(param_bytes),
        min_gbps=comm.min_gbps,
    )
    return RoundSettings(
        steps_per_round=steps_per_round,
        inner=sync.inner,
        outer=sync.outer,
        outer_path=sync.outer_path,
        fragment_delay=sync.fragment_delay,
        inner_every=sync.inner_every,
        rejoin=supervisor.rejoin,
        min_replicas_per_cluster=supervisor.min_replicas_per_cluster,
        min_clusters=supervisor.min_clusters,
        step_deadline_s=clock.deadline("inner_step", 1),
        group_grace_s=grace,
        cluster_steps=tuple(cluster_steps),
        cluster_step_deadline_s=tuple(clock.deadline(f"inner_step/c{c}", 1) for c in range(clusters))
        if cluster_steps
        else (),
        cluster_step_s=tuple(clock.median(f"inner_step/c{c}", None) for c in range(clusters)),
        close_s=close_s,
        **({"late_grace_s": sync.grace_s, "min_round_steps": sync.min_round_steps} if close_s is not None else {}),
        # a closed connection means the peer's process is gone; only Ray's own
        # notice (which names the cause) is worth a short wait — nothing is killed
        presumed_dead_s=max(0.25, clock.median("inner_step", 0.5)),
        # the rendezvous, then the backend's connect among members known present
        # (hsgd.train.comm.LevelGroup.connect_timeout_s), then a margin
        configure_s=comm.configure_timeout_s + min(comm.timeout_s, comm.configure_timeout_s) + 5.0,
        heal_s=heal_s,
        # the learned time of the exchange (the ceiling until it was seen), plus the
        # grace a member needs to leave a broken collective; never past phase_timeout_s
        outer_s=min(supervisor.phase_timeout_s, clock.deadline("outer", 1) + grace),
        commit_s=min(supervisor.phase_timeout_s, clock.deadline(PhaseName.OUTER_COMMIT, 1) + grace),
    )


@dataclass
class ClusterState:
    stage: ClusterStage = ClusterStage.NEW
    members: tuple[str, ...] = ()
    configured: tuple[int, tuple[str, ...]] | None = None  # (epoch, members) of its standing inner group
    phase_id: int | None = None  # the phase it waits on
    reforms: int = 0


class RoundMachine(ClusterPhases, OuterExchange, Liveness, RoundClose):
    """Drives one round. Feed it `start`, then `observe` (or `observe_all`) and `tick` with the
    supervisor's clock; carry out every effect it returns. `done` is set once `outcome` is one of
    committed | restore | failed | below_quorum; `reason` says why for the last three."""

    def __init__(
        self,
        topology: Topology,
        settings: RoundSettings,
        round_index: int,
        *,
        progress: dict[str, tuple[int, int]],
        leaders: dict[int, str],
        epoch: int,
        committed_round: int,
        configured: dict[int, tuple[int, tuple[str, ...]]] | None = None,
        outer_configured: tuple[int, tuple[tuple[str, ...], ...]] | None = None,
        benched: Iterable[int] = (),
        non_finite_rounds: Mapping[int, int] | None = None,
        closed_at: Mapping[int, int] | None = None,
        late: Iterable[int] = (),
    ):
        self.topology, self.settings, self.round = topology, settings, round_index
        self.progress = dict(progress)  # live replicas only: rid -> committed (round, step)
        self.incarnations: dict[str, int] = {}  # rid -> the incarnation last seen up, this round
        self.leaders, self.epoch, self.committed_round = dict(leaders), epoch, committed_round
        self.ids = tuple(tuple(topology.cluster_members(c)) for c in range(topology.clusters))
        self.cluster_index = {rid: c for c, ids in enumerate(self.ids) for rid in ids}
        self.clusters = {c: ClusterState(configured=(configured or {}).get(c)) for c in range(topology.clusters)}
        # (epoch, shard holders): shard j -> its holder per cluster in outer-rank order, of the
        # standing outer groups (one shard, the leaders, on the `leader` path)
        self.outer_configured = outer_configured
        self.exchange: tuple[tuple[int, ...], tuple[tuple[str, ...], ...]] = (
            (),
            (),
        )  # (clusters, groups) of the exchange in flight
        self.outer_stage, self.outer_attempts = OuterStage.WAIT, 0
        self.calls = CallBook()
        self.dead: dict[str, str] = {}  # rid -> cause, this round
        self.deaths: list[tuple[str, str]] = []  # every death this round, in order (a rid may die twice)
        self.advance: dict[str, tuple[int, float]] = {}  # rid -> (step, when) of its last sign of progress
        self.committed_by: set[str] = set()
        self.joining: dict[int, dict[str, tuple[int, int]]] = {}  # cluster -> replicas up mid-round
        self.yielding: dict[int, int] = {}  # cluster -> step_in_round its members yield at
        # sync.balance=time (close.py): when the round started, whether it closed, the step each
        # cluster was asked to yield at by the close, the step a run started after it ends at, the
        # late clusters (-> why) and their members whose calls were given up on
        self.started_at: float | None = None
        self.closed = closed_at is not None  # (a restarted supervisor's: the close it found recorded)
        self.closing: dict[int, int] = {int(c): int(s) for c, s in (closed_at or {}).items()}
        self.ends: dict[int, int] = dict(self.closing)
        self.late: dict[int, str] = dict.fromkeys(map(int, late), "late (recorded by the supervisor before)")
        self.late_members: set[str] = set()
        self.done, self.outcome, self.reason = False, "", ""
        # non-finite numbers (see the failure table), carried from round to round by the caller:
        # clusters that sit out until the run's end, and the last round each cluster was void in
        # (keys may come back from JSON as strings)
        self.benched: set[int] = {int(c) for c in benched}
        self.non_finite_rounds: dict[int, int] = {int(c): int(r) for c, r in (non_finite_rounds or {}).items()}
        self.void: dict[int, NonFinite] = {}  # cluster -> why its round is void, this round
        self.benched_now: dict[int, str] = {}  # cluster -> why it was benched, this round
        self._ids = itertools.count()  # phase ids
        # cluster -> its latest inner step times (yield boundaries; clusters may differ in speed)
        self.step_seconds: defaultdict[int, deque[float]] = defaultdict(lambda: deque(maxlen=20))

    # -- queries --------------------------------------------------------------------------------------
    def members(self, cluster: int) -> tuple[str, ...]:
        """The cluster's live members."""
        return tuple(rid for rid in self.ids[cluster] if rid in self.progress)

    @property
    def out(self) -> set[int]:
        """The clusters sitting the round out."""
        return {c for c, st in self.clusters.items() if st.stage is ClusterStage.OUT}

    @property
    def not_ready(self) -> bool:
        """A participating cluster is not ready for the outer exchange yet."""
        return not all(st.stage.waits_for_outer for st in self.clusters.values())

    def floor(self, cluster: int) -> int:
        """The live members cluster `cluster` needs to take part (its site's own, else the run's)."""
        return self.topology.min_replicas_of(cluster, self.settings.min_replicas_per_cluster)

    def participating(self) -> list[int]:
        return [c for c, st in self.clusters.items() if st.stage is not ClusterStage.OUT]

    def plan(self) -> Plan:
        """The membership view for fault targeting and status (leaders of participating clusters)."""
        members = {c: m for c in self.participating() if (m := self.members(c))}
        return Plan(self.epoch, members, {c: self.leaders[c] for c in members if c in self.leaders})

    def configured_groups(self) -> dict[int, tuple[int, tuple[str, ...]]]:
        return {c: st.configured for c, st in self.clusters.items() if st.configured is not None}

    def pending(self, phase_id: int) -> set[str]:
        """The members of a phase in flight that have not answered (and were not given up on)."""
        flight = self.calls.inflight.get(phase_id)
        return set(flight.pending) if flight is not None else set()

    def cluster_of(self, rid: str) -> int:
        return self.cluster_index[rid]

    @property
    def view_phase(self) -> str:
        """The round's phase as status.json shows it: the outer exchange's step once it runs,
        else `inner` while any cluster runs inner, else the first participating cluster's stage."""
        if self.outer_stage in (OuterStage.REDUCE, OuterStage.COMMIT):
            return PhaseName.OUTER if self.outer_stage is OuterStage.REDUCE else PhaseName.OUTER_COMMIT
        stages = {self.clusters[c].stage for c in self.participating()}
        return "inner" if ClusterStage.INNER in stages else str(min(stages)) if stages else "idle"

    def probes(self, *, idle: bool, gone) -> list[tuple[str, str]]:
        """What the runner asks whom on the control channel: `progress` of those in run_inner; `up`
        of those down and not `gone` (rejoin `fast`; a call to a restarting actor waits until it is
        up); with `idle`, `idle` of live replicas with no call in flight."""
        want = [
            ("progress", rid)
            for f in self.calls.inflight.values()
            if f.phase.kind is CallKind.RUN_INNER
            for rid in f.pending
        ]
        if self.settings.rejoin == "fast":
            want += [("up", rid) for ids in self.ids for rid in ids if rid not in self.progress and rid not in gone]
        if idle:  # (a late member is busy with its abandoned call: the runner watches that call)
            want += [
                ("idle", rid) for rid in self.progress if rid not in self.calls.busy and rid not in self.late_members
            ]
        return want

    # -- the round's start ----------------------------------------------------------------------------
    def start(self, now: float) -> list[Effect]:
        self.started_at = now
        if not self.progress:
            return self._finish("below_quorum", "no live replica")
        if not any(p[0] >= self.committed_round for p in self.progress.values()):
            top = max(self.progress.values())[0]
            return self._finish(
                "restore",
                f"total loss: no live replica holds committed round {self.committed_round} "
                f"(best: {top if top >= 0 else 'none'})",
            )
        r = self.round
        if not any(p[0] == r for p in self.progress.values()) and any(
            len(self.members(c)) >= max(1, self.floor(c)) for c in range(self.topology.clusters)
        ):
            # nobody holds the round asked for: a caller's error, never a stall
            return self._finish("failed", f"round {r} asked, but no live replica holds it")
        effects: list[Effect] = []
        for c in range(self.topology.clusters):
            members = self.members(c)
            if c in self.benched or c in self.late or len(members) < max(1, self.floor(c)):
                # benched (non-finite in two rounds running): it sits out until the run's end; late (recorded)
                self.clusters[c].stage, self.clusters[c].members = ClusterStage.OUT, members
                continue
            effects += self._reform(c, now, "round start", members=members)
        return self._lost_quorum() if len(self.participating()) < self.settings.min_clusters else effects

    # -- observations ---------------------------------------------------------------------------------
    def observe(self, observation: Observation, now: float) -> list[Effect]:
        if isinstance(observation, Answer):
            return self._answer(observation, now)
        if isinstance(observation, Progress):
            return self._progress(observation, now)
        if isinstance(observation, Up):
            return self._up(observation, now)
        if isinstance(observation, Lost):
            return self._lost(observation.rid, now, observation.cause)
        if isinstance(observation, StateReady):
            flight = self.calls.inflight.get(observation.phase_id)
            if flight is not None:
                flight.delivered.add(observation.source)
            return []
        raise TypeError(f"not an observation: {observation!r}")

    def observe_all(self, observations: Iterable[Observation], now: float) -> list[Effect]:
        """Observations in the order they arrived (everything one wait returned)."""
        return [effect for observation in observations for effect in self.observe(observation, now)]

    def _answer(self, answer: Answer, now: float) -> list[Effect]:
        """An answer to a call in flight. A stale one (its phase was given up on: the cluster
        re-formed, the replica was killed) is ignored."""
        outcome = Outcome(answer.outcome)
        how = outcome.value if outcome in (Outcome.DONE, Outcome.YIELDED) else f"{outcome.value}: {answer.detail[:200]}"
        flight = self.calls.take(answer.phase_id, answer.rid, how)
        if flight is None:
            return []
        rid = answer.rid
        # rid is live unless it died this round while this call was in flight (a heal source killed
        # while busy elsewhere)
        if answer.round >= 0 and rid not in self.dead:
            self.progress[rid] = (answer.round, answer.step)
        effects = [] if outcome == Outcome.DONE else self._note_failure(flight, answer, now)
        return effects + self._close_if_answered(flight, now)

    def _close_if_answered(self, flight: InFlight, now: float) -> list[Effect]:
        """A phase every member answered (or was given up on) ends: recorded, then decided on."""
        if flight.pending or not self.calls.close(flight):
            return []
        return [PhaseEnded(flight.phase, dict(flight.answers), flight.started, now)] + self._phase_finished(flight, now)

    def _note_failure(self, flight: InFlight, answer: Answer, now: float) -> list[Effect]:
        outcome, rid, kind = Outcome(answer.outcome), answer.rid, flight.phase.kind
        if outcome == Outcome.NON_FINITE and kind.voids:
            # the replica and its group are fine (nobody is killed, nothing re-forms): its cluster's
            # round is void, decided once the phase ends (every member answered)
            c = self.cluster_of(rid)
            seen = self.void.get(c)
            self.void[c] = NonFinite(kind, (seen.rids if seen else ()) + (rid,), seen.detail if seen else answer.detail)
            return []
        if (
            kind is CallKind.OUTER_COMMIT
        ):  # rid did not apply the commit: its cluster's group broke during the broadcast
            flight.not_applied.add(rid)
            self.clusters[self.cluster_of(rid)].configured = None
        effects: list[Effect] = []
        if outcome in (Outcome.DIED, Outcome.ERROR):
            self._mark_dead(rid, "died" if outcome == Outcome.DIED else "error")
            effects += self._release_rendezvous(flight, rid)
        group = flight.group_of(rid, self.cluster_of)
        if outcome != Outcome.YIELDED:
            flight.failed(group, now)
        if outcome == Outcome.COLLECTIVE_FAILED and ErrorKind(answer.error_kind) == ErrorKind.PEER_GONE:
            flight.peer_gone.setdefault(group, now)
        return effects

    def _up(self, up: Up, now: float) -> list[Effect]:
        """A (re)started replica answers. One the machine holds live whose incarnation changed died
        and came back unseen: that death is taken in first. Joins inside the round (rejoin `fast`)."""
        rid, known = up.rid, self.incarnations.get(up.rid)
        self.incarnations[rid] = up.incarnation
        if rid in self.progress and known in (None, up.incarnation):
            return []
        effects = self._lost(rid, now, "died") if rid in self.progress else []
        return effects + self._join_mid_round(rid, (up.round, up.step), now)

    def _lost(self, rid: str, now: float, cause: str = "died") -> list[Effect]:
        """rid is gone while no answer will say so."""
        if rid not in self.progress:
            for joiners in self.joining.values():  # back up, not taken in yet: it is not taken in
                joiners.pop(rid, None)
            return []
        flight = self.calls.busy.get(rid)
        self._mark_dead(rid, cause)  # first: the synthesized answer must not count as alive
        if flight is not None:
            return self._answer(Answer(flight.id, rid, Outcome.ERROR if cause == "error" else Outcome.DIED), now)
        c = self.cluster_of(rid)
        st = self.clusters[c]
        if st.stage is ClusterStage.READY and self.outer_stage is OuterStage.WAIT:
            st.configured = None  # its inner group lost a member: the commit broadcast needs a new one
            return self._reform(c, now, f"{rid} lost")
        return []  # in the outer exchange: the outer phase in flight fails, or the commit skips it

    def _mark_dead(self, rid: str, cause: str) -> None:
        if rid not in self.progress:
            return
        del self.progress[rid]
        self.dead[rid] = cause
        self.deaths.append((rid, cause))
        c = self.cluster_of(rid)
        if self.leaders.get(c) == rid:
            del self.leaders[c]
        if holds_outer_group(self.outer_configured, rid):
            # its process, and the holders' group with it, is gone: even if it is restarted and
            # holds a shard again this round, that group must be configured afresh
            self.outer_configured = None

    # -- bookkeeping shared by the decision files -------------------------------------------------------
    def _issue(
        self, cluster: int | None, calls: dict[str, Call], deadline_s: float, now: float, reason: str = ""
    ) -> Phase:
        """A phase the machine waits on: every replica in `calls` answers it (or is given up on); a
        cluster's phase is the one it waits on."""
        kind = next(iter(calls.values())).kind
        phase = Phase(next(self._ids), kind, self.round, cluster, self.epoch, calls, deadline_s, reason)
        self.calls.issue(phase, now)
        if cluster is not None:
            self.clusters[cluster].phase_id = phase.id
        return phase
