"""A small fake world of replicas for the round machine (hsgd/core/round/): tests/unit/test_round.py,
test_round_non_finite.py and test_round_simulation.py drive it.

`World` stands in for the supervisor and the replica actors: it carries out every action the
machine returns on a simulated clock (one call per replica, answered later), polls progress and
ticks every 0.5 s, like actors/supervisor.py's _RoundRun. Replicas behave like the real ones:
run_inner moves a cluster's members to (round, (round+1)*steps) in lock step, outer_commit to
round+1, a `full` heal copies the source's (round, step), a `global` heal sets (round,
round*steps); a call for a round not reached answers `behind`; a collective over a broken or
mismatched group fails. Faults are injected at a point: a replica dies, hangs (never answers,
no progress) or its collective fails; `crash` kills replicas at once, mid-call or idle.

The world also checks the machine as it goes (`violations`): no call to a replica with one in
flight, no kill of a replica that did not hang, collectives only over groups that every member
configured, members of an inner phase at the same step, and no replica ever going back in
(round, step) except by a restart or a restore. test_round_simulation.py drives the same world
at 10,000 replicas with random failures.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from actors.round_runner import TICK_S  # the supervisor's progress poll and tick period
from hsgd.core.round import (
    AbortJoin,
    Answer,
    Kill,
    Late,
    Lost,
    Outcome,
    PhaseEnded,
    Progress,
    RoundClosed,
    RoundMachine,
    RoundSettings,
    StateReady,
    StepTimed,
    Yield,
)
from hsgd.core.topology import Topology

SPR = 10  # inner steps per round
DONE, BEHIND, CFAILED, DIED = Outcome.DONE, Outcome.BEHIND, Outcome.COLLECTIVE_FAILED, Outcome.DIED


def decisions(effects) -> list:
    """The effects that change something (not the record's PhaseEnded and StepTimed)."""
    return [e for e in effects if not isinstance(e, (PhaseEnded, StepTimed))]


def make_settings(**overrides) -> RoundSettings:
    base = dict(
        steps_per_round=SPR,
        step_deadline_s=30.0,
        group_grace_s=10.0,
        configure_s=20.0,
        heal_s=20.0,
        outer_s=20.0,
        commit_s=20.0,
    )
    base.update(overrides)
    return RoundSettings(**base)


@dataclass
class Fault:
    """Fires when `rid` is called for `kind` in `round` (None: any); for run_inner when the
    member reaches in-round step `step`. `what`: die | hang | collective. `applied`: in an
    outer_commit whose group breaks, these members applied the commit anyway; in a run_inner
    collective failure, these members completed the step anyway."""

    rid: str
    kind: str
    what: str
    round: int | None = None
    step: int = 0
    applied: tuple[str, ...] = ()


@dataclass
class Rep:
    rid: str
    round: int = 0
    step: int = 0
    alive: bool = True
    hang_at: float | None = None  # hung (silent, not advancing) from this time on
    inner: tuple | None = None  # (prefix, members) of the usable inner group; None: none or broken
    outer: tuple | None = None
    buffer: tuple | None = None  # (round, epoch, leaders the reduce averaged over)
    applied: tuple | None = None  # the buffer content applied by the last commit
    call: tuple | None = None  # (machine generation, action id) in flight
    token: int | None = None  # the answer event that will end the call
    run: tuple | None = None  # (t0, step0, stop_step, step_s) while an inner phase runs
    fired: tuple = ()  # the faults that end the inner phase now running (a yield before them defers them)
    died_at: float = 0.0
    restarts: int = 0

    @property
    def pos(self) -> tuple[int, int]:
        return (self.round, self.step)

    @property
    def hung(self) -> bool:
        return self.hang_at is not None


@dataclass
class Issued:
    gen: int
    at: float
    action: object
    before: dict = field(default_factory=dict)  # rid -> (round, step) when the call was issued


class World:
    def __init__(
        self,
        clusters: int,
        per_cluster: int,
        *,
        settings: RoundSettings | None = None,
        start: tuple[int, int] = (0, 0),
        step_s: float = 1.0,
        timeout_s: float = 5.0,
        configure_timeout_s: float = 8.0,
        report_heal_source_deaths: bool = True,
    ):
        self.topo = Topology(clusters, per_cluster)
        self.settings = settings or make_settings()
        self.spr = self.settings.steps_per_round
        self.reps = {rid: Rep(rid, *start) for rid in self.topo.replica_ids()}
        self.step_s, self.timeout_s, self.configure_timeout_s = step_s, timeout_s, configure_timeout_s
        self.slow: dict[str, float] = {}  # rid -> seconds per step (a cluster steps at its slowest member's pace)
        self.commit_s: dict[int, float] = {}  # cluster -> seconds its commit broadcast takes
        self.report_heal_source_deaths = report_heal_source_deaths
        self.now = 0.0
        self.events: list = []
        self._seq = itertools.count()
        self._tokens = itertools.count(1)
        self.faults: list[Fault] = []
        self._faults_of: dict[str, list[Fault]] = {}
        self.hooks: dict[str, list] = {}  # action kind -> [fn(world, action)] run before it is carried out
        self.halt_before: set[str] = set()  # the supervisor dies right before carrying out one of these
        self.halted = False
        self.issued: list[Issued] = []
        self.kills: list[tuple[float, str]] = []
        self.aborts: list[tuple[float, AbortJoin]] = []
        self._rendezvous: dict[str, set[str]] = {}  # group prefix -> members waiting in its rendezvous
        self.violations: list[str] = []
        self.trace: list[str] | None = None  # set to [] to record what happened, for debugging
        self.running: set[str] = set()  # replicas in an inner phase (progress is polled)
        self.reported: dict[str, int] = {}
        self.m: RoundMachine | None = None
        self.gen = 0
        self._issued_by_call: dict[tuple[int, int], Issued] = {}
        self._sourcing: dict[str, set[str]] = {}  # heal source -> targets reading its state now
        # the supervisor's small state, carried from round to round like actors/supervisor.py does
        self.committed_round = start[0]
        self.leaders: dict[int, str] = {}
        self.configured: dict = {}
        self.outer_configured = None
        self.epoch = 0
        self.closed_at: dict[int, dict[int, int]] = {}  # round -> its recorded close (sync.balance=time)

    # -- queries ---------------------------------------------------------------------------------------
    def calls(self, kind: str, cluster: int | None = "any", gen: int | None = None) -> list[Issued]:
        return [
            i
            for i in self.issued
            if i.action.kind == kind
            and (cluster == "any" or i.action.cluster == cluster)
            and (gen is None or i.gen == gen)
        ]

    def forming(self, level: str, cluster: int | None = "any") -> list[Issued]:
        """The calls that formed a group of `level` (inner: run_inner, outer: outer_reduce)."""
        kind = "run_inner" if level == "inner" else "outer_reduce"
        return [i for i in self.calls(kind, cluster) if i.action.forms_group]

    def members(self, cluster: int) -> list[str]:
        return self.topo.cluster_members(cluster)

    def live_progress(self) -> dict[str, tuple[int, int]]:
        return {rid: rep.pos for rid, rep in self.reps.items() if rep.alive}

    def violation(self, text: str) -> None:
        self.violations.append(f"t={self.now:.2f} {text}")
        if self.trace is not None:
            self.trace.append(f"VIOLATION t={self.now:.2f} {text}")

    # -- injection -------------------------------------------------------------------------------------
    def fault(
        self, rid: str, kind: str, what: str, round: int | None = None, step: int = 0, applied: tuple[str, ...] = ()
    ) -> None:
        f = Fault(rid, kind, what, round, step, tuple(applied))
        self.faults.append(f)
        self._faults_of.setdefault(rid, []).append(f)

    def clear_faults(self) -> None:
        self.faults.clear()
        self._faults_of.clear()

    def at(self, t: float, fn) -> None:
        """Call fn(world) at simulated time t (a crash from outside, a supervisor dying, ...)."""
        heapq.heappush(self.events, (t, next(self._seq), None, None, fn))

    def on(self, kind: str, fn) -> None:
        self.hooks.setdefault(kind, []).append(fn)

    def crash(self, rids) -> None:
        """These replicas die now, in a call or idle. Peers in a collective with one of them fail
        fast; heals from one of them fail; the machine learns of an idle one only at its next call."""
        if self.trace is not None:
            self.trace.append(f"t={self.now:.2f} crash {list(rids)[:12]}")
        for rid in rids:
            rep = self.reps[rid]
            if not rep.alive:
                continue
            rep.alive, rep.died_at = False, self.now
            rep.hang_at, rep.inner, rep.outer = None, None, None
            self.running.discard(rid)
            self._fail_readers(rid)
            if rep.call is None:
                continue
            rep.run = None
            self._push(0.1, rep, DIED)
            issued = self._issued_by_call.get(rep.call)
            if issued is None:
                continue
            a = issued.action
            peers = [] if a.kind == "heal" else self._group_peers(a, rid)
            for peer in peers:
                prep = self.reps[peer]
                if prep.alive and prep.call == rep.call and prep.token is not None and not prep.hung:
                    if a.kind != "heal":
                        self._break_group(prep, "outer" if a.kind == "outer_reduce" else "inner")
                    self._push(0.01, prep, CFAILED, new=self._pos_now(prep))
                    prep.run = None
                    self.running.discard(peer)

    def _fail_readers(self, source: str) -> None:
        """The heals reading `source`'s state fail (their targets are fine: collective_failed)."""
        for target in sorted(self._sourcing.pop(source, ())):
            trep = self.reps[target]
            issued = self._issued_by_call.get(trep.call) if trep.call is not None else None
            if (
                trep.alive
                and not trep.hung
                and issued is not None
                and issued.action.kind == "heal"
                and issued.action.calls[target].source == source
            ):
                self._push(0.1, trep, CFAILED, effect=self._source_lost(source))

    def restart(self, rid: str) -> None:
        """A dead replica comes back as a fresh process: seed state, no groups."""
        rep = self.reps[rid]
        assert not rep.alive and rep.call is None, f"{rid} is alive or busy"
        self.reps[rid] = Rep(rid, 0, 0, restarts=rep.restarts + 1)
        self._forget_groups_of(rid)

    def restart_dead(self) -> list[str]:
        back = [rid for rid, rep in self.reps.items() if not rep.alive and rep.call is None]
        for rid in back:
            self.restart(rid)
        return back

    def _forget_groups_of(self, rid: str) -> None:
        """What the supervisor must do when a replica restarted: its groups are gone."""
        c = self.topo.cluster_of(rid)
        if c in self.configured and rid in self.configured[c][1]:
            del self.configured[c]
        if self.outer_configured is not None and any(rid in g for g in self.outer_configured[1]):
            self.outer_configured = None

    # -- driving ---------------------------------------------------------------------------------------
    def machine(self, round_index: int | None = None, **overrides) -> RoundMachine:
        progress = self.live_progress()
        r = max((p[0] for p in progress.values()), default=0) if round_index is None else round_index
        kwargs = dict(
            progress=progress,
            leaders=self.leaders,
            epoch=self.epoch,
            committed_round=self.committed_round,
            configured=self.configured,
            outer_configured=self.outer_configured,
            closed_at=self.closed_at.get(r),
        )
        kwargs.update(overrides)
        return RoundMachine(self.topo, self.settings, r, **kwargs)

    def round(self, round_index: int | None = None, *, limit_s: float = 5000.0, **overrides) -> RoundMachine:
        """Build a machine from the replicas' state (as the supervisor does), drive it to its end,
        and keep what the supervisor keeps."""
        m = self.machine(round_index, **overrides)
        self.drive(m, limit_s=limit_s)
        self.epoch = m.epoch
        self.leaders, self.configured, self.outer_configured = (
            dict(m.leaders),
            m.configured_groups(),
            m.outer_configured,
        )
        if m.outcome == "committed":
            self.committed_round = m.round + 1
        return m

    def drive(self, m: RoundMachine, *, limit_s: float = 5000.0, stop=None) -> None:
        """Carry out m's actions until it is done (or `stop()` says so: a supervisor dies)."""
        self.m = m
        self.gen += 1
        t_end = self.now + limit_s
        self.halted = False
        self.carry_out(m.start(self.now))
        next_tick = self.now + TICK_S
        while not m.done:
            if self.halted or (stop is not None and stop()):
                self.m = None
                return
            if self.events and self.events[0][0] <= next_tick:
                t, _, token, rid, payload = heapq.heappop(self.events)
                self.now = max(self.now, t)
                self._deliver(token, rid, payload)
            else:
                self.now = next_tick
                next_tick += TICK_S
                self._poll_progress()
                self.carry_out(m.tick(self.now))
            if self.now > t_end:
                raise AssertionError(
                    f"round {m.round} did not finish in {limit_s}s of simulated time: "
                    f"stages {[st.stage for st in m.clusters.values()][:20]}, outer {m.outer_stage}, "
                    f"in flight {[(f.phase.kind, sorted(f.pending)[:5]) for f in m.calls.inflight.values()][:10]}"
                )
        self.m = None

    def drain(self) -> None:
        """After a machine was discarded (supervisor restart) or ended early: wait until no replica
        is in a call, killing the hung ones (the restarted supervisor's _await_idle)."""
        while True:
            while self.events:
                t, _, token, rid, payload = heapq.heappop(self.events)
                self.now = max(self.now, t)
                self._deliver(token, rid, payload)
            hung = [rep for rep in self.reps.values() if rep.alive and rep.hung and rep.call is not None]
            if not hung:
                return
            self.now = max(self.now, max(rep.hang_at for rep in hung))
            for rep in hung:
                self._kill(rep.rid, "stuck after a supervisor restart")

    def _poll_progress(self) -> None:
        m = self.m
        for rid in list(self.running):
            rep = self.reps[rid]
            if rep.call is None or rep.call[0] != self.gen or rep.run is None:
                continue
            step = self._pos_now(rep)[1]
            if step > self.reported.get(rid, -1):
                self.reported[rid] = step
                self.carry_out(m.observe(Progress(rid, step), self.now))

    def carry_out(self, actions) -> None:
        for a in actions:
            if self.halted or a.kind in self.halt_before:
                self.halted = True  # the supervisor died: nothing more is carried out
                return
            if isinstance(a, (StepTimed, PhaseEnded, Late)):
                continue
            if isinstance(a, RoundClosed):  # saved (supervisor_state.json): a successor's machine follows it
                self.closed_at[a.round] = dict(a.ends)
                continue
            if isinstance(a, AbortJoin):  # the rendezvous of a.prefix releases whoever still waits in it
                self.aborts.append((self.now, a))
                self._abort_join(a)
                continue
            if isinstance(a, Kill):
                self.kills.append((self.now, a.rid))
                self._kill(a.rid, a.reason)
                continue
            if a.kind == "reap":
                continue
            if isinstance(a, Yield):  # on the control channel: the members are busy in run_inner
                self.issued.append(Issued(self.gen, self.now, a, {rid: self.reps[rid].pos for rid in a.rids}))
                self._yield(a)
                continue
            for fn in self.hooks.get(a.kind, []):
                fn(self, a)
            issued = Issued(self.gen, self.now, a, {rid: self.reps[rid].pos for rid in a.calls})
            self.issued.append(issued)
            if self.trace is not None:
                self.trace.append(
                    f"t={self.now:.2f} g{self.gen} #{a.id} {a.kind} c{a.cluster} e{a.epoch} "
                    f"{dict(list(a.calls.items())[:12])} {a.reason} before={dict(list(issued.before.items())[:12])}"
                )
            for rid in a.calls:
                rep = self.reps[rid]
                if rep.call is not None:
                    self.violation(f"{a.kind} called on {rid}, busy with {rep.call}")
                rep.call, rep.token = (self.gen, a.id), None
                self._issued_by_call[(self.gen, a.id)] = issued
            getattr(self, "_do_" + a.kind)(a)

    def _yield(self, a) -> None:
        """Members in run_inner stop at the first step boundary at or after the one asked (as
        actors/replica.py does) and answer `yielded`, unless their phase ends or fails before it;
        a fault due after that boundary fires in the next run instead."""
        r, at = a.round, a.at_step
        for rid in sorted(a.rids):
            rep = self.reps[rid]
            if not rep.alive or rep.run is None or rep.call is None or rep.hung and rep.hang_at <= self.now:
                continue
            t0, s0, stop, dt = rep.run
            y = max(r * self.spr + at, self._pos_now(rep)[1])
            if y >= stop:
                continue  # it stops (done, or at a fault) before the boundary: the yield changes nothing
            for f in rep.fired:  # not reached: due again
                if f not in self.faults:
                    self.faults.append(f)
                    self._faults_of.setdefault(f.rid, []).append(f)
            rep.fired, rep.hang_at = (), None
            rep.run = (t0, s0, y, dt)
            if self.trace is not None:
                self.trace.append(f"t={self.now:.2f} yield {rid} at {y}")
            self._push(max(0.0, t0 + (y - s0) * dt - self.now) + 0.01, rep, Outcome.YIELDED, new=(r, y))

    def _abort_join(self, a: AbortJoin) -> None:
        """Members still waiting in the rendezvous of a.prefix leave it now (collective_failed)."""
        for rid in sorted(self._rendezvous.pop(a.prefix, ())):
            rep = self.reps[rid]
            if (
                rep.alive
                and not rep.hung
                and rep.call is not None
                and rep.call[0] == self.gen
                and rep.token is not None
            ):
                level = "outer" if "/outer" in a.prefix else "inner"
                self._push(0.05, rep, CFAILED, effect=lambda rep, level=level: setattr(rep, level, None))

    def _kill(self, rid: str, reason: str) -> None:
        rep = self.reps[rid]
        if self.trace is not None:
            self.trace.append(f"t={self.now:.2f} kill {rid} {reason}")
        if not (rep.alive and rep.hung and self.now >= rep.hang_at):
            self.violation(f"killed {rid} ({reason}), which did not hang: alive={rep.alive} hang_at={rep.hang_at}")
        if rep.alive:
            rep.alive, rep.died_at = False, self.now
        rep.hang_at = None
        rep.call = rep.token = rep.run = None
        rep.inner = rep.outer = None
        self.running.discard(rid)
        self._fail_readers(rid)

    # -- answers ---------------------------------------------------------------------------------------
    def _push(self, delay: float, rep: Rep, outcome: Outcome, new=None, effect=None) -> None:
        rep.token = next(self._tokens)
        heapq.heappush(
            self.events, (self.now + delay, next(self._seq), rep.token, rep.rid, (rep.call, outcome, new, effect))
        )

    def _deliver(self, token: int | None, rid: str | None, payload) -> None:
        if token is None:
            payload(self)
            return
        rep = self.reps[rid]
        if rep.token != token:
            return  # cancelled: the replica crashed or was killed, or its group broke earlier
        call, outcome, new, effect = payload
        if self.trace is not None:
            self.trace.append(f"t={self.now:.2f} answer g{call[0]} #{call[1]} {rid} {outcome.value} {new}")
        rep.call = rep.token = rep.run = None
        self.running.discard(rid)
        if outcome == DIED:
            rep.alive = False
        elif rep.alive:
            if new is not None:
                self._move(rep, new)
            if effect is not None:
                effect(rep)
        actions = []
        if self.m is not None and call[0] == self.gen:
            result = Answer(call[1], rid, outcome, rep.round if rep.alive else -1, rep.step if rep.alive else -1)
            actions = self.m.observe(result, self.now)
        self.carry_out(actions)

    def _move(self, rep: Rep, new: tuple[int, int]) -> None:
        if new < rep.pos:
            self.violation(f"{rep.rid} went back from {rep.pos} to {new}")
        rep.round, rep.step = new

    def _pos_now(self, rep: Rep) -> tuple[int, int]:
        if rep.run is None:
            return rep.pos
        t0, s0, stop, dt = rep.run
        return (rep.round, min(stop, s0 + int((self.now - t0) / dt + 1e-9)))

    def _take_faults(self, rid: str, kind: str, round_index: int, lo: int = 0, hi: int = 0) -> list[Fault]:
        """Faults of `rid` due in this call (run_inner: at an in-round step in [lo, hi))."""
        out = []
        for f in self._faults_of.get(rid, ()):
            if (
                f.kind == kind
                and (f.round is None or f.round == round_index)
                and (kind != "run_inner" or lo <= f.step < hi)
            ):
                out.append(f)
        return out

    def _consume(self, faults) -> None:
        for f in faults:
            if f in self.faults:
                self.faults.remove(f)
                self._faults_of[f.rid].remove(f)

    def _group_peers(self, a, rid: str) -> list[str]:
        if a.kind == "outer_commit":
            return [x for x in self.topo.cluster_members(self.topo.cluster_of(rid)) if x in a.calls and x != rid]
        if a.kind == "heal":
            return []
        return [x for x in a.calls if x != rid]

    def _break_group(self, rep: Rep, level: str | None = None) -> None:
        if level in (None, "inner") and rep.inner is not None and len(rep.inner[1]) > 1:
            rep.inner = None
        if level in (None, "outer") and rep.outer is not None and len(rep.outer[1]) > 1:
            rep.outer = None

    def _check_group(self, a, members: list[str], level: str) -> bool:
        """Every live member holds the same usable group, made of exactly `members`. A group of
        one needs no configuring (a fresh process is its own group of one)."""
        ok = True
        for rid in members:
            rep = self.reps[rid]
            if not rep.alive:
                continue
            group = rep.inner if level == "inner" else rep.outer
            if len(members) == 1 and (group is None or len(group[1]) == 1):
                continue
            if group is None:
                self.violation(f"{a.kind} on {rid}: its {level} group is not configured or broken")
                ok = False
            elif tuple(group[1]) != tuple(members):
                self.violation(f"{a.kind} on {rid}: {level} group {group} is not {tuple(members)}")
                ok = False
        return ok

    @staticmethod
    def _hang(rep: Rep, at: float) -> None:
        if rep.hang_at is None:  # hung once, hung for good (until it is killed)
            rep.hang_at = at

    def _simple(self, a, rid: str, delay: float, outcome: Outcome, new=None, effect=None) -> None:
        self._push(delay, self.reps[rid], outcome, new, effect)

    def _fail_on_hang_or_death(
        self,
        a,
        rids: list[str],
        kind: str,
        round_index: int,
        *,
        ok_delay: float,
        fail_wait: float,
        level: str,
        effect=None,
        new=None,
        group_size: int | None = None,
    ) -> None:
        """A fixed-work collective (configure, outer_reduce, one cluster's commit): faults fire
        at its start; a death or collective failure fails the peers fast (a rendezvous waits
        its timeout), a hang at the peers' timeout."""
        faults = {rid: self._take_faults(rid, kind, round_index) for rid in rids}
        self._consume([f for fs in faults.values() for f in fs])
        dying = [rid for rid, fs in faults.items() if any(f.what == "die" for f in fs)]
        hanging = [rid for rid, fs in faults.items() if any(f.what == "hang" for f in fs) and rid not in dying]
        broken = any(f.what == "collective" for fs in faults.values() for f in fs)
        applied = {x for fs in faults.values() for f in fs for x in f.applied}
        for rid in dying:
            self._simple(a, rid, ok_delay / 2 + 0.1, DIED)
        for rid in hanging:
            self._hang(self.reps[rid], self.now + ok_delay / 2)
        rest = [rid for rid in rids if rid not in dying and rid not in hanging]
        size = len(rids) if group_size is None else group_size
        if (dying or hanging) and size > 1 or broken:
            wait = fail_wait if (hanging and not dying and not broken) or kind.startswith("configure") else 0.01
            for rid in rest:
                if rid in applied:
                    self._simple(a, rid, ok_delay, DONE, new, effect)
                else:
                    self._break_group(self.reps[rid], level)
                    if kind.startswith("configure"):
                        setattr(self.reps[rid], level, None)
                    self._simple(a, rid, ok_delay / 2 + wait, CFAILED)
            return
        for rid in rest:
            self._simple(a, rid, ok_delay, DONE, new, effect)

    def _split(self, a, rids: list[str], round_index: int):
        """Answer the dead, the behind and the ahead at once; return those at the round."""
        at_round = []
        for rid in rids:
            rep = self.reps[rid]
            if not rep.alive:
                self._simple(a, rid, 0.1, DIED)
            elif rep.hung:
                continue  # a hung replica answers nothing; its peers wait for it
            elif rep.round < round_index:
                self._simple(a, rid, 0.01, BEHIND)
            elif rep.round > round_index:
                self._simple(a, rid, 0.01, DONE)  # already committed here: a no-op
            else:
                at_round.append(rid)
        return at_round

    # -- the replicas' phase methods -----------------------------------------------------------------------
    def _configure(self, a, level: str) -> bool:
        """The join a call that forms its level's group starts with (forms_group): True when every
        member joined (the call goes on); else they answer as a failed rendezvous does (a missing
        member: the others wait out the configure timeout) and the call ends there. Faults of kind
        configure_<level> fire in the join."""
        order = sorted(a.calls, key=lambda rid: a.calls[rid].join.rank)
        prefixes = {c.join.prefix for c in a.calls.values()}
        sizes = {c.join.world_size for c in a.calls.values()}
        if len(prefixes) != 1 or sizes != {len(order)}:
            self.violation(f"configure_{level} with prefixes {prefixes} sizes {sizes} for {order}")
        group = (next(iter(prefixes)), tuple(order))
        live = []
        for rid in order:
            if not self.reps[rid].alive:
                self._simple(a, rid, 0.1, DIED)
            elif not self.reps[rid].hung:  # (a hung one answers nothing)
                live.append(rid)
        if len(live) < len(order) and len(order) > 1:
            for rid in live:  # the rendezvous waits for the dead one until its timeout, or an abort
                self._simple(a, rid, self.configure_timeout_s, CFAILED, effect=lambda rep: setattr(rep, level, None))
            self._rendezvous[group[0]] = set(live)
            return False
        kind = f"configure_{level}"
        if any(self._take_faults(rid, kind, a.round) for rid in live):
            self._rendezvous[group[0]] = set(live)  # a death there leaves the others waiting in it
            self._fail_on_hang_or_death(
                a,
                live,
                kind,
                a.round,
                ok_delay=0.2,
                fail_wait=self.configure_timeout_s,
                group_size=len(order),
                level=level,
            )
            return False
        for rid in live:
            setattr(self.reps[rid], level, group)
        return True

    def _do_heal(self, a) -> None:
        for target, (source, scope) in ((t, (h.source, h.scope)) for t, h in a.calls.items()):
            t, s = self.reps[target], self.reps[source]
            hangs = self._take_faults(source, "heal_source", a.round)  # the source hangs serving its state
            self._consume(hangs)
            if hangs and s.alive and scope == "full":
                self._hang(s, self.now)
            if s.hung and t.alive and scope == "full":  # (`global` reads on the control channel, which answers)
                self._sourcing.setdefault(source, set()).add(target)
                continue  # the target waits for the state; it never starts, and never answers
            if s.alive and self.m is not None:  # the supervisor saw the source's state arrive
                self.m.observe(StateReady(a.id, source), self.now)
            if not t.alive:
                self._simple(a, target, 0.1, DIED)
                continue
            if t.hung:
                continue
            if scope == "full" and s.call is not None:
                self.violation(f"full heal of {target} from {source}, which is busy with {s.call}")
            if not s.alive:
                self._simple(a, target, 0.1, CFAILED, effect=self._source_lost(source))
                continue
            faults = self._take_faults(target, "heal", a.round)
            self._consume(faults)
            if any(f.what == "die" for f in faults):
                self._simple(a, target, 0.2, DIED)
                continue
            if any(f.what == "hang" for f in faults):
                self._hang(t, self.now + 0.1)
                continue
            new = s.pos if scope == "full" else (s.round, s.round * self.spr)
            if new < t.pos:
                self.violation(f"heal of {target} at {t.pos} from {source} at {new}: it would go back")
            if scope == "global" and self.topo.cluster_of(source) == self.topo.cluster_of(target):
                self.violation(f"global heal of {target} from its own cluster's {source}")
            self._simple(a, target, 0.3, DONE, new=max(new, t.pos))
            self._sourcing.setdefault(source, set()).add(target)

    def _source_lost(self, source: str):
        def tell(rep):
            # the supervisor saw the source's ActorDiedError in the target's error: it tells the machine
            if self.report_heal_source_deaths and self.m is not None:
                self.carry_out(self.m.observe(Lost(source), self.now))

        return tell

    def _do_run_inner(self, a) -> None:
        if a.forms_group and not self._configure(a, "inner"):
            return
        r = a.round
        members = list(a.calls)
        runners = self._split(a, members, r)
        if not runners:
            return
        self._check_group(a, members, "inner")
        if any(self.reps[x].inner is None and len(members) > 1 for x in runners):
            for x in runners:  # a collective over a group that is not there fails at once
                self._simple(a, x, 0.01, CFAILED)
            return
        steps = {self.reps[x].step for x in runners}
        if len(steps) > 1:
            self.violation(
                f"run_inner of c{a.cluster} with members at different steps { {x: self.reps[x].pos for x in runners} }"
            )
        s0 = min(steps)
        planned = {a.calls[x].steps for x in runners} - {None}  # sync.balance's steps, the close's end
        p0, end = s0 - r * self.spr, r * self.spr + (planned.pop() if planned else self.spr)
        end = max(end, s0)  # (already there: it answers at once)
        dt = max([self.step_s] + [self.slow.get(x, 0.0) for x in runners])
        if len(runners) < len(members) and len(members) > 1:
            dead_peer = any(not self.reps[x].alive for x in members)
            for x in runners:  # a peer is missing from the group: its first collective fails
                self._break_group(self.reps[x], "inner")
                self._simple(a, x, 0.01 if dead_peer else self.timeout_s, CFAILED)
            return
        due = [f for x in runners for f in self._take_faults(x, "run_inner", r, p0, end - r * self.spr)]
        for x in runners:
            self.reps[x].run = (self.now, s0, end, dt)
            self.running.add(x)
            self.reported[x] = s0
        if not due:
            for x in runners:
                self._simple(a, x, (end - s0) * dt, DONE, new=(r, end))
            return
        p = min(f.step for f in due)
        fired = [f for f in due if f.step == p]
        self._consume(fired)
        for x in runners:
            self.reps[x].fired = tuple(fired)
        at, stop = (p - p0) * dt, r * self.spr + p
        dying = {f.rid for f in fired if f.what == "die"}
        hanging = {f.rid for f in fired if f.what == "hang"} - dying
        broken = any(f.what == "collective" for f in fired)
        applied = {x for f in fired for x in f.applied}
        for x in runners:
            self.reps[x].run = (self.now, s0, stop, dt)
        for x in sorted(dying):  # (sorted: the same seed gives the same run, whatever the hash seed)
            self._simple(a, x, at + 0.1, DIED)
        for x in sorted(hanging):
            self._hang(self.reps[x], self.now + at)
        wait = self.timeout_s if hanging and not dying and not broken else 0.01
        for x in runners:
            if x in dying or x in hanging:
                continue
            if len(members) == 1 and not broken:
                continue
            self._break_group(self.reps[x], "inner")
            done = stop + 1 if x in applied else stop
            self.reps[x].run = (self.now, s0, done, dt)
            self._simple(a, x, at + wait, CFAILED, new=(r, done))

    def _do_cluster_average(self, a) -> None:
        members = list(a.calls)
        runners = self._split(a, members, a.round)
        self._check_group(a, members, "inner")
        if len(runners) < len(members) and len(members) > 1:
            dead = any(not self.reps[x].alive for x in members)
            for x in runners:
                self._break_group(self.reps[x], "inner")
                self._simple(a, x, 0.01 if dead else self.timeout_s, CFAILED)
            return
        self._fail_on_hang_or_death(
            a,
            runners,
            "cluster_average",
            a.round,
            ok_delay=0.2,
            fail_wait=self.timeout_s,
            group_size=len(a.calls),
            level="inner",
        )

    def _do_outer_reduce(self, a) -> None:
        if a.forms_group and not self._configure(a, "outer"):
            return
        r = a.round
        leaders = list(a.calls)
        runners = self._split(a, leaders, r)
        for x in runners:  # at its round's end, or where the close ended its cluster's (what the record says)
            taken = self.m.steps_taken(self.topo.cluster_of(x)) if self.m is not None else self.spr
            if self.reps[x].step != r * self.spr + taken:
                self.violation(f"outer_reduce on {x} at {self.reps[x].pos}: its inner phase is not done ({taken})")
        if self.settings.outer != "none":
            self._check_group(a, leaders, "outer")
            if len(leaders) > 1 and any(self.reps[x].outer is None for x in runners):
                for x in runners:
                    self._simple(a, x, 0.01, CFAILED)
                return
            groups = {self.reps[x].outer for x in runners}
            if len(leaders) == 1 and any(g is not None and len(g[1]) > 1 for g in groups):
                for x in runners:  # an all-reduce over a stale group of several: nobody else comes
                    self._simple(a, x, self.timeout_s, CFAILED, effect=lambda rep: setattr(rep, "outer", None))
                return
        if len(runners) < len(leaders) and len(leaders) > 1:
            dead_peer = any(not self.reps[x].alive for x in leaders)
            for x in runners:
                self._break_group(self.reps[x], "outer")
                self._simple(a, x, 0.01 if dead_peer else self.timeout_s, CFAILED)
            return
        # what the mean is over: the clusters (members of a cluster hold the same params at the round's end)
        content = (r, a.epoch, tuple(sorted({self.topo.cluster_of(x) for x in leaders})))

        def reduced(rep):
            if rep.buffer is None or rep.buffer[:2] != (r, a.epoch):  # idempotent per (round, epoch)
                rep.buffer = content

        self._fail_on_hang_or_death(
            a,
            runners,
            "outer_reduce",
            r,
            ok_delay=1.0,
            fail_wait=self.timeout_s,
            effect=reduced,
            group_size=len(leaders),
            level="outer",
        )

    def _do_outer_commit(self, a) -> None:
        r = a.round
        by_cluster: dict[int, list[str]] = {}
        for rid in a.calls:
            by_cluster.setdefault(self.topo.cluster_of(rid), []).append(rid)
        buffers = {}
        for c, called in sorted(by_cluster.items()):
            runners = self._split(a, called, r)
            roots = {a.calls[x].roots for x in called}
            group = next((self.reps[x].inner for x in runners if self.reps[x].inner is not None), None)
            members = list(group[1]) if group is not None else called
            self._check_group(a, members, "inner")
            # the leader path: one shard, held by the leader (roots = (its inner rank,))
            only = next(iter(roots)) if len(roots) == 1 else ()
            root = members[only[0]] if len(only) == 1 and only[0] < len(members) else None
            if root is None:
                self.violation(f"outer_commit of c{c}: roots {roots} for members {members}")
            elif self.reps[root].alive and root in runners:
                buf = self.reps[root].buffer
                if self.settings.outer != "none" and (buf is None or buf[0] != r):
                    self.violation(f"outer_commit of c{c}: root {root} holds no reduced buffer for round {r}: {buf}")
                buffers[c] = buf
            missing = [x for x in members if x not in runners]
            if group is None and len(members) > 1:
                missing = missing or members
            delay = self.commit_s.get(c, 0.5)

            buf = buffers.get(c)

            def applied(rep, buf=buf):
                rep.applied = buf

            if missing and len(members) > 1:
                dead = any(not self.reps[x].alive for x in missing)
                for x in runners:
                    self._break_group(self.reps[x], "inner")
                    self._simple(a, x, 0.01 if dead else self.timeout_s, CFAILED)
                continue
            self._fail_on_hang_or_death(
                a,
                runners,
                "outer_commit",
                r,
                ok_delay=delay,
                fail_wait=self.timeout_s,
                new=(r + 1, (r + 1) * self.spr),
                effect=applied,
                group_size=len(members),
                level="inner",
            )
        contents = {b for b in buffers.values()}
        if len(contents) > 1:
            self.violation(f"commit of round {r} with different reduced buffers across clusters: {contents}")


def outcome_of(world: World, m: RoundMachine) -> str:
    assert not world.violations, "the machine broke a promise:\n" + "\n".join(world.violations)
    return m.outcome
