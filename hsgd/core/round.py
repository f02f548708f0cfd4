"""The round machine: what happens in one round, and after any failure in it. Pure: no Ray, no
clocks, no I/O. The supervisor actor only carries its actions out and feeds back what it saw.

One round r, as the machine drives it:

    start        every live replica reports its committed (round, step). If none holds the last
                 committed round, the round cannot run: outcome `restore` (every replica loads the
                 latest durable checkpoint) or `failed` when there is none. Clusters below
                 `min_replicas_per_cluster` sit out; fewer than `min_clusters` left: `below_quorum`.
    per cluster  (independently, one cluster never waits for or disturbs another)
                 heal     members behind the cluster's furthest member copy its state (`full`); a
                          cluster with nobody at round r copies the global state from another
                          cluster (`global`)
                 inner    every member runs the round's remaining inner steps (one call); when the
                          cluster's members changed, the same call first forms its inner group
                          under a fresh epoch (no separate configure round trip)
                 average  inner `none` only: the cluster's mean goes to outer sync
    outer        once every participating cluster is ready: the leaders reduce pseudo-gradients
                 into buffers keyed by (round, epoch) (the same call first forms the leaders' group
                 when the leaders changed), and commit only if every leader succeeded; then every
                 member applies the same step.

What happens after a failure (the whole of "Failure scoping"):
    replica of cluster c died / hung / raised, or c's collective failed
                 -> only cluster c re-forms: its surviving members return at their last committed
                    step (they are waited for, a silent one is killed once its group's grace is
                    over), the furthest wins, laggards heal, and c's inner phase is issued again,
                    forming c's group under a new epoch. Other clusters are not interrupted and
                    their results count.
    a leader died or the outer collective failed
                 -> only the outer exchange is retried: buffers are never applied without a
                    commit, the dead leader's cluster re-forms with a new leader, inner work stays.
    every member of a cluster lost
                 -> the cluster sits the round out; its replicas come back healed from another
                    cluster at the next round.
    failure during the commit
                 -> if any replica applied the commit, the round is committed (the decision was
                    made); the others heal from a committed replica at the next round's start.
                    If none did, the outer exchange is retried.
    non-finite numbers in cluster c (a member's run_inner answers `non_finite`: a loss or gradient
    norm was NaN/inf; or c's leader's outer_reduce: its pseudo-gradient was)
                 -> c's round is void: nobody is killed, c's pseudo-gradient is never sent (c sits
                    out this round's outer exchange; found at the reduce, the exchange is retried
                    without c), the other clusters commit without it, and c restarts the next round
                    from the committed global params (a `global` heal, as any cluster that sat out).
                    c non-finite in two rounds running (or twice in one round) is benched: it sits
                    out until the run's end or a resume (`benched`, carried from round to round).
                    Non-finite numbers never come back by waiting: when the benched clusters alone
                    leave fewer than min_clusters, or this round's void ones are all that is
                    missing, the round ends `failed` with the reason, never `below_quorum`.
    hung         = silent AND not advancing: a replica whose step still advances is slow, never
                    hung. Its limit is the learned step deadline, or, once a peer of the same group
                    failed, the group's grace (a healthy member leaves a broken collective within
                    its collective timeout).
    the round ends early (below quorum, failed) with calls in flight
                 -> nobody reads their answers, so no group one of them uses is handed on as
                    standing: the next round configures those groups afresh.
    replica answers `behind` (its round is below the one asked)
                 -> it is healed, never counted as done.
    a restarted replica answers again (`on_up`, rejoin `fast`)
                 -> it joins its cluster inside the round: the members are asked to yield at a
                    step boundary a little ahead of the furthest one (all at the same boundary, so
                    no collective is left half-joined), the newcomer heals `full` from the furthest
                    member, the group re-forms, and the inner phase goes on. A cluster already done
                    with its inner phase takes the newcomer in before the outer exchange. Other
                    clusters are untouched. A cluster that sat the round out, or a round already in
                    its outer exchange, takes it at the next round's start. Nobody ever waits for a
                    replica that is still starting.

The machine never issues a call to a replica that has one in flight (`busy`): with one call at a
time per replica, and each call using one level, a replica is in at most one collective at a time.
"""
from __future__ import annotations

import gc
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache
from itertools import repeat
from operator import itemgetter
from types import MappingProxyType
from typing import Iterable, Mapping, NamedTuple

from hsgd.core.heal import HealAssignment, assign_heals
from hsgd.core.membership import Plan, quorum_problem
from hsgd.core.topology import Topology


class Outcome(str, Enum):
    """What one replica's phase call came to."""
    DONE = "done"  # the phase's work for the round is done (also: it was already done)
    BEHIND = "behind"  # the replica has not reached the round asked: it needs a heal
    COLLECTIVE_FAILED = "collective_failed"  # alive, but its group broke (a peer failed)
    YIELDED = "yielded"  # stopped at a step boundary on request (mid-round rejoin)
    DIED = "died"  # the actor is gone (Ray said so, or we killed it)
    ERROR = "error"  # the replica raised: that replica's failure; it is killed and restarted
    IO_ERROR = "io_error"  # a write to the run's storage failed (a checkpoint): the run's problem, nobody is killed
    NON_FINITE = "non_finite"  # a loss, gradient norm or pseudo-gradient was NaN/inf: the cluster's round is void


# module constants compared by identity: an Enum member's `==` / `in` costs ~0.3-0.6 us here, and a
# broken outer group answers `collective_failed` from every leader (1,000 at scale) at once
_DONE, _DIED, _ERROR, _YIELDED, _COLLECTIVE_FAILED = (Outcome.DONE, Outcome.DIED, Outcome.ERROR, Outcome.YIELDED,
                                                      Outcome.COLLECTIVE_FAILED)
_NON_FINITE = Outcome.NON_FINITE
# the calls whose non-finite answer voids the cluster's round (the numbers that would reach the outer exchange)
_VOIDING = ("run_inner", "cluster_average", "outer_reduce")
_LOST = (-1, -1)  # the position of a replica no longer live
_new_tuple = tuple.__new__
_round_of = itemgetter(0)  # of a (round, step) position
_NO_CACHE, _UNKNOWN = object(), object()  # RoundMachine._start_source outside start / not looked up yet


class PhaseResult(NamedTuple):
    """One replica's answer to one action's call (a tuple: tens of thousands a round at scale)."""
    action: int
    rid: str
    outcome: Outcome
    round: int = -1  # the replica's committed round after the call (-1: unknown, it died)
    step: int = -1
    detail: str = ""


class NonFinite(NamedTuple):
    """Why a cluster's round is void: its members' non-finite answers to one call."""
    phase: str  # the call's kind: run_inner | cluster_average | outer_reduce
    rids: tuple[str, ...]  # the members that answered `non_finite`, in answer order
    detail: str  # the first one's error


class Action(NamedTuple):
    """Something the supervisor must do now. `calls`: the replicas it calls, with per-replica
    arguments. `kind`:
      heal            calls = {target: (source, scope)}: target loads source's state
      run_inner       calls = {rid: ()}: run the round's remaining inner steps in the cluster's
                      standing inner group; or {rid: (prefix, rank, world_size)}: first form the
                      group `prefix` under `epoch` (it blocks until every member joined or the
                      configure timeout passed: `collective_failed`), then run (`forms_group`)
      cluster_average calls = {rid: ()}: inner `none`, the cluster's mean
      outer_reduce    calls = {leader: ()}, or {leader: (prefix, rank, world_size)}: first form the
                      leaders' group under `epoch`, then reduce (as run_inner)
      outer_commit    calls = {rid: (root_inner_rank,)}
      kill            calls = {rid: (phase, silent_s)}: kill the replica (restartable), deadline_s =
                      the limit it missed; no result expected
      reap            calls = {rid: (phase, silent_s)}: a replica presumed dead (its peers saw its
                      connection close): the machine goes on without it; nothing to kill (Ray is
                      restarting it), no hang report, no result expected
      yield           calls = {rid: (group epoch, round, step_in_round)}: ask members in run_inner to return at
                      that step boundary (control channel); no result expected — their run_inner
                      answers `yielded`
    """
    id: int
    kind: str
    round: int
    cluster: int | None  # None: the outer level
    epoch: int
    calls: dict[str, tuple]
    deadline_s: float = 0.0  # for calls whose work is fixed; inner phases use progress instead (a run_inner
    # that forms its group: the seconds its members may take to join before their first step)
    reason: str = ""


def forms_group(action: Action) -> bool:
    """A run_inner or outer_reduce whose members first form their level's group (their calls
    carry (prefix, rank, world_size)), rather than using the one standing."""
    return (action.kind == "run_inner" or action.kind == "outer_reduce") and bool(next(iter(action.calls.values()), ()))


@dataclass
class RoundSettings:
    steps_per_round: int
    inner: str = "ddp"
    outer: str = "diloco"
    min_replicas_per_cluster: int = 1
    min_clusters: int = 1
    max_reforms: int = 25  # per cluster (and for the outer exchange) per round: then the run fails
    inner_every: int = 1  # localsgd: members may only yield at a sync boundary
    yield_lead_s: float = 1.5  # a yield boundary lies this far ahead of the furthest member's step
    rejoin: str = "fast"  # fast: restarted replicas join inside the round | boundary: at the next round
    # deadlines, in seconds (the supervisor scales them with payload and learned step times)
    step_deadline_s: float = 60.0  # an inner replica whose step does not advance for this long is hung
    group_grace_s: float = 15.0  # after a peer of the same group failed
    # once every other member of a group reported that its connection to a peer closed (the peer's
    # process is gone), the one still silent is presumed dead after this long, without waiting for
    # Ray's death notice (~1.5 s); members in lockstep all fail within a step of each other
    presumed_dead_s: float = 0.5
    configure_s: float = 40.0  # joining a group: the allowance before a forming call's first step
    heal_s: float = 60.0
    outer_s: float = 120.0
    commit_s: float = 60.0


@dataclass(slots=True)
class _ClusterState:
    _stage: str = "new"  # new | heal | inner | average | ready | out  (read and set as `stage`)
    members: tuple[str, ...] = ()
    configured: tuple[int, tuple[str, ...]] | None = None  # (epoch, members) of the live inner group
    action: int | None = None
    failed_at: float | None = None  # when the current action saw its first failure
    reforms: int = 0
    index: int = -1
    tally: "_StageTally | None" = field(default=None, repr=False, compare=False)

    @property
    def stage(self) -> str:
        return self._stage

    @stage.setter
    def stage(self, value: str) -> None:
        if self.tally is not None and value != self._stage:
            self.tally.moved(self.index, self._stage, value)
        self._stage = value


class _StageTally:
    """Which clusters are out, and which participating ones are not ready, kept as stages change:
    the checks made after every cluster's phase stay O(1) at 1,000 clusters."""

    def __init__(self, clusters: int):
        self.clusters = clusters
        self.out: set[int] = set()
        self.not_ready: set[int] = set(range(clusters))
        self._participating: list[int] | None = None

    def moved(self, c: int, old: str, new: str) -> None:
        if new == "out" or old == "out":
            self._participating = None  # rebuilt on the next ask; a list handed out is never changed
            (self.out.add if new == "out" else self.out.discard)(c)
        if new == "ready" or new == "out":
            self.not_ready.discard(c)
        else:
            self.not_ready.add(c)

    def participating(self) -> list[int]:
        if self._participating is None:
            self._participating = [c for c in range(self.clusters) if c not in self.out]
        return self._participating


class _Layout(NamedTuple):
    """What a topology fixes, built once per topology (not per round): at 10,000 replicas copying a
    prebuilt dict is ~7x cheaper than building it."""
    ids: tuple[tuple[str, ...], ...]  # replica ids per cluster
    cluster_of: dict[str, int]
    run_calls: tuple[dict[str, tuple], ...]  # per cluster, the calls of a run_inner with every member
    all_commit_calls: dict[str, tuple]  # an outer_commit's calls when every replica applies it, from rank 0


@lru_cache(maxsize=16)
def _layout(topology: Topology) -> _Layout:
    ids = tuple(tuple(topology.cluster_members(c)) for c in range(topology.clusters))
    return _Layout(ids, {rid: c for c, members in enumerate(ids) for rid in members},
                   tuple(dict.fromkeys(members, ()) for members in ids),
                   dict.fromkeys((rid for members in ids for rid in members), (0,)))


# an _InFlight's records before their first entry (most never get one): shared, read-only
_NO_GROUPS: Mapping = MappingProxyType({})
_NO_RIDS: frozenset = frozenset()


class _InFlight:
    """An action the machine waits on (a plain slotted class: thousands are made a round, so its
    records start as shared read-only empties and are made on their first entry)."""
    __slots__ = ("action", "id", "left", "started", "failed_at", "delivered", "peer_gone", "failed_groups", "commit",
                 "not_applied")

    def __init__(self, action: Action, left: int, started: float, commit: bool = False):
        self.action = action
        self.id = action.id
        self.left = left  # members still to answer; which ones: RoundMachine._pending (busy is the one record)
        self.started = started
        self.failed_at: float | None = None
        self.delivered: set[str] | frozenset = _NO_RIDS  # heal sources whose state arrived
        self.peer_gone: Mapping = _NO_GROUPS  # group -> when a member saw a peer's connection close
        # group -> when a member of that group first failed: a failure shortens the wait only for its own
        # group (one call may span several: a commit broadcasts in every cluster, heals are one transfer each)
        self.failed_groups: Mapping = _NO_GROUPS
        self.commit = commit  # an outer_commit: who applied it counts
        # (a commit) members that answered anything but done, or were given up on: everyone else applied it
        self.not_applied: set[str] | frozenset = _NO_RIDS

    def group_failed(self, group, now: float) -> None:
        if self.failed_groups is _NO_GROUPS:
            self.failed_groups = {}
        self.failed_groups.setdefault(group, now)

    def peer_closed(self, group, now: float) -> None:
        if self.peer_gone is _NO_GROUPS:
            self.peer_gone = {}
        self.peer_gone.setdefault(group, now)

    def source_delivered(self, source: str) -> None:
        if self.delivered is _NO_RIDS:
            self.delivered = set()
        self.delivered.add(source)

    def did_not_apply(self, rid: str) -> None:
        if self.not_applied is _NO_RIDS:
            self.not_applied = set()
        self.not_applied.add(rid)


class RoundMachine:
    """Drives one round. Feed it `start`, then `on_result` / `on_progress` / `on_tick` with the
    supervisor's clock; carry out every action it returns. `done` is set once `outcome` is one of
    committed | restore | failed | below_quorum; `reason` says why for the last three."""

    def __init__(self, topology: Topology, settings: RoundSettings, round_index: int, *,
                 progress: dict[str, tuple[int, int]], leaders: dict[int, str], epoch: int,
                 committed_round: int, configured: dict[int, tuple[int, tuple[str, ...]]] | None = None,
                 outer_configured: tuple[int, tuple[str, ...]] | None = None, benched: Iterable[int] = (),
                 non_finite_rounds: Mapping[int, int] | None = None):
        self.topology, self.settings, self.round = topology, settings, round_index
        self.progress = dict(progress)  # live replicas only
        self.leaders = dict(leaders)
        self.epoch = epoch
        self.committed_round = committed_round
        self._tally = _StageTally(topology.clusters)
        groups, tally = configured or {}, self._tally
        # positional, in field order: a dataclass's keyword init is twice as slow, and 1,000 are made a round
        self.clusters = {c: _ClusterState("new", (), groups.get(c), None, None, 0, c, tally)
                         for c in range(topology.clusters)}
        self._layout = _layout(topology)
        self._ids, self._cluster_index = self._layout.ids, self._layout.cluster_of
        self._start_source: object = _NO_CACHE  # see _global_source
        self.outer_configured = outer_configured  # (epoch, leaders in outer-rank order)
        self.outer_stage = "wait"  # wait | reduce | commit | done
        self.outer_action: int | None = None
        self.outer_attempts = 0
        self.inflight: dict[int, _InFlight] = {}
        self.busy: dict[str, _InFlight] = {}  # rid -> the call it has in flight
        self.dead: dict[str, str] = {}  # rid -> cause, this round
        self.advance: dict[str, tuple[int, float]] = {}  # rid -> (step, when) of its last sign of progress
        self.committed_by: set[str] = set()
        self.joining: dict[int, dict[str, tuple[int, int]]] = {}  # cluster -> replicas up mid-round
        self.yielding: dict[int, int] = {}  # cluster -> step_in_round its members yield at
        self.done, self.outcome, self.reason = False, "", ""
        # non-finite numbers (see the failure table), carried from round to round by the caller:
        # clusters that sit out until the run's end, and the last round each cluster was void in
        # (keys may come back from JSON as strings)
        self.benched: set[int] = {int(c) for c in benched}
        self.non_finite_rounds: dict[int, int] = {int(c): int(r) for c, r in (non_finite_rounds or {}).items()}
        self.void: dict[int, NonFinite] = {}  # cluster -> why its round is void, this round
        self.benched_now: dict[int, str] = {}  # cluster -> why it was benched, this round
        self._next_id = 0
        # where run_inner ends, and where a commit leaves a replica: most answers report one of the two,
        # and storing these very tuples (not a new one per answer) keeps a round's 20,000 progress
        # stores, the checks on them (identity first) and the next round's start off cold memory
        end_step = (round_index + 1) * settings.steps_per_round
        self._inner_end, self._commit_end = (round_index, end_step), (round_index + 1, end_step)
        self._round_start = (round_index, round_index * settings.steps_per_round)  # (start: the last commit's)
        # the latest observed seconds per inner step (a yield boundary is placed with their median)
        self.step_seconds: deque[float] = deque(maxlen=20)

    # -- queries --------------------------------------------------------------------------------
    @property
    def live(self) -> tuple[str, ...]:
        return tuple(sorted(self.progress, key=self.topology.global_index))

    def members(self, cluster: int) -> tuple[str, ...]:
        """The cluster's live members (the layout's own tuple when all are live: calls copy templates)."""
        progress, ids = self.progress, self._ids[cluster]
        members = tuple([rid for rid in ids if rid in progress])
        return ids if len(members) == len(ids) else members

    def participating(self) -> list[int]:
        return list(self._tally.participating())

    def plan(self) -> Plan:
        """The membership view for fault targeting and status (leaders of participating clusters)."""
        members = {c: self.members(c) for c in self.participating() if self.members(c)}
        return Plan(epoch=self.epoch, members=members, leaders={c: self.leaders[c] for c in members if c in self.leaders},
                    outer_clusters=tuple(sorted(members)))

    def configured_groups(self) -> dict[int, tuple[int, tuple[str, ...]]]:
        return {c: st.configured for c, st in self.clusters.items() if st.configured is not None}

    # -- events ---------------------------------------------------------------------------------
    def start(self, now: float) -> list[Action]:
        if not self.progress:
            return self._finish("below_quorum", "no live replica")
        if not any(p[0] >= self.committed_round for p in self.progress.values()):
            top = max(self.progress.values())[0]  # (round, step) tuples: the furthest round
            self.done = True
            self.outcome = "restore"
            self.reason = (f"total loss: no live replica holds committed round {self.committed_round} "
                           f"(best: {top if top >= 0 else 'none'})")
            return []
        actions: list[Action] = []
        r, smallest = self.round, max(1, self.settings.min_replicas_per_cluster)
        if not any(p[0] == r for p in self.progress.values()):
            if any(len(self.members(c)) >= smallest for c in range(self.topology.clusters)):
                # nobody holds the round asked for: a caller's error, never a stall
                return self._finish("failed", f"round {r} asked, but no live replica holds it")
        self._start_source = _UNKNOWN  # progress stands still meanwhile: every cluster shares one global source
        progress, leaders, at_start = self.progress, self.leaders, (r, r * self.settings.steps_per_round)
        # the very tuple the last round's commit stored (see _commit_end): the checks below match by identity
        at_start = self._round_start = next((p for p in progress.values() if p == at_start), at_start)
        clusters, get = self.clusters, progress.get
        benched = self.benched
        for c, ids in enumerate(self._ids):
            st = clusters[c]
            if benched and c in benched:
                st.stage = "out"  # non-finite in two rounds running: it sits out until the run's end
                continue
            if list(map(get, ids)).count(at_start) == len(ids) >= smallest:
                # _reform's common case, inlined: every member live at the round's start, nobody heals
                st.members = ids
                if leaders.get(c) not in ids:
                    leaders[c] = ids[0]
                if st.configured is not None and st.configured[1] == ids:
                    actions += self._run_inner(c, now)  # the group stands
                else:
                    actions += self._configure(c, now, "round start")
                continue
            members = self.members(c)
            if len(members) < smallest:
                st.stage = "out"
                continue
            actions += self._reform(c, now, "round start", members=members)
        self._start_source = _NO_CACHE
        if len(self.participating()) < self.settings.min_clusters:
            return self._lost_quorum()
        return actions

    def on_result(self, result: PhaseResult, now: float) -> list[Action]:
        return self.on_results((result,), now)

    def on_results(self, results: Iterable[PhaseResult], now: float) -> list[Action]:
        """Answers to calls in flight, in the order they arrived (one `on_result` or everything one
        wait returned): the same as feeding them one by one, in one loop (at 10,000 replicas most
        of a round's cost is this bookkeeping). A stale answer (an action given up on: its cluster
        re-formed, the replica was killed) is ignored."""
        actions: list[Action] = []
        inflight, busy, progress, pop, done, dead = self.inflight, self.busy, self.progress, self.busy.pop, _DONE, self.dead
        inner_end, commit_end, round_start = self._inner_end, self._commit_end, self._round_start
        r, end_step = inner_end
        r1, start_step = r + 1, round_start[1]
        for result in results:
            action_id, rid, outcome, round_index, step, _ = result
            flight = pop(rid, None)
            if flight is None or flight.id != action_id:  # stale: the call was given up on, or answered already
                if flight is not None:
                    busy[rid] = flight  # (rare) put back the call rid does have in flight
                continue
            # rid is live unless it died this round while this call was in flight (a heal source killed
            # while busy elsewhere): a lookup in the few dead is cheaper than in the 10,000 live
            if round_index >= 0 and rid not in dead:
                if step == end_step:
                    progress[rid] = inner_end if round_index == r else commit_end if round_index == r1 \
                        else (round_index, step)
                else:  # (a heal answer at the round's start, most often)
                    progress[rid] = round_start if step == start_step and round_index == r else (round_index, step)
            if outcome is not done and outcome != done:  # the common answer takes no branch here
                self._note_failure(flight, result, now)
            flight.left -= 1
            if not flight.left:
                del inflight[action_id]
                actions += self._action_finished(flight, now)
        return actions

    def _pending(self, flight: _InFlight) -> list[str]:
        """The members of `flight` that have not answered (and were not given up on)."""
        busy = self.busy
        return [rid for rid in flight.action.calls if busy.get(rid) is flight]

    def _give_up(self, flight: _InFlight, rid: str) -> None:
        """Stop waiting for rid's answer to `flight` (it was killed or is gone): a late one is stale."""
        if self.busy.get(rid) is flight:
            del self.busy[rid]
            flight.left -= 1
            if flight.commit:
                flight.did_not_apply(rid)

    def _note_failure(self, flight: _InFlight, result: PhaseResult, now: float) -> None:
        outcome, rid = result.outcome, result.rid
        if outcome.__class__ is not Outcome:
            outcome = Outcome(outcome)  # (a plain string) from here on, members compare by identity
        if outcome is _NON_FINITE and flight.action.kind in _VOIDING:
            # the replica and its group are fine (nobody is killed, nothing re-forms): its cluster's
            # round is void, decided once the call ends (every member answered)
            c = self._cluster_of(rid)
            seen = self.void.get(c)
            self.void[c] = NonFinite(flight.action.kind, (seen.rids if seen else ()) + (rid,),
                                     seen.detail if seen else result.detail)
            return
        if flight.commit:  # rid did not apply the commit: its cluster's group broke during the broadcast
            flight.did_not_apply(rid)
            self.clusters[self._cluster_of(rid)].configured = None
        if outcome is _DIED or outcome is _ERROR:
            self._mark_dead(rid, "died" if outcome is _DIED else "error")
        if outcome is not _YIELDED:
            if flight.failed_at is None:
                flight.failed_at = now
            group = self._group_of(flight, rid)
            if group not in flight.failed_groups:
                flight.group_failed(group, now)
        if outcome is _COLLECTIVE_FAILED and result.detail and peer_gone(result.detail):
            flight.peer_closed(self._group_of(flight, rid), now)

    def on_progress(self, rid: str, step: int, now: float) -> float | None:
        """A replica in an inner phase reported its committed step (on its control channel).
        Returns the seconds per step it took since its last sign of progress, if it advanced."""
        seen = self.advance.get(rid)
        if seen is None:
            self.advance[rid] = (step, now)
        elif step > seen[0]:
            step_s = (now - seen[1]) / (step - seen[0])
            self.step_seconds.append(step_s)
            self.advance[rid] = (step, now)
            return step_s
        return None

    def on_tick(self, now: float) -> list[Action]:
        """Kill replicas that are silent and not advancing past their limit. The machine gives up
        on a killed replica's call at once (its late answer is stale) and goes on without it."""
        actions: list[Action] = []
        for action_id, flight in list(self.inflight.items()):
            for rid in sorted(self._overdue(flight, now)):
                if now > self._limit(flight, rid):
                    source = flight.action.calls[rid][0] if flight.action.kind == "heal" else None
                    if source is not None and source not in flight.delivered:
                        # a target waits for its source's state: the silent one is the source; once it
                        # is killed, the target's call fails by itself (its argument is lost)
                        if source in self.progress:
                            actions.append(self._kill_source(source, flight, now))
                            continue
                        if flight.failed_at is not None and now <= flight.failed_at + self.settings.group_grace_s:
                            continue
                    actions.append(self._kill(rid, flight, now))
            if not flight.left and action_id in self.inflight:
                del self.inflight[action_id]
                actions += self._action_finished(flight, now)
        return actions

    def _overdue(self, flight: _InFlight, now: float) -> Iterable[str]:
        """The pending replicas of `flight` that may be past their limit (a superset of them). An
        inner phase nobody failed in (every tick, at 10,000 replicas) is checked inline: its limit
        is the last sign of progress plus the step window, and a kill in this tick cannot shorten
        another member's limit below now (the group's grace starts at now)."""
        if flight.action.kind != "run_inner" or flight.failed_groups or flight.peer_gone:
            return self._pending(flight)
        window = max(self.settings.step_deadline_s, self.settings.group_grace_s)
        started, advance = flight.started, self.advance  # (a join allowance only ever makes a limit later)
        if now <= started + window:
            return ()
        return [rid for rid in self._pending(flight)
                if now > (max(started, seen[1]) if (seen := advance.get(rid)) else started) + window]

    def on_heal_state(self, action_id: int, source: str, now: float) -> None:
        """A heal's source delivered its state (its get_state answered): from now on a silent
        target is the one to blame, not the source."""
        flight = self.inflight.get(action_id)
        if flight is not None:
            flight.source_delivered(source)

    def on_up(self, rid: str, round_index: int, step: int, now: float) -> list[Action]:
        """A (re)started replica answers while the round runs (rejoin `fast`)."""
        c = self.topology.cluster_of(rid)
        st = self.clusters[c]
        if self.settings.rejoin != "fast" or self.done or rid in self.progress or st.stage == "out" \
                or self.outer_stage != "wait":
            return []  # joins at the next round's start
        self.joining.setdefault(c, {})[rid] = (round_index, step)
        if st.stage == "inner":
            flight = self.inflight.get(st.action) if st.action is not None else None
            if c in self.yielding or flight is None or flight.failed_at is not None:
                return []  # asked already, or the phase failed: it re-forms, taking the newcomer in
            running = self._pending(flight)  # (members that died or answered are asked nothing)
            at = self._yield_step(running)
            if at >= self.settings.steps_per_round:
                return []  # the members finish first; the newcomer is taken in when they are ready
            self.yielding[c] = at
            group_epoch = st.configured[0] if st.configured else self.epoch
            return [self._new_action("yield", c, {m: (group_epoch, self.round, at) for m in running},
                                     reason=f"{rid} joins at step {at}")]
        if st.stage == "ready":
            return self._admit_joiners(c, now)
        return []  # heal / average in flight: taken in when it ends

    def _yield_step(self, running: list[str]) -> int:
        """A step boundary every member still running reaches after the yield request arrives."""
        s = self.settings
        recent = sorted(self.step_seconds)
        step_s = recent[len(recent) // 2] if recent else 0.1
        lead = max(2, int(s.yield_lead_s / max(step_s, 1e-3)) + 1)
        start = self.round * s.steps_per_round
        advance, progress = self.advance, self.progress
        furthest = max(max(advance[m][0], progress[m][1]) if m in advance else progress[m][1]
                       for m in running) - start
        at = furthest + lead
        if s.inner == "localsgd":
            at = -(-at // s.inner_every) * s.inner_every
        return at

    def _admit_joiners(self, c: int, now: float) -> list[Action]:
        joiners = self.joining.pop(c, {})
        self.yielding.pop(c, None)
        for rid, p in joiners.items():
            self.progress[rid] = p
            self.dead.pop(rid, None)
        self.clusters[c].configured = None
        return self._reform(c, now, "rejoin: " + ",".join(sorted(joiners)), counts=False)

    def on_lost(self, rid: str, now: float, cause: str = "died") -> list[Action]:
        """Ray says a replica died while it had no call in flight (or we learned it otherwise)."""
        if rid not in self.progress:
            return []
        self._mark_dead(rid, cause)
        flight = self.busy.get(rid)
        if flight is not None:
            return self.on_result(PhaseResult(flight.id, rid, Outcome.DIED), now)
        c = self.topology.cluster_of(rid)
        st = self.clusters[c]
        if st.stage in ("ready",) and self.outer_stage in ("wait",):
            st.configured = None  # its inner group lost a member: the commit broadcast needs a new one
            return self._reform(c, now, f"{rid} lost")
        if st.stage == "ready" and self.outer_stage in ("reduce", "commit"):
            return []  # the outer action in flight will fail, or the commit will skip it
        return []

    # -- internals --------------------------------------------------------------------------------
    def _limit(self, flight: _InFlight, rid: str) -> float:
        s = self.settings
        action = flight.action
        if action.kind == "run_inner":
            seen = self.advance.get(rid)
            if seen is not None and self._stepped(rid):
                last = max(flight.started, seen[1])
            else:  # no step yet: a run that forms its group may spend its join allowance (deadline_s) first
                first = flight.started + action.deadline_s
                last = max(first, seen[1]) if seen else first
            limit = last + max(s.step_deadline_s, s.group_grace_s)
        else:
            limit = flight.started + action.deadline_s
        group = self._group_of(flight, rid)
        failed_at = flight.failed_groups.get(group)
        if failed_at is not None:
            # a healthy member leaves a broken collective within the grace; one forming its group that
            # has not stepped yet may still wait in the rendezvous for the missing peer (configure timeout)
            grace = max(s.group_grace_s, s.configure_s) if forms_group(action) and not self._stepped(rid) \
                else s.group_grace_s
            limit = min(limit, max(failed_at, self._last_sign(flight, rid)) + grace)
        gone_at = flight.peer_gone.get(group)
        if gone_at is not None and self._only_suspects_pending(flight, group):
            limit = min(limit, gone_at + s.presumed_dead_s)
        return limit

    def _stepped(self, rid: str) -> bool:
        """rid's step advanced in its current inner run (so it is past any join that run began with)."""
        seen = self.advance.get(rid)
        return seen is not None and seen[0] > self.progress.get(rid, _LOST)[1]

    def _only_suspects_pending(self, flight: _InFlight, group) -> bool:
        """Every member of `group` but the silent ones answered (so the silent ones are the peers
        whose connections closed)."""
        members = [r for r in flight.action.calls if self._group_of(flight, r) == group]
        pending = set(self._pending(flight))
        answered = [r for r in members if r not in pending]
        return bool(answered) and len(answered) >= len(members) - 1

    def _group_of(self, flight: _InFlight, rid: str):
        """The group of rid within its call: one cluster's broadcast in a commit, its own
        transfer in a heal, else the call's single group."""
        if flight.action.kind == "outer_commit":
            return self._cluster_of(rid)
        if flight.action.kind == "heal":
            return rid
        return None

    def _last_sign(self, flight: _InFlight, rid: str) -> float:
        seen = self.advance.get(rid)
        return max(flight.started, seen[1]) if seen and flight.action.kind == "run_inner" else flight.started

    def _kill(self, rid: str, flight: _InFlight, now: float) -> Action:
        last_sign = self._last_sign(flight, rid)
        limit_s = self._limit(flight, rid) - last_sign
        group = self._group_of(flight, rid)
        if group in flight.peer_gone and self._only_suspects_pending(flight, group) \
                and now - flight.peer_gone[group] < self.settings.group_grace_s:
            # its peers saw its connection close: it is gone, not hung; no hang report
            self._mark_dead(rid, "died")
            self._give_up(flight, rid)
            return self._new_action("reap", flight.action.cluster, {rid: (flight.action.kind, now - last_sign)},
                                    reason="its peers saw its connection close")
        self._mark_dead(rid, "hung")
        self._give_up(flight, rid)
        if flight.failed_at is None:
            flight.failed_at = now
        flight.group_failed(self._group_of(flight, rid), now)
        return self._new_action("kill", flight.action.cluster, {rid: (flight.action.kind, now - last_sign)},
                                deadline_s=limit_s,
                                reason=f"silent and not advancing in {flight.action.kind} for {now - last_sign:.1f}s "
                                       f"(limit {limit_s:.1f}s)")

    def _clusters_with_deaths(self) -> set[int]:
        """Clusters a replica died in this round (only their member lists may hold the dead)."""
        return {self._cluster_of(rid) for rid in self.dead}

    def _cluster_of(self, rid: str) -> int:
        c = self._cluster_index.get(rid)
        return self.topology.cluster_of(rid) if c is None else c

    def _kill_source(self, source: str, flight: _InFlight, now: float) -> Action:
        """A heal's source never delivered its state: kill it; its targets' calls then fail (their
        argument is lost) and the cluster re-forms without it."""
        silent_s = now - flight.started
        self._mark_dead(source, "hung")
        if flight.failed_at is None:
            flight.failed_at = now
        return self._new_action("kill", flight.action.cluster, {source: ("heal", silent_s)},
                                deadline_s=flight.action.deadline_s,
                                reason=f"heal source silent for {silent_s:.1f}s (limit {flight.action.deadline_s:.1f}s)")

    def _mark_dead(self, rid: str, cause: str) -> None:
        if rid in self.progress:
            del self.progress[rid]
            self.dead[rid] = cause
            c = self.topology.cluster_of(rid)
            if self.leaders.get(c) == rid:
                del self.leaders[c]
            if self.outer_configured is not None and rid in self.outer_configured[1]:
                # its process, and the leaders' group with it, is gone: even if it is restarted and
                # leads its cluster again this round, that group must be configured afresh
                self.outer_configured = None

    def _new_action(self, kind: str, cluster: int | None, calls: dict[str, tuple], deadline_s: float = 0.0,
                    reason: str = "") -> Action:
        """An action nobody answers (kill, reap, yield)."""
        # tuple.__new__ straight: NamedTuple's own __new__ is a Python frame, and thousands are made a round
        action = _new_tuple(Action, (self._next_id, kind, self.round, cluster, self.epoch, calls, deadline_s, reason))
        self._next_id += 1
        return action

    def _issue(self, kind: str, cluster: int | None, calls: dict[str, tuple], deadline_s: float, now: float,
               reason: str = "") -> Action:
        """An action the machine waits on: every replica in `calls` answers it (or is given up on)."""
        action = self._new_action(kind, cluster, calls, deadline_s, reason)
        busy = self.busy
        if not busy.keys().isdisjoint(calls):  # one call at a time per replica: a bug, never a failure
            rid = next(r for r in calls if r in busy)
            raise AssertionError(f"{rid} already has action {busy[rid].id} in flight")
        flight = self.inflight[action.id] = _InFlight(action, len(calls), now, kind == "outer_commit")
        if len(calls) > 64:  # a commit to everyone: one pass in C
            busy.update(dict.fromkeys(calls, flight))
        else:  # (faster than update(dict.fromkeys(...)) for a cluster's few members)
            for rid in calls:
                busy[rid] = flight
        return action

    def _quorum_text(self) -> str:
        s = self.settings
        return quorum_problem([len(self.members(c)) for c in range(self.topology.clusters)],
                              s.min_replicas_per_cluster, s.min_clusters) or "below quorum"

    def _finish(self, outcome: str, reason: str = "") -> list[Action]:
        self.done, self.outcome, self.reason = True, outcome, reason
        # A round that ends early (below quorum, failed) leaves calls in flight whose answers nobody
        # reads: a group they are using may still break (a collective fails, a member is killed while
        # the supervisor waits for them), so the groups they touch are not handed on as standing.
        for flight in self.inflight.values():
            kind = flight.action.kind
            if kind == "outer_reduce":
                self.outer_configured = None
            elif kind == "outer_commit":
                for rid in self._pending(flight):
                    self.clusters[self._cluster_of(rid)].configured = None
            elif kind != "heal":  # heals use no group
                self.clusters[flight.action.cluster].configured = None
        return []

    def _lost_quorum(self) -> list[Action]:
        """Fewer than min_clusters clusters can take part. Waiting brings back lost replicas, never
        the numbers of a cluster that sits out for being non-finite: when the benched alone leave
        too few clusters, or this round's void ones are all that is missing, the run fails (with
        the reason) rather than waits."""
        s, clusters = self.settings, self.topology.clusters
        if len(self.benched) > clusters - s.min_clusters:
            return self._finish("failed", f"{len(self.benched)} of {clusters} clusters benched for non-finite numbers "
                                          f"({self._non_finite_text(self.benched)}); fewer than "
                                          f"supervisor.min_clusters={s.min_clusters} can train")
        if self.void and len(self.participating()) + len(self.void) >= s.min_clusters:
            return self._finish("failed", f"round {self.round}: no {s.min_clusters} cluster(s) left to commit: "
                                          f"non-finite numbers in {self._non_finite_text(self.void)}")
        return self._finish("below_quorum", self._quorum_text())

    def _non_finite_text(self, clusters: Iterable[int]) -> str:
        return ", ".join(f"c{c}" + (f" (round {self.round}: {self.void[c].phase}: {self.void[c].detail})"
                                    if c in self.void else f" (benched, last non-finite in round "
                                                           f"{self.non_finite_rounds.get(c, '?')})")
                         for c in sorted(clusters))

    def _bench_or_sit_out(self, c: int) -> None:
        """c's round is void: it sits out this round; non-finite in the last round too (or in an
        earlier attempt of this one), it is benched for the rest of the run."""
        st = self.clusters[c]
        self.yielding.pop(c, None)
        st.stage = "out"
        last = self.non_finite_rounds.get(c)
        self.non_finite_rounds[c] = self.round
        if last is not None and self.round - 1 <= last <= self.round and c not in self.benched:
            self.benched.add(c)
            self.benched_now[c] = (f"non-finite numbers in rounds {last} and {self.round} "
                                   f"({self.void[c].phase}: {self.void[c].detail}); c{c} sits out until the "
                                   f"run's end or a resume")

    def _void_cluster(self, c: int, now: float) -> list[Action]:
        """c's call ended with a non-finite answer: c sits out the outer exchange (see the table)."""
        self._bench_or_sit_out(c)
        if self.outer_stage != "wait":
            return []
        return self._maybe_outer(now)

    # per cluster ---------------------------------------------------------------------------------
    def _reform(self, c: int, now: float, reason: str, counts: bool = True,
                members: tuple[str, ...] | None = None) -> list[Action]:
        """(Re-)form cluster c: heal laggards, run inner (forming its group if members changed).
        `members`: c's live members when the caller just computed them (start)."""
        st = self.clusters[c]
        self.yielding.pop(c, None)
        members = self.members(c) if members is None else members
        if len(members) < self.settings.min_replicas_per_cluster or not members:
            st.stage, st.members = "out", members
            if self.outer_stage == "wait" and len(self.participating()) < self.settings.min_clusters:
                return self._lost_quorum()
            return self._maybe_outer(now)
        if reason != "round start" and counts:
            st.reforms += 1
            if st.reforms > self.settings.max_reforms:
                return self._finish("failed", f"cluster c{c} re-formed {st.reforms} times in round {self.round}; "
                                              f"giving up ({reason})")
        st.members = members
        if self.leaders.get(c) not in members:
            self.leaders[c] = members[0]
        st.failed_at = None
        progress = self.progress
        where = [progress[rid] for rid in members]
        first = where[0]
        if first[0] == self.round and where.count(first) == len(where):
            pool = None  # every member holds the round at the same step: nobody heals
        elif any(p[0] == self.round for p in where):
            pool = {}  # a member holds the round: heals stay inside c, whatever the donors
        else:  # nobody in c holds the round: the global state of the lowest-id donor (as assign_heals picks)
            source = self._global_source()
            pool = {source: progress[source]} if source is not None else {}
        heals = assign_heals_for_cluster(dict(zip(members, where)), pool) if pool is not None else []
        if heals:
            self._move(st, "heal")
            action = self._issue("heal", c, {h.target: (h.source, h.scope) for h in heals}, self.settings.heal_s, now,
                                 reason)
            st.action = action.id
            return [action]
        return self._configure(c, now, reason)

    def _global_source(self) -> str | None:
        """The lowest-id live replica holding the round (whom assign_heals picks for a `global`
        heal): the first in (cluster, index) order. Found once per `start`, where every cluster
        that lost the round shares it."""
        if self._start_source is not _NO_CACHE and self._start_source is not _UNKNOWN:
            return self._start_source
        progress, r = self.progress, self.round
        source = next((rid for ids in self._ids for rid in ids if progress.get(rid, _LOST)[0] == r), None)
        if self._start_source is _UNKNOWN:
            self._start_source = source
        return source

    def _move(self, st: _ClusterState, stage: str) -> None:
        """st.stage = stage (heal or inner: a stage that is not ready), without the property's
        general bookkeeping for a cluster that is not out: its one tally change, made straight (the
        hot path: thousands a round)."""
        if st._stage == "out":
            st.stage = stage
        else:
            st._stage = stage
            self._tally.not_ready.add(st.index)

    def _configure(self, c: int, now: float, reason: str) -> list[Action]:
        """Run c's inner phase in its standing group, or (members changed) in a group the same call
        forms under a fresh epoch. The group counts as standing from now: the run's failure drops it."""
        st = self.clusters[c]
        if st.configured is not None and st.configured[1] == st.members and reason == "round start":
            return self._run_inner(c, now)
        self.epoch += 1
        n = len(st.members)
        prefix = f"epoch{self.epoch}/inner/c{c}"
        calls = dict(zip(st.members, zip(repeat(prefix), range(n), repeat(n))))  # rid -> (prefix, rank, n), in C
        st.configured = (self.epoch, st.members)
        return self._run_inner(c, now, calls, reason)

    def _run_inner(self, c: int, now: float, forming: dict[str, tuple] | None = None,
                   reason: str = "") -> list[Action]:
        """`forming`: the calls of a run that first forms c's group (see _configure)."""
        st = self.clusters[c]
        self._move(st, "inner")
        advance = self.advance
        if advance:  # marks of an earlier inner run this round are stale (the first run has none)
            for rid in st.members:
                advance.pop(rid, None)
        members = st.members
        if forming is not None:
            action = self._issue("run_inner", c, forming, self.settings.configure_s, now, reason)
        else:
            calls = self._layout.run_calls[c].copy() if members is self._ids[c] else dict.fromkeys(members, ())
            action = self._issue("run_inner", c, calls, 0.0, now, reason)
        st.action = action.id
        return [action]

    def _action_finished(self, flight: _InFlight, now: float) -> list[Action]:
        action = flight.action
        results_ok = flight.failed_at is None
        if action.kind == "outer_reduce" or action.kind == "outer_commit":
            return self._outer_finished(flight, results_ok, now)
        c = action.cluster
        st = self.clusters[c]
        if st.action != action.id:
            return []
        st.action = None
        where = list(map(self.progress.get, st.members))  # None: lost meanwhile
        if self.void and c in self.void:
            if not results_ok or None in where:
                st.configured = None  # a member also failed or was lost: the group is unusable
            return self._void_cluster(c, now)
        if action.kind == "run_inner" and results_ok and not self.joining and self.settings.inner != "none" \
                and where.count(self._inner_end) == len(where):
            # every member finished the round's inner steps (the common case, first, 1,000 a round):
            # the stage moves inner -> ready straight (no cluster runs while out), and while another
            # cluster is not ready yet there is nothing to check (getting ready never breaks quorum)
            st._stage = "ready"
            not_ready = self._tally.not_ready
            not_ready.discard(c)
            return [] if not_ready else self._maybe_outer(now)
        lost = None in where
        if self.joining.get(c) and self.outer_stage == "wait":
            if not results_ok or lost:
                st.configured = None
            return self._admit_joiners(c, now)
        if not results_ok or lost:
            st.configured = None  # a failed collective (or join) leaves the group unusable
            return self._reform(c, now, f"{action.kind} failed")
        if action.kind == "heal":
            return self._configure(c, now, action.reason)
        if action.kind == "run_inner":
            if where.count(self._inner_end) != len(where):
                return self._reform(c, now, "inner phase ended short")
            if self.settings.inner == "none" and len(st.members) > 1:
                st.stage = "average"
                a = self._issue("cluster_average", c, dict.fromkeys(st.members, ()), self.settings.commit_s, now)
                st.action = a.id
                return [a]
            st.stage = "ready"
            return self._maybe_outer(now)
        if action.kind == "cluster_average":
            st.stage = "ready"
            return self._maybe_outer(now)
        return []

    # outer level ---------------------------------------------------------------------------------
    def _maybe_outer(self, now: float) -> list[Action]:
        if self.done or self.outer_stage != "wait":
            return []
        tally = self._tally
        if tally.clusters - len(tally.out) < self.settings.min_clusters:  # participating clusters
            return self._lost_quorum()
        if tally.not_ready:  # a participating cluster is not ready yet
            return []
        leaders = tuple(self.leaders[c] for c in self.participating())
        self.outer_stage = "reduce"
        if self.settings.outer != "none" and (self.outer_configured is None or self.outer_configured[1] != leaders):
            # the leaders changed: the reduce first forms their group under a fresh epoch
            self.epoch += 1
            prefix, n = f"epoch{self.epoch}/outer", len(leaders)
            calls = dict(zip(leaders, zip(repeat(prefix), range(n), repeat(n))))  # leader -> (prefix, rank, n)
            deadline_s = self.settings.configure_s + self.settings.outer_s
        else:
            calls, deadline_s = dict.fromkeys(leaders, ()), self.settings.outer_s
        a = self._issue("outer_reduce", None, calls, deadline_s, now)
        self.outer_action = a.id
        return [a]

    def _outer_commit(self, now: float) -> list[Action]:
        self.outer_stage = "commit"
        progress, leaders, clusters, out = self.progress, self.leaders, self.clusters, self._tally.out
        lost_in = self._clusters_with_deaths()  # whose members may not all be live
        # start from every replica applying it from rank 0 (one prebuilt dict: most rounds, every cluster
        # is whole and led by its first member) and rewrite only the clusters that are not
        calls: dict[str, tuple[int]] = self._layout.all_commit_calls.copy()
        pop = calls.pop
        for c, ids in enumerate(self._ids):
            leader = leaders.get(c)
            if c not in out and clusters[c].members is ids and c not in lost_in and leader == ids[0]:
                continue  # the template stands
            for rid in ids:
                pop(rid)
            if c in out or leader not in progress:
                continue  # sits the round out, or its leader was lost after the reduce: it heals next round
            members = clusters[c].members
            root = members.index(leader)
            for rid in members:
                if rid in progress:
                    calls[rid] = (root,)
        if not calls:
            return self._outer_retry(now, "no cluster can apply the commit")
        a = self._issue("outer_commit", None, calls, self.settings.commit_s, now, "commit decided")
        self.outer_action = a.id
        return [a]

    def _outer_finished(self, flight: _InFlight, ok: bool, now: float) -> list[Action]:
        action = flight.action
        if action.kind == "outer_reduce":
            voided = [c for c in self.void if self.clusters[c].stage != "out"]
            if voided:  # a leader's pseudo-gradient was non-finite: it was never sent; retry without its cluster
                self.outer_configured = None
                for c in voided:
                    self._bench_or_sit_out(c)
                if self.done:
                    return []
                return self._outer_retry(now, "non-finite pseudo-gradient from " +
                                         ",".join(f"c{c}" for c in sorted(voided)), action.calls)
            if ok:
                if forms_group(action):
                    self.outer_configured = (action.epoch, tuple(action.calls))
                return self._outer_commit(now)
            self.outer_configured = None
            return self._outer_retry(now, "outer reduce incomplete", action.calls)
        # outer_commit: who applied it is known once every member answered (or was given up on)
        self.committed_by.update(action.calls.keys() - flight.not_applied)
        if self.committed_by:
            self.outer_stage = "done"
            return self._finish("committed")
        self.outer_configured = None
        return self._outer_retry(now, "no replica applied the commit", action.calls)

    def _outer_retry(self, now: float, reason: str, answered: Iterable[str] | None = None) -> list[Action]:
        """Only the outer exchange is redone: clusters whose members were lost re-form (a new
        leader, a group without the dead); the others keep their inner work and wait.
        `answered`: who the failed outer call went to. Since a cluster got ready, only they and the
        dead can have moved off the round, so only their clusters are checked (None: every one)."""
        self.outer_attempts += 1
        if self.outer_attempts > self.settings.max_reforms:
            return self._finish("failed", f"outer sync of round {self.round} failed {self.outer_attempts} times; "
                                          f"giving up ({reason})")
        self.outer_stage = "wait"
        actions: list[Action] = []
        get, r, lost, clusters = self.progress.get, self.round, repeat(_LOST), self.clusters
        participating = self._tally.participating()
        if answered is None:
            suspects: Iterable[int] = participating
        else:
            cluster_of = self._cluster_of
            suspects = self._clusters_with_deaths() | {cluster_of(rid) for rid in answered if get(rid, _LOST)[0] != r}
        broken = [c for c in participating if clusters[c].configured is None or c in suspects
                  and list(map(_round_of, map(get, clusters[c].members, lost))).count(r) != len(clusters[c].members)]
        for c in broken:  # a member lost (-1) or not at the round, or its commit broadcast broke the group (None)
            st = clusters[c]
            st.configured = None
            st.stage = "reform"  # not ready: no exchange starts until every broken cluster re-formed
        for c in broken:
            actions += self._reform(c, now, reason)
            if self.done:
                return actions
        return actions + self._maybe_outer(now)


def quiet_gc_for_planning(topology: Topology | None = None) -> None:
    """For the process that hosts RoundMachines (the supervisor; the plan benchmark, to measure
    what it does), once it is set up. `topology`: the run's; its layout (ids per cluster, call
    templates: built once per run, ~10 ms at 10,000 replicas) is built now rather than in the first
    round, and frozen with the rest. At 10,000 replicas a round allocates ~100,000 short-lived
    tuples; with CPython's default thresholds (a young collection every 700 allocations, and full
    ones that walk every live object) collection took a third of the planning time. The state built
    so far (topology, layout, roster) is frozen out of collection, and young collections run every
    50,000 allocations."""
    if topology is not None:
        _layout(topology)
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def assign_heals_for_cluster(members: dict[str, tuple[int, int]],
                             donors: dict[str, tuple[int, int]]) -> list[HealAssignment]:
    """Heals inside one cluster before it (re-)forms: the furthest member at the round wins
    (`full`); with nobody at the round, every member takes the global state of the lowest-id
    donor of another cluster (`global`)."""
    from hsgd.core.membership import Plan as _Plan

    if not members:
        return []
    cluster_plan = _Plan(epoch=0, members={0: tuple(members)}, leaders={}, outer_clusters=(0,))
    everyone = {**donors, **members}
    return assign_heals(everyone, cluster_plan, donors=donors)


def peer_gone(detail: str) -> bool:
    """A collective's error says a peer's connection closed (its process is gone), as opposed to a
    timeout (a peer that may be hung or slow)."""
    if not detail:
        return False
    # spelled out, not any() over a generator: a broken outer group answers from every leader at
    # once (1,000 details at scale), and the generator costs ~1 us each
    text = detail.lower()
    return "closed by peer" in text or "reset by peer" in text or "broken pipe" in text or "connection closed" in text


def current_round(progress: Iterable[tuple[int, int]]) -> int:
    """The round to run next: the furthest committed round any live replica holds."""
    return max((r for r, _ in progress), default=0)


def checkpoint_due(rounds_done: int, every: int, total_rounds: int) -> bool:
    """A durable checkpoint after round rounds_done - 1 committed?"""
    return bool(every) and (rounds_done % every == 0 or rounds_done == total_rounds)


def heals_at_rest(topology: Topology, live: dict[str, tuple[int, int]]) -> dict[int, list[HealAssignment]]:
    """Between rounds (the run's end): per cluster, the heals that bring every live member to the
    furthest committed round — inside the cluster when a member holds it, else from another
    cluster's donor (`global`), as at a round's start."""
    top = current_round(live.values())
    donors = {rid: p for rid, p in live.items() if p[0] == top}
    out = {}
    for c in range(topology.clusters):
        members = {rid: live[rid] for rid in topology.cluster_members(c) if rid in live}
        heals = assign_heals_for_cluster(members, {d: p for d, p in donors.items() if d not in members})
        if heals:
            out[c] = heals
    return out
